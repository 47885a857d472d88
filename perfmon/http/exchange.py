"""HTTP/1.1 on the agent server's connections: read, parse, answer, write.

The loop (``agent_server.py``) decides when: it calls ``read``/``flush`` for a ready socket within
triage's allowance and ``answer`` for a queued request within the work budget. This decides what: a
``/healthz`` is answered at once from a precomputed answer, any other complete request is queued for the
work budget (scrapes apart); ``/metrics`` and ``/stats`` share renders; addresses that keep failing
authentication are refused before routing; keep-alive and pipelining; a refused request's body is read
and dropped before closing, so the client sees the answer rather than a reset.
"""

from __future__ import annotations

import collections
import functools
import selectors
import socket
import time

from ..selfcost import HttpShedding
from .connections import Conn, ConnectionTable
from .routes import Router
from .security import AuthThrottle
from .wire import (
    Refusal,
    Request,
    Response,
    SharedRenders,
    accepts_gzip,
    encode_head,
    encode_response,
    metrics_format,
    parse_request,
)

__all__ = ["MAX_REQUESTS_PER_CONNECTION", "Exchange", "Ready"]

#: Requests on one keep-alive connection before the server closes it.
MAX_REQUESTS_PER_CONNECTION = 1000
#: A /healthz answer is recomputed at most this often (a probe period is >= 1 s).
_HEALTH_TTL_SECONDS = 0.25
#: After refusing a request whose body is still coming, read and discard up to this much for this long
#: before closing, so the client sees the answer rather than a connection reset.
_LINGER_SECONDS = 2.0
_LINGER_BYTES = 1 << 20
_THROTTLED = Response.json(429, {"error": "too many failed authentications from this address"}, [("Retry-After", "1")])

#: A ready queue: requests read and waiting for the work budget, with their connections.
Ready = collections.deque[tuple[Conn, Request]]


class Exchange:
    """Requests and answers on the connections of one ``AgentServer`` (its thread only: no lock)."""

    def __init__(self, router: Router, conns: ConnectionTable, *, timeout: float, throttle: AuthThrottle,
                 shedding: HttpShedding, scrapes: Ready, others: Ready, renders: SharedRenders[Response]) -> None:
        self.router = router
        self.conns = conns
        self.timeout = timeout
        self.throttle = throttle
        self.shedding = shedding
        #: Requests read and waiting for the work budget: scrapes first, then the rest (ready queue by class).
        self.scrapes = scrapes
        self.others = others
        #: The last shared render per key (/metrics: content type chosen, gzip; /stats), taken by the requests
        #: read before it started. At most 7 keys whatever the clients send (see ``answer``).
        self.renders = renders
        #: The /healthz answer, encoded, per (close, keep-alive), and when it was computed. Not a shared
        #: render: a probe may get an answer up to _HEALTH_TTL_SECONDS old (its period is >= 1 s), so the
        #: answer is reused by age, not by read order, and a flood of probes costs one view per TTL.
        self._health: dict[tuple[bool, bool], bytes] = {}
        self._health_at = -1e9
        self._health_resp = Response.json(503, {"status": "starting"})

    def read(self, conn: Conn, now: float) -> None:
        if conn in self.conns.young and not conn.scraper:
            self.conns.unyoung(conn)
        data = conn.sock.recv(65536)
        if not data:
            self.conns.drop(conn)
            return
        if conn.draining >= 0:
            conn.draining += len(data)
            if conn.draining > _LINGER_BYTES:
                self.conns.drop(conn)
            return
        if not conn.inbox:
            conn.since = now
        conn.got = True
        conn.inbox += data
        conn.received_at = time.monotonic()
        self.take(conn, now)

    def take(self, conn: Conn, now: float) -> None:
        """Take the complete requests at the head of the inbox in order: answer a /healthz at once, queue
        anything else (then stop: the rest waits its turn), refuse a malformed one. Stops as well when an
        answer waits for the client to read it or the connection ends.

        A loop, never a recursion through ``flush``: a client may pipeline a thousand /healthz requests in
        one packet (that used to overflow the stack halfway, reset the connection and count an internal
        error).
        """
        for _ in range(MAX_REQUESTS_PER_CONNECTION + 1):  # the connection closes after that many anyway
            if (not conn.inbox or conn.queued or conn.outbox is not None or conn.draining >= 0
                    or conn not in self.conns or not self._take_one(conn, now)):
                return

    def _take_one(self, conn: Conn, now: float) -> bool:
        """Take the request at the head of the inbox; False if it is not all here yet."""
        try:
            request = parse_request(conn.inbox)
        except Refusal as refusal:
            self.shedding.refused[refusal.reason] += 1
            head = conn.inbox.lstrip(b"\r\n").startswith(b"HEAD ")  # a HEAD answer has no body, refusals too
            conn.inbox.clear()
            conn.draining = 0  # the rest of what it sends (a refused body) is read and dropped
            self._respond(conn, refusal.response, close=True, now=now, head=head, more=False)
            return True
        if request is None:
            return False
        request.read_at = conn.received_at
        if request.path.rstrip("/") == "/healthz" and request.method in ("GET", "HEAD"):
            self._answer_health(conn, request, now)  # at once, in triage, from a precomputed answer
            return True
        conn.queued = True
        self.conns.watch(conn, 0)  # read no more of it (pipelined requests wait their turn in the kernel)
        scrape = request.method in ("GET", "HEAD") and request.path.rstrip("/") == "/metrics"
        (self.scrapes if scrape else self.others).append((conn, request))
        return True

    def _answer_health(self, conn: Conn, request: Request, now: float) -> None:
        conn.requests += 1
        close = request.close or conn.requests >= MAX_REQUESTS_PER_CONNECTION
        if request.method == "HEAD":
            self._respond(conn, self.router.handle("HEAD", "/healthz", {}), close=close, now=now,
                          keep_alive=request.http10, head=True, more=False)
            return
        if now - self._health_at > _HEALTH_TTL_SECONDS:
            self._health.clear()
            self._health_resp = self.router.handle("GET", "/healthz", {})
            self._health_at = now
        key = (close, request.http10)
        data = self._health.get(key)
        if data is None:
            data = self._health[key] = encode_response(self._health_resp, close=close, keep_alive=request.http10)
        conn.outbox = memoryview(data)
        conn.closing = close
        self.flush(conn, now, more=False)  # take() goes on with the next request

    def answer(self, request: Request, conn: Conn, now: float) -> None:
        conn.requests += 1
        close = request.close or conn.requests >= MAX_REQUESTS_PER_CONNECTION
        clean = request.path.rstrip("/") or request.path
        is_open = request.method in ("GET", "HEAD") and clean in self.router.open_routes
        head = request.method == "HEAD"
        if not is_open and self.throttle.blocked(conn.address):
            self.shedding.refused["throttled"] += 1
            self._respond(conn, _THROTTLED, close=True, now=now, head=head)
            return
        if request.method in ("GET", "HEAD") and clean in ("/metrics", "/stats"):
            # Share a render only with requests already read when it started: a client that scrapes
            # after its own calls always sees them (the single-flight rule, without threads). The key is
            # what the answer depends on (the format Accept chooses, gzip), not the client's raw header:
            # at most 6 distinct /metrics renders (text, OpenMetrics, protobuf; gzip or not) and one /stats render.
            # A HEAD takes the GET answer (its Content-Length) without the body: no render of its own.
            if clean == "/metrics":
                key = (metrics_format(request.headers.get("accept", ""))[1],
                       accepts_gzip(request.headers.get("accept-encoding", "")))
            else:
                key = ("/stats", False)
            resp = self.renders.get(key, functools.partial(self.router.handle, "GET", request.path,
                                                            request.headers, b"", conn.address), request.read_at)
        else:
            resp = self.router.handle(request.method, request.path, request.headers, request.body, conn.address)
        if resp.status == 401:
            self.throttle.failed(conn.address)
        elif resp.status == 200 and clean == "/metrics":
            conn.scraper = True
        self._respond(conn, resp, close=close, now=now, keep_alive=request.http10, head=head)

    def _respond(self, conn: Conn, resp: Response, *, close: bool, now: float, keep_alive: bool = False,
                 head: bool = False, more: bool = True) -> None:
        if head:
            resp = resp.head()
        if resp.hold is not None:  # a shared body: sent after its head, never copied per connection
            conn.outbox = memoryview(encode_head(resp, close=close, keep_alive=keep_alive))
            conn.rest, conn.hold = memoryview(resp.body), resp.hold
        else:
            conn.outbox = memoryview(encode_response(resp, close=close, keep_alive=keep_alive))
        conn.closing = close
        self.flush(conn, now, more=more)

    def flush(self, conn: Conn, now: float, *, more: bool = True) -> None:
        """Send what the socket takes now; once the answer is all out, read the next request, and with
        ``more`` take those already in the inbox (``take`` itself passes False: it loops instead)."""
        assert conn.outbox is not None
        while True:
            try:
                sent = conn.sock.send(conn.outbox)
            except (BlockingIOError, InterruptedError):
                sent = 0
            conn.outbox = conn.outbox[sent:]
            if conn.outbox:  # the client reads slowly: wait until its socket takes more
                self.conns.watch(conn, selectors.EVENT_WRITE)
                return
            if conn.rest is None:
                break
            conn.outbox, conn.rest = conn.rest, None  # the head is out: now the shared body
        conn.outbox = None
        conn.hold = None  # the last connection sending a shared body lets it go
        if conn.closing and conn.draining >= 0:
            conn.sock.shutdown(socket.SHUT_WR)  # the answer is out; now let the client finish sending
            conn.deadline = now + _LINGER_SECONDS
            self.conns.watch(conn, selectors.EVENT_READ)
            return
        if conn.closing:
            self.conns.drop(conn)
            return
        conn.deadline = now + self.timeout
        conn.since = now
        self.conns.watch(conn, selectors.EVENT_READ)
        if more and conn.inbox:  # pipelined: the next request may already be here
            self.take(conn, now)
