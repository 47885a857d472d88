"""``/healthz`` on a port of its own (``health_port``), for the liveness probe.

The agent's main port answers health first (its health lane, agent_server.py), but a probe still shares that
port's accept queue with every other client: a flood of new idle connections from the same machine
(hundreds a second) keeps the queue full, and a probe waits there or its SYN is dropped (p50 1.1 s,
max 4.7 s measured). A listener of its own has a queue of its own, which only the kubelet uses. One
daemon thread multiplexes it with a selector: a client that sends slowly (or never) holds a file
descriptor for at most ``CLIENT_TIMEOUT_SECONDS``, never the thread, so it cannot delay a probe behind
it; at most ``MAX_CLIENTS`` at once (the oldest is closed for a newcomer). The answer is the same
``/healthz`` document as on the main port; anything else is 404. With no client held the thread sleeps until a
socket wants it (``stop()`` wakes it: ``wire.Waker``): on a GIL-bound server each wake is a GIL hand-off, counted as
``perfmon_agent_wakeups_total{thread="health"}``.
"""

from __future__ import annotations

import selectors
import socket
import threading
import time
from collections.abc import Callable

from ..selfcost import AgentCpu
from .wire import Response, Waker, bind_listener, close_quietly, encode_response

__all__ = ["HealthServer"]

#: How long one client may take to send its request (seconds).
CLIENT_TIMEOUT_SECONDS = 1.0
#: Clients held at once; a probe is one short request, so a handful is plenty.
MAX_CLIENTS = 32
#: The selector's key data of the socket ``stop()`` writes to (clients' keys hold their socket, the listener's None).
_WAKER = "waker"
_NOT_FOUND = Response.json(404, {"error": "not found", "detail": "this port serves /healthz only"})


class HealthServer:
    """``GET``/``HEAD /healthz`` on its own port; ``answer(method)`` builds the response (``Router`` does)."""

    def __init__(self, answer: Callable[[str], Response], host: str, port: int, *, port_range: int = 1,
                 cpu: AgentCpu | None = None) -> None:
        self._answer = answer
        self._cpu = cpu if cpu is not None else AgentCpu()
        self._listener = bind_listener(host, port, port_range)  # non-blocking
        self.port = int(self._listener.getsockname()[1])
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        # stop() wakes the loop through it: with no client held it sleeps until a socket wants it (it used to
        # wake 4 times a second to look at deadlines no client had and at stop(): each a GIL hand-off).
        self._waker = Waker()
        self._selector.register(self._waker.sock, selectors.EVENT_READ, _WAKER)
        #: client socket -> (what it sent so far, when it must be done)
        self._clients: dict[socket.socket, tuple[bytes, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="perfmon-health", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_seconds: float) -> None:
        self._stop.set()
        self._waker.wake()
        if self._thread.is_alive():
            self._thread.join(timeout_seconds)
        self._close_all()

    def abandon(self) -> None:
        """In a forked child: close the inherited sockets (the parent keeps serving on them)."""
        self._close_all()

    def _close_all(self) -> None:
        for sock in [*self._clients, self._listener]:
            close_quietly(sock)
        self._waker.close()
        self._clients.clear()
        close_quietly(self._selector)

    def _serve(self) -> None:
        timeout: float | None = None  # no client held: until a socket wants the thread
        while not self._stop.is_set():
            try:
                events = self._selector.select(timeout)
            except (OSError, ValueError):  # closed by stop()
                return
            if self._stop.is_set():
                return
            self._cpu.woke("health")
            c0 = time.thread_time()
            now = time.monotonic()
            for key, _ in events:
                if key.data is None:
                    self._accept(now)
                elif key.data is not _WAKER:
                    self._read(key.fileobj, now)  # type: ignore[arg-type]
            for sock, (_, deadline) in list(self._clients.items()):
                if now > deadline:
                    self._drop(sock)
            # The next deadline of a client held (a slow one is cut then), else none.
            soonest = min((deadline for _, deadline in self._clients.values()), default=None)
            timeout = None if soonest is None else max(0.0, soonest - time.monotonic()) + 0.001
            self._cpu.add("http", time.thread_time() - c0)

    def _accept(self, now: float) -> None:
        for _ in range(MAX_CLIENTS):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of descriptors: the rest wait in the queue
                return
            sock.setblocking(False)
            if len(self._clients) >= MAX_CLIENTS:  # the oldest goes: a probe is never the oldest for long
                self._drop(min(self._clients, key=lambda s: self._clients[s][1]))
            self._clients[sock] = (b"", now + CLIENT_TIMEOUT_SECONDS)
            self._selector.register(sock, selectors.EVENT_READ, sock)

    def _read(self, sock: socket.socket, now: float) -> None:
        try:
            chunk = sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        data, deadline = self._clients.get(sock, (b"", now))
        data += chunk
        if not chunk or len(data) > 4096:
            self._drop(sock)
            return
        # Not wire.parse_request: this port answers GET/HEAD /healthz and 404 to anything else (what the parser
        # would refuse included), as soon as the request line and headers are in, never waiting for a body.
        if b"\n\r\n" not in data and b"\n\n" not in data:
            self._clients[sock] = (data, deadline)
            return
        method, _, rest = data.partition(b" ")
        path = rest.partition(b" ")[0].partition(b"?")[0].rstrip(b"/")
        health = method in (b"GET", b"HEAD") and path == b"/healthz"
        resp = self._answer(method.decode()) if health else _NOT_FOUND
        if method == b"HEAD":
            resp = resp.head()  # never a body after a HEAD answer, a 404 included
        try:
            sock.send(encode_response(resp, close=True))  # a few hundred bytes into a fresh socket's buffer
        except OSError:
            pass
        self._drop(sock)

    def _drop(self, sock: socket.socket) -> None:
        self._clients.pop(sock, None)
        try:
            self._selector.unregister(sock)
        except (KeyError, ValueError, OSError):
            pass
        close_quietly(sock)
