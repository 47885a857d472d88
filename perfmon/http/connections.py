"""The client connections the agent's server holds: each one's state, the selectors that watch them,
eviction for a newcomer at the cap, and cutting those past their deadline.

Used from the server's one thread only (``agent_server.py``): no lock.
"""

from __future__ import annotations

import math
import selectors
import socket
import time
from collections.abc import Iterator

from ..selfcost import HttpShedding
from .wire import close_quietly

__all__ = ["WAKE", "Conn", "ConnectionTable"]

#: The selector data of the socket that stop() writes to, to wake the loop.
WAKE = object()
#: Eviction never picks a connection that delivered a byte within this long.
_EVICT_QUIET_SECONDS = 1.0


class Conn:
    """One client connection: what it sent that is not parsed yet, and what is left to send it."""

    __slots__ = ("address", "closing", "deadline", "draining", "got", "hold", "inbox", "outbox", "queued",
                 "received_at", "requests", "rest", "scraper", "since", "sock", "watching")

    def __init__(self, sock: socket.socket, address: str, now: float, timeout: float) -> None:
        self.sock = sock
        self.address = address
        self.inbox = bytearray()
        self.received_at = now  # time.monotonic() of the last read: everything in the inbox was sent before
        self.got = False  # it has sent at least one byte
        self.outbox: memoryview | None = None
        #: A large body to send after ``outbox`` (its answer's head), not copied into it, and what keeps it alive
        #: (``wire.SharedBody``: one copy for every connection sending it).
        self.rest: memoryview | None = None
        self.hold: object = None
        self.queued = False  # a complete request of it waits in the server's ready queue
        self.watching = 0  # the selector events registered for it (0: none)
        self.closing = False
        self.draining = -1  # bytes discarded after a refusal; -1 while the connection is live
        self.requests = 0
        self.since = now  # when the request now being received began (or the connection went idle)
        self.deadline = now + timeout
        #: It has been answered a scrape (/metrics 200): a keep-alive scraper, read by the health lane too.
        self.scraper = False


class ConnectionTable:
    """The connections held, and the two selectors that watch them and the listener.

    ``selector`` is the loop's: the listener, the wake socket and every connection for what it waits on
    (``watch``). ``lane`` is the health lane's: the listener (while the lane may accept), the wake socket,
    the connections accepted in the last moments that have sent nothing yet (a probe's request is a few
    ms behind its connection) and keep-alive scrapers waiting for their next scrape (``young``: conn ->
    until when).
    """

    def __init__(self, listener: socket.socket, wake: socket.socket, shedding: HttpShedding) -> None:
        self.listener = listener
        self.shedding = shedding
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ, None)
        self.selector.register(wake, selectors.EVENT_READ, WAKE)
        self.lane = selectors.DefaultSelector()
        self.lane.register(listener, selectors.EVENT_READ, None)
        self.lane.register(wake, selectors.EVENT_READ, WAKE)
        self.young: dict[Conn, float] = {}
        self.lane_accepting = True  # the listener is in the lane's selector (not while the lane is in debt)
        self._held: set[Conn] = set()

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, conn: object) -> bool:
        return conn in self._held

    def __iter__(self) -> Iterator[Conn]:
        return iter(self._held)

    def add(self, conn: Conn) -> None:
        self._held.add(conn)

    def watch(self, conn: Conn, events: int) -> None:
        """Register the selector events to wait for on this connection (0: none)."""
        if events == conn.watching:
            return
        if events == 0:
            self.selector.unregister(conn.sock)
        elif conn.watching == 0:
            self.selector.register(conn.sock, events, conn)
        else:
            self.selector.modify(conn.sock, events, conn)
        conn.watching = events
        if conn.scraper:
            # A keep-alive scraper waiting for its next request is watched by the health lane as well, so
            # its scrape is read (and queued ahead of the rest) while triage is in debt.
            if events == selectors.EVENT_READ and conn not in self.young:
                self.watch_young(conn, math.inf)
            elif events != selectors.EVENT_READ and conn in self.young:
                self.unyoung(conn)

    def watch_young(self, conn: Conn, until: float) -> None:
        """Have the health lane read this connection too, until ``until`` (``time.monotonic()``)."""
        try:
            self.lane.register(conn.sock, selectors.EVENT_READ, conn)
            self.young[conn] = until
        except (KeyError, ValueError, OSError):
            pass

    def unyoung(self, conn: Conn) -> None:
        self.young.pop(conn, None)
        try:
            self.lane.unregister(conn.sock)
        except (KeyError, ValueError, OSError):
            pass

    def expire_young(self, now: float) -> None:
        """Stop the lane reading connections past their time (or gone)."""
        for conn, deadline in list(self.young.items()):
            if now > deadline or conn not in self._held:
                self.unyoung(conn)

    def lane_accepts(self, accepting: bool) -> None:
        """Put the listener in the lane's selector, or take it out (the lane's allowance is spent)."""
        if accepting != self.lane_accepting:
            if accepting:
                self.lane.register(self.listener, selectors.EVENT_READ, None)
            else:
                self.lane.unregister(self.listener)
            self.lane_accepting = accepting

    def evict_slowest(self, silent_for: float = 0.0) -> bool:
        """Close, for a newcomer, the oldest connection that never sent a byte (and has been connected at
        least ``silent_for`` seconds); else the one quiet longest (none that delivered a byte within
        ``_EVICT_QUIET_SECONDS``). False if there is none to close."""
        silent = None
        quiet = None
        now = time.monotonic()
        cutoff = now - _EVICT_QUIET_SECONDS
        for c in self._held:
            if c.outbox is not None or c.queued:
                continue  # being answered, or its request waits its turn
            if not c.got:
                if c.since <= now - silent_for and (silent is None or c.since < silent.since):
                    silent = c
            elif c.received_at < cutoff and not c.scraper and (quiet is None or c.received_at < quiet.received_at):
                quiet = c  # never a keep-alive scraper between its scrapes: it is the one client that matters
        victim = silent or quiet
        if victim is None:
            return False
        self.shedding.refused["evicted"] += 1
        self.drop(victim)
        return True

    def reap(self, now: float) -> None:
        # A queued request waits on this server (its budget), not on the client: it is not cut.
        for conn in [c for c in self._held if now > c.deadline and not c.queued]:
            # Counted: a request or an answer stuck halfway, or a connection that never sent one. Not
            # counted: a keep-alive connection idle after its answers (a scraper's, between scrapes),
            # and a refused one lingering (counted when it was refused).
            stuck = bool(conn.inbox) or conn.outbox is not None or conn.requests == 0
            if stuck and conn.draining < 0:
                self.shedding.refused["timeout"] += 1
            self.drop(conn)

    def drop(self, conn: Conn) -> None:
        if conn in self.young:
            self.unyoung(conn)
        if conn not in self._held:
            return
        self._held.discard(conn)
        if conn.watching:
            try:
                self.selector.unregister(conn.sock)
            except (KeyError, ValueError, OSError):
                pass
            conn.watching = 0
        close_quietly(conn.sock)

    def drop_all(self) -> None:
        for conn in list(self._held):
            self.drop(conn)

    def close_sockets(self) -> None:
        """In a forked child: close the inherited connections without touching the selectors' state."""
        for conn in list(self._held):
            close_quietly(conn.sock)

    def close_selectors(self) -> None:
        close_quietly(self.selector)
        close_quietly(self.lane)
