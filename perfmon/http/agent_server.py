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
  take more than 1.5x its budget from the model; what waits stays parked or in the kernel's queue;
- reads everything that arrived before answering, and answers every ``/metrics`` request that was
  read before a render started from that render (per format): 50 scrapers cost one render;
- at the connection cap, closes the oldest connection that never sent a byte (else the one quiet
  longest) for a newcomer that has sent its request, and refuses a newcomer that has sent nothing;
  cuts any connection that holds a request open longer than ``http_connection_timeout_seconds``;
  refuses addresses that keep failing authentication (``AuthThrottle``) before routing anything.

Everything the server refuses or cuts is counted in ``perfmon_agent_http_refused_total{reason}``,
the time it paused in ``perfmon_agent_http_paused_seconds_total``.
"""

from __future__ import annotations

import collections
import functools
import math
import os
import re
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

from ..faults import InternalErrors
from ..selfcost import AgentCpu, CpuBudget, HttpShedding
from .routes import MAX_BODY_BYTES, REASONS, Response, Router, accepts_gzip, metrics_format

__all__ = ["MAX_CONNECTIONS", "AgentServer", "AuthThrottle"]

#: Connections held at once. An idle one costs a file descriptor; at the cap the slowest is closed.
MAX_CONNECTIONS = 128
#: Request line plus headers; more is answered 431.
MAX_HEADER_BYTES = 16 * 1024
#: Requests on one keep-alive connection before the server closes it.
MAX_REQUESTS_PER_CONNECTION = 1000
#: CPU seconds the budget lets the server spend at once (one large render or trace download).
BUDGET_BURST_SECONDS = 0.1
#: The loop waits at most this long for a socket (connection deadlines are checked when it wakes);
#: idle, it wakes once a second. stop() wakes it at once.
_IDLE_SECONDS = 1.0
#: Longest sleep while paused for the budget (the pause time is counted in these slices).
_PAUSE_SLICE_SECONDS = 0.1
_WAKE = object()
#: After refusing a request whose body is still coming, read and discard up to this much for this long
#: before closing, so the client sees the answer rather than a connection reset.
_LINGER_SECONDS = 2.0
_LINGER_BYTES = 1 << 20
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
#: A /healthz answer is recomputed at most this often (a probe period is >= 1 s).
_HEALTH_TTL_SECONDS = 0.25
#: Eviction never picks a connection that delivered a byte within this long.
_EVICT_QUIET_SECONDS = 1.0
#: CPU seconds a lane pass may spend reading scrapers and just-accepted connections when its allowance
#: is spent (the listener is then not served): a few requests.
_LANE_READ_SECONDS = 0.001
#: A connection that has sent nothing is displaced by a newcomer that has sent nothing either only
#: once it has been connected this long (a real client sends its request within milliseconds).
_SILENT_GRACE_SECONDS = 0.5

_BLANK_LINE = re.compile(rb"\n\r?\n")
_BUSY = Response.json(503, {"error": "too many connections"})
_THROTTLED = Response.json(429, {"error": "too many failed authentications from this address"}, [("Retry-After", "1")])


class AuthThrottle:
    """Refuse addresses that keep sending bad credentials, before their requests are routed.

    A client over ``limit`` failed authentications within one second is refused (429) for
    ``block_seconds``. Scrapes and health checks from a blocked address still go through.
    """

    def __init__(self, limit: int = 20, block_seconds: float = 1.0) -> None:
        self.limit = limit
        self.block = block_seconds
        self._failures: dict[str, collections.deque[float]] = {}
        self._blocked: dict[str, float] = {}

    def failed(self, address: str) -> None:
        now = time.monotonic()
        if len(self._failures) > 4096 and address not in self._failures:
            self._failures.clear()  # bounded: many distinct addresses just reset the window
        q = self._failures.setdefault(address, collections.deque())
        q.append(now)
        while q and now - q[0] > 1.0:
            q.popleft()
        if len(q) > self.limit:
            if len(self._blocked) > 4096:  # bounded: forget blocks that have expired
                self._blocked = {a: t for a, t in self._blocked.items() if t > now}
            self._blocked[address] = now + self.block
            q.clear()

    def blocked(self, address: str) -> bool:
        until = self._blocked.get(address)
        if until is None:
            return False
        if time.monotonic() >= until:
            self._blocked.pop(address, None)
            return False
        return True


class _Conn:
    """One client connection: what it sent that is not parsed yet, and what is left to send it."""

    __slots__ = ("address", "closing", "deadline", "draining", "got", "inbox", "outbox", "queued", "received_at",
                 "requests", "scraper", "since", "sock", "watching")

    def __init__(self, sock: socket.socket, address: str, now: float, timeout: float) -> None:
        self.sock = sock
        self.address = address
        self.inbox = bytearray()
        self.received_at = now  # time.monotonic() of the last read: everything in the inbox was sent before
        self.got = False  # it has sent at least one byte
        self.outbox: memoryview | None = None
        self.queued = False  # a complete request of it waits in the server's ready queue
        self.watching = 0  # the selector events registered for it (0: none)
        self.closing = False
        self.draining = -1  # bytes discarded after a refusal; -1 while the connection is live
        self.requests = 0
        self.since = now  # when the request now being received began (or the connection went idle)
        self.deadline = now + timeout
        #: It has been answered a scrape (/metrics 200): a keep-alive scraper, read by the health lane too.
        self.scraper = False


class _Request:
    __slots__ = ("body", "close", "headers", "http10", "method", "path", "read_at")

    def __init__(self, method: str, path: str, headers: dict[str, str], body: bytes, close: bool,
                 http10: bool = False) -> None:
        self.http10 = http10
        self.method = method
        self.path = path
        self.headers = headers
        self.body = body
        self.close = close
        self.read_at = 0.0  # time.monotonic() when it was read: it was sent before then


class _Refusal(Exception):
    """A request that cannot be parsed or is too large: answered with ``response``, then closed."""

    def __init__(self, response: Response, reason: str) -> None:
        super().__init__(reason)
        self.response = response
        self.reason = reason


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
                 shedding: HttpShedding | None = None, internal: InternalErrors | None = None) -> None:
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
        self._listener = self._bind(host, port, port_range)
        self.port = int(self._listener.getsockname()[1])
        router.bound = str(self._listener.getsockname()[0])  # the address the peer check compares against
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, _WAKE)
        #: The health lane's selector: the listener, the wake socket, the connections accepted in the
        #: last _SILENT_GRACE_SECONDS that have sent nothing yet (a probe's request is a few ms behind its
        #: connection) and keep-alive scrapers waiting for their next scrape (``_young``: conn -> until when).
        self._lane_selector = selectors.DefaultSelector()
        self._lane_selector.register(self._listener, selectors.EVENT_READ, None)
        self._lane_selector.register(self._wake_r, selectors.EVENT_READ, _WAKE)
        self._young: dict[_Conn, float] = {}
        self._lane_accepting = True  # the listener is in the lane's selector (not while the lane is in debt)
        self._conns: set[_Conn] = set()
        #: Requests read and waiting for the work budget: scrapes first, then the rest (ready queue by class).
        self._scrapes: collections.deque[tuple[_Conn, _Request]] = collections.deque()
        self._others: collections.deque[tuple[_Conn, _Request]] = collections.deque()
        #: The last shared render per key (/metrics: content type chosen, gzip; /stats): when it started,
        #: and the answer. At most 5 keys whatever the clients send.
        self._renders: dict[tuple[str, bool], tuple[float, Response]] = {}
        #: The /healthz answer, encoded, per (close, keep-alive), and when it was computed.
        self._health: dict[tuple[bool, bool], bytes] = {}
        self._health_at = -1e9
        self._health_resp = Response.json(503, {"status": "starting"})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="perfmon-http", daemon=True)

    @staticmethod
    def _bind(host: str, port: int, port_range: int) -> socket.socket:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        candidates = [port] if port == 0 else list(range(port, port + port_range))
        last_error: OSError | None = None
        for candidate in candidates:
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                if os.name == "posix":
                    # Linux/BSD: lets a restarted agent (stop() then start(), a respawned worker) bind a
                    # port whose old connections sit in TIME_WAIT (~60 s after a scraper's keep-alive);
                    # a second *live* listener still gets EADDRINUSE, so workers never share a port.
                    # (On Windows the option would allow exactly that sharing: never set there.)
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((host, candidate))
                # The backlog: 50 scrapers at once, or clients held back while the budget refills.
                sock.listen(128)
                sock.setblocking(False)
                return sock
            except OSError as exc:  # taken: by another worker, or something else
                sock.close()
                last_error = exc
        raise OSError(f"no free port in {port}..{port + port_range - 1} on {host}: {last_error}")

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
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread.is_alive():
            self._thread.join(timeout_seconds)
        if not self._thread.is_alive():  # finished, or never started
            self._close_all()
        else:  # stuck in a handler: at least free the port
            _close(self._listener)

    def abandon(self) -> None:
        """In a forked child: close the inherited sockets (the parent keeps serving on them)."""
        for conn in list(self._conns):
            _close(conn.sock)
        for sock in (self._listener, self._wake_r, self._wake_w):
            _close(sock)
        for selector in (self._selector, self._lane_selector):
            try:
                selector.close()
            except OSError:
                pass

    # -- the loop --------------------------------------------------------------------------------

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                c0 = time.thread_time()
                try:
                    self._turn()
                except Exception as exc:  # never let the loop die: count it and go on
                    self.internal.report("http", exc)
                    self._stop.wait(0.01)
                self.cpu.add("http", time.thread_time() - c0)
        finally:
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
        turn0 = time.thread_time()
        work_spent = lane_spent = 0.0
        work = self._work_wait()
        triage_wait = self.triage.wait_seconds()
        if triage_wait > 0:
            pause = min(triage_wait, work if work else _PAUSE_SLICE_SECONDS, _PAUSE_SLICE_SECONDS)
            t0 = time.monotonic()
            c0 = time.thread_time()
            self._lane_pass(pause)  # new connections (health probes) still get in
            lane_spent = time.thread_time() - c0  # charged to the lane, not to triage
            self.shedding.paused_seconds += time.monotonic() - t0
        else:
            timeout = _IDLE_SECONDS if work is None else min(work, _PAUSE_SLICE_SECONDS)
            if self._conns and timeout > 0:
                timeout = max(0.0, min(timeout, min(c.deadline for c in self._conns) - time.monotonic()))
            t0 = time.monotonic()
            events = self._selector.select(timeout)
            if work is not None and work > 0:  # requests waited for the budget meanwhile
                self.shedding.paused_seconds += time.monotonic() - t0
            self._triage(events, time.thread_time() + self.triage.available())
        if self._work_wait() == 0:
            c0 = time.thread_time()
            self._work(c0)
            work_spent = time.thread_time() - c0
            self.budget.charge(work_spent)
        # Triage pays for the rest of the turn too (select, sleeping, bookkeeping): every CPU second the
        # loop spends is charged to one bucket or the other.
        self.triage.charge(time.thread_time() - turn0 - work_spent - lane_spent)

    def _triage(self, events: list[tuple[selectors.SelectorKey, int]], limit: float) -> None:
        now = time.monotonic()
        for key, mask in events:
            if time.thread_time() > limit:
                break  # the rest stay ready for the next turn
            conn: _Conn | None = key.data
            if conn is None:
                self._accept(now, limit)
                continue
            if conn is _WAKE:  # stop() (the loop condition sees it)
                continue
            self._guard(conn, self._flush if mask & selectors.EVENT_WRITE else self._read, now)
        self._reap(now)

    def _work(self, c0: float) -> None:
        """Answer queued requests while the budget lasts: scrapes first; the rest only above the reserve."""
        now = time.monotonic()
        while True:
            spent = time.thread_time() - c0
            left = self.budget.available() - spent
            if self._scrapes and left > 0:
                conn, request = self._scrapes.popleft()
            elif self._others and left > SCRAPE_RESERVE_SECONDS:
                conn, request = self._others.popleft()
            else:
                return
            conn.queued = False
            if conn in self._conns:
                self._guard(conn, functools.partial(self._answer, request), now)

    def _guard(self, conn: _Conn, step: Callable[[_Conn, float], None], now: float) -> None:
        """Run one step for a connection; whatever it raises ends that connection only."""
        try:
            step(conn, now)
        except Exception as exc:
            if not isinstance(exc, OSError):  # a client that vanished is not an agent fault
                self.internal.report("http", exc)
            self._drop(conn)

    def _accept(self, now: float, limit: float) -> None:
        for _ in range(_ACCEPTS_PER_TURN):
            if time.thread_time() > limit:
                return
            try:
                sock, address = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and friends: leave the rest queued for a later turn
                self.internal.report("http", exc)
                return
            sock.setblocking(False)
            conn = _Conn(sock, str(address[0]), now, self.timeout)
            # Read at once what it already sent (a probe's request usually waited in the kernel's queue
            # with it): a connection that has sent a byte is never picked for eviction.
            try:
                first = sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                first = None
            except OSError:
                first = b""
            if first == b"":  # closed (or reset) before it was accepted: a churning client
                _close(sock)
                continue
            # At the cap, a newcomer that has sent nothing yet (a probe whose request is a few ms behind
            # its SYN, or one more idle socket of a flood) displaces only a connection that has been
            # silent for _SILENT_GRACE_SECONDS; one young and silent itself is never displaced: the
            # probe's request arrives well within the grace, idle sockets of a flood grow old.
            if len(self._conns) >= MAX_CONNECTIONS and not self._evict_slowest(
                    0.0 if first else _SILENT_GRACE_SECONDS):
                self.shedding.refused["busy"] += 1
                _send_and_close(sock, _encode(_BUSY, close=True))
                continue
            self._conns.add(conn)
            self._watch(conn, selectors.EVENT_READ)
            if not first:  # nothing sent yet: watched by the health lane too for a moment
                try:
                    self._lane_selector.register(sock, selectors.EVENT_READ, conn)
                    self._young[conn] = now + _SILENT_GRACE_SECONDS
                except (KeyError, ValueError, OSError):
                    pass
            if first:
                conn.got = True
                conn.inbox += first
                conn.received_at = time.monotonic()
                self._guard(conn, self._take, now)

    def _evict_slowest(self, silent_for: float = 0.0) -> bool:
        """Close, for a newcomer, the oldest connection that never sent a byte (and has been connected at
        least ``silent_for`` seconds); else the one quiet longest (none that delivered a byte within
        ``_EVICT_QUIET_SECONDS``). False if there is none to close."""
        silent = None
        quiet = None
        now = time.monotonic()
        cutoff = now - _EVICT_QUIET_SECONDS
        for c in self._conns:
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
        self._drop(victim)
        return True

    def _reap(self, now: float) -> None:
        # A queued request waits on this server (its budget), not on the client: it is not cut.
        for conn in [c for c in self._conns if now > c.deadline and not c.queued]:
            # Counted: a request or an answer stuck halfway, or a connection that never sent one. Not
            # counted: a keep-alive connection idle after its answers (a scraper's, between scrapes),
            # and a refused one lingering (counted when it was refused).
            stuck = bool(conn.inbox) or conn.outbox is not None or conn.requests == 0
            if stuck and conn.draining < 0:
                self.shedding.refused["timeout"] += 1
            self._drop(conn)

    def _watch(self, conn: _Conn, events: int) -> None:
        """Register the selector events to wait for on this connection (0: none)."""
        if events == conn.watching:
            return
        if events == 0:
            self._selector.unregister(conn.sock)
        elif conn.watching == 0:
            self._selector.register(conn.sock, events, conn)
        else:
            self._selector.modify(conn.sock, events, conn)
        conn.watching = events
        if conn.scraper:
            # A keep-alive scraper waiting for its next request is watched by the health lane as well, so
            # its scrape is read (and queued ahead of the rest) while triage is in debt.
            if events == selectors.EVENT_READ and conn not in self._young:
                try:
                    self._lane_selector.register(conn.sock, selectors.EVENT_READ, conn)
                    self._young[conn] = math.inf
                except (KeyError, ValueError, OSError):
                    pass
            elif events != selectors.EVENT_READ and conn in self._young:
                self._unyoung(conn)

    def _read(self, conn: _Conn, now: float) -> None:
        if conn in self._young and not conn.scraper:
            self._unyoung(conn)
        data = conn.sock.recv(65536)
        if not data:
            self._drop(conn)
            return
        if conn.draining >= 0:
            conn.draining += len(data)
            if conn.draining > _LINGER_BYTES:
                self._drop(conn)
            return
        if not conn.inbox:
            conn.since = now
        conn.got = True
        conn.inbox += data
        conn.received_at = time.monotonic()
        self._take(conn, now)

    def _take(self, conn: _Conn, now: float) -> None:
        """Queue the request at the head of the inbox once it is complete; refuse a malformed one now."""
        try:
            request = _parse(conn.inbox)
        except _Refusal as refusal:
            self.shedding.refused[refusal.reason] += 1
            conn.inbox.clear()
            conn.draining = 0  # the rest of what it sends (a refused body) is read and dropped
            self._respond(conn, refusal.response, close=True, now=now)
            return
        if request is None:
            return
        request.read_at = conn.received_at
        if request.path.rstrip("/") == "/healthz" and request.method in ("GET", "HEAD"):
            self._answer_health(conn, request, now)  # at once, in triage, from a precomputed answer
            return
        conn.queued = True
        self._watch(conn, 0)  # read no more of it (pipelined requests wait their turn in the kernel)
        scrape = request.method in ("GET", "HEAD") and request.path.rstrip("/") == "/metrics"
        (self._scrapes if scrape else self._others).append((conn, request))

    def _answer_health(self, conn: _Conn, request: _Request, now: float) -> None:
        conn.requests += 1
        close = request.close or conn.requests >= MAX_REQUESTS_PER_CONNECTION
        if request.method == "HEAD":
            self._respond(conn, self.router.handle("HEAD", "/healthz", {}), close=close, now=now,
                          keep_alive=request.http10)
            return
        if now - self._health_at > _HEALTH_TTL_SECONDS:
            self._health.clear()
            self._health_resp = self.router.handle("GET", "/healthz", {})
            self._health_at = now
        key = (close, request.http10)
        data = self._health.get(key)
        if data is None:
            data = self._health[key] = _encode(self._health_resp, close=close, keep_alive=request.http10)
        conn.outbox = memoryview(data)
        conn.closing = close
        self._flush(conn, now)

    def _answer(self, request: _Request, conn: _Conn, now: float) -> None:
        conn.requests += 1
        close = request.close or conn.requests >= MAX_REQUESTS_PER_CONNECTION
        clean = request.path.rstrip("/") or request.path
        is_open = request.method in ("GET", "HEAD") and clean in self.router.open_routes
        if not is_open and self.throttle.blocked(conn.address):
            self.shedding.refused["throttled"] += 1
            self._respond(conn, _THROTTLED, close=True, now=now)
            return
        if request.method == "GET" and clean in ("/metrics", "/stats"):
            # Share a render only with requests already read when it started: a client that scrapes
            # after its own calls always sees them (the single-flight rule, without threads). The key is
            # what the answer depends on (the format Accept chooses, gzip), not the client's raw header:
            # at most 6 distinct /metrics renders (text, OpenMetrics, protobuf; gzip or not) and one /stats render.
            if clean == "/metrics":
                key = (metrics_format(request.headers.get("accept", ""))[1],
                       accepts_gzip(request.headers.get("accept-encoding", "")))
            else:
                key = ("/stats", False)
            cached = self._renders.get(key)
            if cached is None or cached[0] < request.read_at:
                started = time.monotonic()
                cached = self._renders[key] = (started, self.router.handle(request.method, request.path,
                                                                           request.headers, b"", conn.address))
            resp = cached[1]
        else:
            resp = self.router.handle(request.method, request.path, request.headers, request.body, conn.address)
        if resp.status == 401:
            self.throttle.failed(conn.address)
        elif resp.status == 200 and clean == "/metrics":
            conn.scraper = True
        self._respond(conn, resp, close=close, now=now, keep_alive=request.http10)

    def _respond(self, conn: _Conn, resp: Response, *, close: bool, now: float, keep_alive: bool = False) -> None:
        conn.outbox = memoryview(_encode(resp, close=close, keep_alive=keep_alive))
        conn.closing = close
        self._flush(conn, now)

    def _flush(self, conn: _Conn, now: float) -> None:
        """Send what the socket takes now; once the answer is all out, read (or take) the next request."""
        assert conn.outbox is not None
        try:
            sent = conn.sock.send(conn.outbox)
        except (BlockingIOError, InterruptedError):
            sent = 0
        conn.outbox = conn.outbox[sent:]
        if conn.outbox:  # the client reads slowly: wait until its socket takes more
            self._watch(conn, selectors.EVENT_WRITE)
            return
        conn.outbox = None
        if conn.closing and conn.draining >= 0:
            conn.sock.shutdown(socket.SHUT_WR)  # the answer is out; now let the client finish sending
            conn.deadline = now + _LINGER_SECONDS
            self._watch(conn, selectors.EVENT_READ)
            return
        if conn.closing:
            self._drop(conn)
            return
        conn.deadline = now + self.timeout
        conn.since = now
        self._watch(conn, selectors.EVENT_READ)
        if conn.inbox:  # pipelined: the next request may already be here
            self._take(conn, now)

    def _unyoung(self, conn: _Conn) -> None:
        self._young.pop(conn, None)
        try:
            self._lane_selector.unregister(conn.sock)
        except (KeyError, ValueError, OSError):
            pass

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
        if accepting != self._lane_accepting:
            if accepting:
                self._lane_selector.register(self._listener, selectors.EVENT_READ, None)
            else:
                self._lane_selector.unregister(self._listener)
            self._lane_accepting = accepting
        c0 = time.thread_time()
        events = self._lane_selector.select(timeout if accepting else min(timeout, wait))
        now = time.monotonic()
        limit = time.thread_time() + max(self.lane.available(), _LANE_READ_SECONDS)
        for key, _ in events:
            if time.thread_time() > limit:
                break
            conn: _Conn | None = key.data
            if conn is None:
                self._accept(now, limit)
            elif conn is not _WAKE and conn in self._conns:
                self._guard(conn, self._read, now)
        for conn, deadline in list(self._young.items()):
            if now > deadline or conn not in self._conns:
                self._unyoung(conn)
        self.lane.charge(time.thread_time() - c0)

    def _drop(self, conn: _Conn) -> None:
        if conn in self._young:
            self._unyoung(conn)
        if conn not in self._conns:
            return
        self._conns.discard(conn)
        if conn.watching:
            try:
                self._selector.unregister(conn.sock)
            except (KeyError, ValueError, OSError):
                pass
            conn.watching = 0
        _close(conn.sock)

    def _close_all(self) -> None:
        for conn in list(self._conns):
            self._drop(conn)
        _close(self._listener)
        _close(self._wake_r)
        _close(self._wake_w)
        for selector in (self._selector, self._lane_selector):
            try:
                selector.close()
            except OSError:
                pass


#: Control characters a header value may not hold (horizontal tab is allowed).
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def _parse(inbox: bytearray) -> _Request | None:
    """The first complete request in ``inbox`` (removed from it), None if it is not all here yet.

    Deliberately small: a request line, header lines, a Content-Length body. No chunked bodies
    (refusing them also rules out request smuggling); bare LF line ends are tolerated.
    """
    # The headers end at the first empty line, whatever mix of CRLF and bare LF ends the lines around it
    # (\r\n\r\n, \n\n, \r\n\n, \n\r\n): a client must never be left waiting for a terminator it sent.
    blank = _BLANK_LINE.search(inbox, 0, MAX_HEADER_BYTES + 4)
    end, stop = (blank.start(), blank.end()) if blank else (-1, -1)
    if (end if end >= 0 else len(inbox)) > MAX_HEADER_BYTES:
        raise _Refusal(Response.json(431, {"error": f"request line and headers over {MAX_HEADER_BYTES} bytes"}),
                       "too_large")
    if end < 0:
        return None
    lines = [line.removesuffix("\r") for line in bytes(inbox[:end]).decode("latin-1").lstrip("\r\n").split("\n")]
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[0].isalpha() or parts[2] not in ("HTTP/1.0", "HTTP/1.1"):
        raise _Refusal(Response.json(400, {"error": "malformed request line (versions: HTTP/1.0, HTTP/1.1)",
                                           "line": lines[0][:100]}), "bad_request")
    method, target, version = parts
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip():
            raise _Refusal(Response.json(400, {"error": "malformed header line", "line": line[:100]}), "bad_request")
        name = name.lower()
        value = value.strip()
        if _CONTROL.search(value):
            # RFC 9110 5.5: no CR, LF, NUL (or other controls) in a field value. Kept, a bare CR would be
            # read as a line end by a lenient peer: a header smuggled into whatever echoes the value.
            raise _Refusal(Response.json(400, {"error": "control character in a header value", "header": name[:64]}),
                           "bad_request")
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    if "transfer-encoding" in headers:
        raise _Refusal(Response.json(411, {"error": "chunked request bodies are not supported; send Content-Length"}),
                       "bad_request")
    length = headers.get("content-length", "0")
    # Digits only, and few of them: int() of 4,301+ digits raises (CPython's int/str limit), and any
    # length with more than 18 digits is absurd anyway.
    if not (length.isascii() and length.isdigit()) or len(length) > 18:
        raise _Refusal(Response.json(400, {"error": "Content-Length is not a number of at most 18 digits"}),
                       "bad_request")
    if int(length) > MAX_BODY_BYTES:
        raise _Refusal(Response.json(413, {"error": f"request body over {MAX_BODY_BYTES} bytes"}), "too_large")
    total = stop + int(length)
    if len(inbox) < total:
        return None
    body = bytes(inbox[stop:total])
    del inbox[:total]
    if target.startswith(("http://", "https://")):  # absolute form: keep the path
        target = "/" + target.split("/", 3)[3] if target.count("/") >= 3 else "/"
    if not target.startswith("/"):
        raise _Refusal(Response.json(400, {"error": "request target must be a path", "target": target[:100]}),
                       "bad_request")
    connection = headers.get("connection", "").lower()
    close = "close" in connection if version == "HTTP/1.1" else "keep-alive" not in connection
    return _Request(method, unquote(target.partition("?")[0], "latin-1"), headers, body, close,
                    version == "HTTP/1.0")


def _encode(resp: Response, *, close: bool, keep_alive: bool = False) -> bytes:
    lines = [f"HTTP/1.1 {resp.status} {REASONS.get(resp.status, '')}".rstrip(), f"Content-Type: {resp.content_type}"]
    lines += [f"{k}: {v}" for k, v in resp.headers]
    if not any(k.lower() == "content-length" for k, _ in resp.headers):
        lines.append(f"Content-Length: {len(resp.body)}")
    if close:
        lines.append("Connection: close")
    elif keep_alive:  # an HTTP/1.0 client that asked to keep the connection: say it is kept
        lines.append("Connection: keep-alive")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + resp.body


def _send_and_close(sock: socket.socket, data: bytes) -> None:
    try:
        sock.send(data)  # best effort: a refusal is small and the socket is fresh
    except OSError:
        pass
    _close(sock)


def _close(sock: Any) -> None:
    try:
        sock.close()
    except OSError:
        pass
