"""The agent's own HTTP server: one thread, one selector, a CPU budget.

Why not a thread per connection (stdlib ``wsgiref``, what prometheus_client's ``start_http_server``
does): in the model's process every connection then costs a thread start, an email-parser header
parse and a WSGI environ, all holding the GIL the model needs between its ops. Measured here
(``benchmarks/hostile.py``) a flood of slowloris sockets, 50 scrapes a second and a bad-token loop
left an in-process model at 0.83x the throughput of an unflooded twin (0.96-1.02x with this server).
This server instead:

- multiplexes every connection on one thread with ``selectors``: an idle or slow socket costs a file
  descriptor, not a thread; only a complete request line and headers are parsed (by hand, bounded);
- spends from two ``CpuBudget`` buckets: triage (accept, one read per readable connection, /healthz
  answered at once from a precomputed answer; half of ``http_cpu_budget`` on top of it) and work
  (``http_cpu_budget`` of one core: scrapes first, everything else only above a reserve kept for
  scrapes). Every CPU second of the loop is charged to one of them, so no client can make the agent
  take more than 1.5x its budget from the model; what waits stays parked or in the kernel's queue.
  Full garbage collections that run on the loop's thread are left out (``ThreadGc``): one is the
  heap's work (0.3-1 s in a large server), and charged it put the budget a minute in debt;
- reads everything that arrived before answering, and answers every ``/metrics`` request that was
  read before a render started from that render (per format): 50 scrapers cost one render;
- at the connection cap, closes the oldest connection that never sent a byte (else the one quiet
  longest) for a newcomer that has sent its request, and refuses a newcomer that has sent nothing;
  cuts any connection that holds a request open longer than ``http_connection_timeout_seconds``;
  refuses addresses that keep failing authentication (``AuthThrottle``) before routing anything.

Everything the server refuses or cuts is counted in ``perfmon_agent_http_refused_total{reason}``,
the time it paused in ``perfmon_agent_http_paused_seconds_total``.

This module is the loop: when to read, accept and answer, and which allowance pays. What a connection's
bytes mean (read, parse, answer, write) is ``exchange.py``; the connections held and the selectors that
watch them, eviction and deadlines are ``connections.py``.
"""

from __future__ import annotations

import collections
import functools
import selectors
import threading
import time
from collections.abc import Callable

from ..faults import InternalErrors
from ..selfcost import AgentCpu, CpuBudget, HttpShedding
from ..telemetry.gcpauses import ThreadGc
from .connections import WAKE, Conn, ConnectionTable
from .exchange import Exchange, Ready
from .routes import Router
from .security import AuthThrottle
from .wire import Response, SharedRenders, Waker, bind_listener, close_quietly, encode_response, send_and_close

__all__ = ["MAX_CONNECTIONS", "AgentServer"]

#: Connections held at once. An idle one costs a file descriptor; at the cap the slowest is closed.
MAX_CONNECTIONS = 128
#: CPU seconds the budget lets the server spend at once (one large render or trace download).
BUDGET_BURST_SECONDS = 0.1
#: Longest sleep while paused for the budget (the pause time is counted in these slices).
_PAUSE_SLICE_SECONDS = 0.1
#: New connections taken per loop turn (the rest wait in the kernel's queue for the next turn).
_ACCEPTS_PER_TURN = 64
#: Triage's allowance, as a share of ``http_cpu_budget`` (on top of it), and its burst.
TRIAGE_SHARE = 0.5
TRIAGE_BURST_SECONDS = 0.02
#: The health lane (new and just-accepted connections only, while triage is in debt) spends from its own
#: allowance, this share of the budget: a probe is a new connection, so it is served ahead of the
#: sockets a flood keeps open, and a flood of new connections costs at most this much more.
LANE_SHARE = 1.0
#: Requests other than scrapes and health checks (/stats, the page, control routes, 404s, bad
#: credentials) run only while the work budget holds more than this: the rest is kept for scrapes.
SCRAPE_RESERVE_SECONDS = 0.05
#: CPU seconds a lane pass may spend reading scrapers and just-accepted connections when its allowance
#: is spent (the listener is then not served): a few requests.
_LANE_READ_SECONDS = 0.001
#: A connection that has sent nothing is displaced by a newcomer that has sent nothing either only
#: once it has been connected this long (a real client sends its request within milliseconds).
_SILENT_GRACE_SECONDS = 0.5

_BUSY = Response.json(503, {"error": "too many connections"})


class AgentServer:
    """The agent's own HTTP/1.1 server on one daemon thread (see the module docstring).

    With ``port_range`` > 1 it binds the first free port of ``port .. port + port_range - 1``: each
    worker of a multi-process server (gunicorn, uvicorn --workers, a fork after loading the model)
    gets its own port, reported in ``perfmon_info{port}``, and a scrape config listing the range
    reaches every worker exactly once.
    """

    def __init__(self, router: Router, host: str, port: int, *, port_range: int = 1,
                 connection_timeout: float = 30.0, cpu_budget: float = 0.01,
                 throttle: AuthThrottle | None = None, cpu: AgentCpu | None = None,
                 shedding: HttpShedding | None = None, internal: InternalErrors | None = None,
                 gc_clock: ThreadGc | None = None) -> None:
        self.router = router
        self.host = host
        self.timeout = connection_timeout
        self.budget = CpuBudget(cpu_budget, BUDGET_BURST_SECONDS)
        #: Triage (accept, one read per readable connection, /healthz answered at once) has its own small
        #: allowance, so it goes on while the work budget is in debt, yet a flood of it is bounded too.
        self.triage = CpuBudget(cpu_budget * TRIAGE_SHARE, TRIAGE_BURST_SECONDS, resume_seconds=0.0005)
        self.lane = CpuBudget(cpu_budget * LANE_SHARE, TRIAGE_BURST_SECONDS, resume_seconds=0.0005)
        self.throttle = throttle if throttle is not None else AuthThrottle()
        self.cpu = cpu if cpu is not None else AgentCpu()
        self.shedding = shedding if shedding is not None else HttpShedding()
        self.internal = internal if internal is not None else InternalErrors()
        #: Full collections that run on the loop's thread are the heap's work, not the agent's: no budget pays them.
        self.gc_clock = gc_clock if gc_clock is not None else ThreadGc()
        self._listener = bind_listener(host, port, port_range)
        self.port = int(self._listener.getsockname()[1])
        router.bound = str(self._listener.getsockname()[0])  # the address the peer check compares against
        self._waker = Waker()
        #: The connections and the two selectors: the loop's, and the health lane's (the listener, the wake
        #: socket, the connections accepted in the last _SILENT_GRACE_SECONDS that have sent nothing yet (a
        #: probe's request is a few ms behind its connection) and keep-alive scrapers between scrapes).
        self._conns = ConnectionTable(self._listener, self._waker.sock, self.shedding)
        #: Requests read and waiting for the work budget: scrapes first, then the rest (ready queue by class).
        self._scrapes: Ready = collections.deque()
        self._others: Ready = collections.deque()
        #: The last shared render per key (see ``Exchange.answer``): at most 7 whatever the clients send.
        self._renders: SharedRenders[Response] = SharedRenders()
        self._exchange = Exchange(router, self._conns, timeout=connection_timeout, throttle=self.throttle,
                                  shedding=self.shedding, scrapes=self._scrapes, others=self._others,
                                  renders=self._renders)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="perfmon-http", daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def connections(self) -> int:
        """Client connections held now."""
        return len(self._conns)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_seconds: float) -> None:
        """Stop the loop, close every socket; bounded by ``timeout_seconds``."""
        self._stop.set()
        self._waker.wake()
        if self._thread.is_alive():
            self._thread.join(timeout_seconds)
        if not self._thread.is_alive():  # finished, or never started
            self._close_all()
        else:  # stuck in a handler: at least free the port
            close_quietly(self._listener)

    def abandon(self) -> None:
        """In a forked child: close the inherited sockets (the parent keeps serving on them)."""
        self._conns.close_sockets()
        close_quietly(self._listener)
        self._waker.close()
        self._conns.close_selectors()

    # -- the loop --------------------------------------------------------------------------------

    def _cpu(self) -> float:
        """The loop thread's CPU seconds less the full collections that ran on it: what the budgets are charged."""
        return time.thread_time() - self.gc_clock.seconds()

    def _serve(self) -> None:
        self.gc_clock.bind()
        try:
            while not self._stop.is_set():
                c0 = time.thread_time()
                self.cpu.woke("http")
                try:
                    self._turn()
                except Exception as exc:  # never let the loop die: count it and go on
                    self.internal.report("http", exc)
                    self._stop.wait(0.01)
                self.cpu.add("http", time.thread_time() - c0)
        finally:
            self.gc_clock.unbind()
            self._close_all()

    def _work_wait(self) -> float | None:
        """Seconds until queued work may run (0: now), None when nothing is queued."""
        if self._scrapes:
            return self.budget.wait_seconds()
        if self._others:
            short = SCRAPE_RESERVE_SECONDS - self.budget.available()
            return 0.0 if short < 0 else short / self.budget.fraction
        return None

    def _turn(self) -> None:
        """One turn: triage what arrived (its own allowance), then answer queued requests (the work budget).

        Triage goes on while the work budget is in debt, so a health check is read and answered, and a
        scrape is read and queued ahead of the rest, whatever else waits. Nothing is read while triage
        itself is in debt: readable sockets stay readable (level-triggered) for a later turn, and the
        loop sleeps rather than polling them.
        """
        turn0 = self._cpu()
        work_spent = lane_spent = 0.0
        work = self._work_wait()
        triage_wait = self.triage.wait_seconds()
        if triage_wait > 0:
            pause = min(triage_wait, work if work else _PAUSE_SLICE_SECONDS, _PAUSE_SLICE_SECONDS)
            t0 = time.monotonic()
            c0 = self._cpu()
            self._lane_pass(pause)  # new connections (health probes) still get in
            lane_spent = self._cpu() - c0  # charged to the lane, not to triage
            self.shedding.paused_seconds += time.monotonic() - t0
        else:
            # Idle, the loop sleeps until a socket or its next connection deadline (None: no connection, no work):
            # a wake is a GIL hand-off the serving thread pays for (docs/design.md, "What the agent costs").
            timeout = None if work is None else min(work, _PAUSE_SLICE_SECONDS)
            if self._conns and (timeout is None or timeout > 0):
                until = max(0.0, min(c.deadline for c in self._conns) - time.monotonic())
                timeout = until if timeout is None else min(timeout, until)
            t0 = time.monotonic()
            events = self._conns.selector.select(timeout)
            if work is not None and work > 0:  # requests waited for the budget meanwhile
                self.shedding.paused_seconds += time.monotonic() - t0
            self._triage(events, self._cpu() + self.triage.available())
        if self._work_wait() == 0:
            c0 = self._cpu()
            self._work(c0)
            work_spent = self._cpu() - c0
            self.budget.charge(work_spent)
        # Triage pays for the rest of the turn too (select, sleeping, bookkeeping): every CPU second the
        # loop spends is charged to one bucket or the other.
        self.triage.charge(self._cpu() - turn0 - work_spent - lane_spent)

    def _triage(self, events: list[tuple[selectors.SelectorKey, int]], limit: float) -> None:
        now = time.monotonic()
        for key, mask in events:
            if self._cpu() > limit:
                break  # the rest stay ready for the next turn
            conn: Conn | None = key.data
            if conn is None:
                self._accept(now, limit)
                continue
            if conn is WAKE:  # stop() (the loop condition sees it)
                continue
            self._guard(conn, self._exchange.flush if mask & selectors.EVENT_WRITE else self._exchange.read, now)
        self._conns.reap(now)

    def _work(self, c0: float) -> None:
        """Answer queued requests while the budget lasts: scrapes first; the rest only above the reserve."""
        now = time.monotonic()
        while True:
            spent = self._cpu() - c0
            left = self.budget.available() - spent
            if self._scrapes and left > 0:
                conn, request = self._scrapes.popleft()
            elif self._others and left > SCRAPE_RESERVE_SECONDS:
                conn, request = self._others.popleft()
            else:
                return
            conn.queued = False
            if conn in self._conns:
                self._guard(conn, functools.partial(self._exchange.answer, request), now)

    def _guard(self, conn: Conn, step: Callable[[Conn, float], None], now: float) -> None:
        """Run one step for a connection; whatever it raises ends that connection only."""
        try:
            step(conn, now)
        except Exception as exc:
            if not isinstance(exc, OSError):  # a client that vanished is not an agent fault
                self.internal.report("http", exc)
            self._conns.drop(conn)

    def _accept(self, now: float, limit: float) -> None:
        for _ in range(_ACCEPTS_PER_TURN):
            if self._cpu() > limit:
                return
            try:
                sock, address = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and friends: leave the rest queued for a later turn
                self.internal.report("http", exc)
                return
            sock.setblocking(False)
            conn = Conn(sock, str(address[0]), now, self.timeout)
            # Read at once what it already sent (a probe's request usually waited in the kernel's queue
            # with it): a connection that has sent a byte is never picked for eviction.
            try:
                first = sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                first = None
            except OSError:
                first = b""
            if first == b"":  # closed (or reset) before it was accepted: a churning client
                close_quietly(sock)
                continue
            # At the cap, a newcomer that has sent nothing yet (a probe whose request is a few ms behind
            # its SYN, or one more idle socket of a flood) displaces only a connection that has been
            # silent for _SILENT_GRACE_SECONDS; one young and silent itself is never displaced: the
            # probe's request arrives well within the grace, idle sockets of a flood grow old.
            if len(self._conns) >= MAX_CONNECTIONS and not self._conns.evict_slowest(
                    0.0 if first else _SILENT_GRACE_SECONDS):
                self.shedding.refused["busy"] += 1
                send_and_close(sock, encode_response(_BUSY, close=True))
                continue
            self._conns.add(conn)
            self._conns.watch(conn, selectors.EVENT_READ)
            if not first:  # nothing sent yet: watched by the health lane too for a moment
                self._conns.watch_young(conn, now + _SILENT_GRACE_SECONDS)
            if first:
                conn.got = True
                conn.inbox += first
                conn.received_at = time.monotonic()
                self._guard(conn, self._exchange.take, now)

    def _lane_pass(self, timeout: float) -> None:
        """While triage is in debt: serve only new and just-accepted connections, health probes among them.

        Sockets a flood keeps open (keep-alive 404s, /stats pollers, idle sockets) are not looked at, so
        a probe — a new connection — is accepted, read and answered within milliseconds; any other new
        request is read and queued for the work budget as usual. Spends from its own allowance (``lane``).
        Once that is spent too (a flood of new connections), the listener is left to the kernel's queue
        but keep-alive scrapers and just-accepted connections are still read: a scrape costs little, and a
        connection flood must not starve the scraper that already holds a connection.
        """
        wait = self.lane.wait_seconds()
        accepting = wait <= 0
        self._conns.lane_accepts(accepting)
        c0 = self._cpu()
        events = self._conns.lane.select(timeout if accepting else min(timeout, wait))
        now = time.monotonic()
        limit = self._cpu() + max(self.lane.available(), _LANE_READ_SECONDS)
        for key, _ in events:
            if self._cpu() > limit:
                break
            conn: Conn | None = key.data
            if conn is None:
                self._accept(now, limit)
            elif conn is not WAKE and conn in self._conns:
                self._guard(conn, self._exchange.read, now)
        self._conns.expire_young(now)
        self.lane.charge(self._cpu() - c0)

    def _close_all(self) -> None:
        self._conns.drop_all()
        close_quietly(self._listener)
        self._waker.close()
        self._conns.close_selectors()
