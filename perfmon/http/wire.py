"""HTTP on the wire: the one request parser, response encoding, socket helpers, content negotiation, shared renders.

Hand-written rather than ``http.server`` or h11 because the agent's port triages a flood within half a
percent of a core (``agent_server.py``; figures in docs/design.md): a request line, header lines and a
Content-Length body, parsed by hand and bounded. Both servers (``agent_server.py``, ``health_port.py``)
and the mounted apps (``apps.py``) share these pieces: one implementation of each.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar
from urllib.parse import unquote

from ..metrics import promproto
from ..metrics.exposition import generate_openmetrics, generate_text

__all__ = ["JSON_CONTENT_TYPE", "MAX_BODY_BYTES", "MAX_HEADER_BYTES", "OPENMETRICS_CONTENT_TYPE", "REASONS",
           "TEXT_CONTENT_TYPE", "Refusal", "Request", "Response", "SharedBody", "SharedRenders", "Waker",
           "accepts_gzip", "bind_listener", "close_quietly", "encode_head", "encode_response", "metrics_format",
           "parse_request", "send_and_close", "wants_protobuf"]

JSON_CONTENT_TYPE = "application/json"

#: Largest request body accepted (a capture request is a few fields of JSON).
MAX_BODY_BYTES = 16 * 1024
#: Request line plus headers; more is answered 431.
MAX_HEADER_BYTES = 16 * 1024

REASONS = {200: "OK", 202: "Accepted", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden",
           404: "Not Found", 405: "Method Not Allowed", 409: "Conflict", 411: "Length Required",
           413: "Payload Too Large", 415: "Unsupported Media Type", 429: "Too Many Requests",
           431: "Request Header Fields Too Large",
           500: "Internal Server Error", 503: "Service Unavailable"}


@dataclass
class Response:
    status: int
    body: bytes
    content_type: str = JSON_CONTENT_TYPE
    headers: list[tuple[str, str]] = field(default_factory=list)
    #: What keeps a body shared by several answers alive while one is sent (``SharedBody``), else None.
    hold: Any = None

    @classmethod
    def json(cls, status: int, payload: Any, headers: list[tuple[str, str]] | None = None) -> Response:
        """``payload`` as JSON, always valid JSON: NaN and infinities (which ``json`` would write as the
        non-JSON ``NaN``/``Infinity``, and a capture's stored metadata or a view can hold) become null."""
        try:
            text = json.dumps(payload, indent=1, sort_keys=True, allow_nan=False, default=str)
        except (ValueError, TypeError):  # a non-finite float, or keys of mixed types that cannot be sorted
            text = json.dumps(_plain(payload), indent=1, sort_keys=True, allow_nan=False, default=str)
        return cls(status, text.encode() + b"\n", JSON_CONTENT_TYPE, headers or [])

    def head(self) -> Response:
        """This response as the answer to a HEAD request: no body (RFC 9110 9.3.2), and the Content-Length
        the GET answer has. A response that already is one comes back unchanged."""
        if any(k.lower() == "content-length" for k, _ in self.headers):
            return Response(self.status, b"", self.content_type, self.headers)
        return Response(self.status, b"", self.content_type, [*self.headers, ("Content-Length", str(len(self.body)))])


def _plain(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None and every dict key a string (as ``json``
    writes keys), so that ``json.dumps(allow_nan=False, sort_keys=True)`` takes it."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k if isinstance(k, str) else json.dumps(k, default=str): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


# -- requests ------------------------------------------------------------------------------------

class Request:
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


class Refusal(Exception):
    """A request that cannot be parsed or is too large: answered with ``response``, then closed."""

    def __init__(self, response: Response, reason: str) -> None:
        super().__init__(reason)
        self.response = response
        self.reason = reason


_BLANK_LINE = re.compile(rb"\n\r?\n")
#: Control characters a header value may not hold (horizontal tab is allowed).
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def parse_request(inbox: bytearray) -> Request | None:
    """The first complete request in ``inbox`` (removed from it), None if it is not all here yet.

    Deliberately small: a request line, header lines, a Content-Length body. No chunked bodies
    (refusing them also rules out request smuggling); bare LF line ends are tolerated.
    """
    # Empty lines before a request line are skipped (RFC 9112 2.2: a client may send one after a body); else a
    # pipelined request after two of them read as a request whose headers ended before its request line.
    if inbox and inbox[0] in b"\r\n":  # (looked at first: lstrip copies the inbox, 1,000 pipelined requests' worth)
        del inbox[:len(inbox) - len(inbox.lstrip(b"\r\n"))]
    # The headers end at the first empty line, whatever mix of CRLF and bare LF ends the lines around it
    # (\r\n\r\n, \n\n, \r\n\n, \n\r\n): a client must never be left waiting for a terminator it sent.
    blank = _BLANK_LINE.search(inbox, 0, MAX_HEADER_BYTES + 4)
    end, stop = (blank.start(), blank.end()) if blank else (-1, -1)
    if (end if end >= 0 else len(inbox)) > MAX_HEADER_BYTES:
        raise Refusal(Response.json(431, {"error": f"request line and headers over {MAX_HEADER_BYTES} bytes"}),
                      "too_large")
    if end < 0:
        return None
    lines = [line.removesuffix("\r") for line in bytes(inbox[:end]).decode("latin-1").split("\n")]
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[0].isalpha() or parts[2] not in ("HTTP/1.0", "HTTP/1.1"):
        raise Refusal(Response.json(400, {"error": "malformed request line (versions: HTTP/1.0, HTTP/1.1)",
                                          "line": lines[0][:100]}), "bad_request")
    method, target, version = parts
    if _CONTROL.search(target) or "\t" in target:  # a NUL or CR in the path is no path (RFC 9112 3.2)
        raise Refusal(Response.json(400, {"error": "control character in the request target"}), "bad_request")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip():
            raise Refusal(Response.json(400, {"error": "malformed header line", "line": line[:100]}), "bad_request")
        name = name.lower()
        value = value.strip()
        if _CONTROL.search(value):
            # RFC 9110 5.5: no CR, LF, NUL (or other controls) in a field value. Kept, a bare CR would be
            # read as a line end by a lenient peer: a header smuggled into whatever echoes the value.
            raise Refusal(Response.json(400, {"error": "control character in a header value", "header": name[:64]}),
                          "bad_request")
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    if "transfer-encoding" in headers:
        raise Refusal(Response.json(411, {"error": "chunked request bodies are not supported; send Content-Length"}),
                      "bad_request")
    length = headers.get("content-length", "0")
    # Digits only, and few of them: int() of 4,301+ digits raises (CPython's int/str limit), and any
    # length with more than 18 digits is absurd anyway.
    if not (length.isascii() and length.isdigit()) or len(length) > 18:
        raise Refusal(Response.json(400, {"error": "Content-Length is not a number of at most 18 digits"}),
                      "bad_request")
    if int(length) > MAX_BODY_BYTES:
        raise Refusal(Response.json(413, {"error": f"request body over {MAX_BODY_BYTES} bytes"}), "too_large")
    total = stop + int(length)
    if len(inbox) < total:
        return None
    body = bytes(inbox[stop:total])
    del inbox[:total]
    if target.startswith(("http://", "https://")):
        # Absolute form: its authority is the request's host, whatever Host says (RFC 9112 3.2.2), so the checks
        # that a request names the agent (security.authorize) read the authority.
        authority, slash, path = target.split("//", 1)[1].partition("/")
        if not authority or "@" in authority:  # RFC 9112 4.2.4: no user info in a target
            raise Refusal(Response.json(400, {"error": "absolute request target without a host, or with user info",
                                              "target": target[:100]}), "bad_request")
        headers["host"] = authority
        target = slash + path if slash else "/"
    if not target.startswith("/"):
        raise Refusal(Response.json(400, {"error": "request target must be a path", "target": target[:100]}),
                      "bad_request")
    connection = headers.get("connection", "").lower()
    close = "close" in connection if version == "HTTP/1.1" else "keep-alive" not in connection
    return Request(method, unquote(target.partition("?")[0], "latin-1"), headers, body, close,
                   version == "HTTP/1.0")


# -- responses and sockets -----------------------------------------------------------------------

class SharedBody:
    """One large body (a trace) held once for every connection sending it: the router keeps these by weak reference,
    each answer being sent holds its own (``Response.hold``), so N clients downloading one trace hold one copy, and
    it is freed when the last of them is done. Bytes cannot be weakly referenced; this holder can."""

    __slots__ = ("__weakref__", "data", "name")

    def __init__(self, name: str, data: bytes) -> None:
        self.name = name
        self.data = data


def encode_head(resp: Response, *, close: bool, keep_alive: bool = False) -> bytes:
    """``resp``'s status line and headers, up to the blank line (its body is sent after them)."""
    lines = [f"HTTP/1.1 {resp.status} {REASONS.get(resp.status, '')}".rstrip(), f"Content-Type: {resp.content_type}"]
    lines += [f"{k}: {v}" for k, v in resp.headers]
    if not any(k.lower() == "content-length" for k, _ in resp.headers):
        lines.append(f"Content-Length: {len(resp.body)}")
    if close:
        lines.append("Connection: close")
    elif keep_alive:  # an HTTP/1.0 client that asked to keep the connection: say it is kept
        lines.append("Connection: keep-alive")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def encode_response(resp: Response, *, close: bool, keep_alive: bool = False) -> bytes:
    """``resp`` as HTTP/1.1 bytes: status line, Content-Type, its headers, Content-Length, Connection."""
    return encode_head(resp, close=close, keep_alive=keep_alive) + resp.body


def bind_listener(host: str, port: int, port_range: int) -> socket.socket:
    """A non-blocking listening socket on the first free port of ``port .. port + port_range - 1``
    (``port`` 0: any free port); OSError naming the range when none is free."""
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


def send_and_close(sock: socket.socket, data: bytes) -> None:
    """Send ``data`` once, best effort, and close: for a small refusal into a fresh socket."""
    try:
        sock.send(data)  # best effort: a refusal is small and the socket is fresh
    except OSError:
        pass
    close_quietly(sock)


def close_quietly(sock: Any) -> None:
    """Close a socket or a selector; an error closing it is of no interest."""
    try:
        sock.close()
    except OSError:
        pass


class Waker:
    """Ends a selector's wait from another thread (``stop()``): register ``sock`` for reading, then ``wake()``. A
    loop that sleeps until a socket wants it (no timeout to notice a stop by) needs one."""

    def __init__(self) -> None:
        self.sock, self._send = socket.socketpair()
        self.sock.setblocking(False)

    def wake(self) -> None:
        try:
            self._send.send(b"x")
        except OSError:  # closed already (abandoned in a child, stopped twice)
            pass

    def close(self) -> None:
        close_quietly(self.sock)
        close_quietly(self._send)


# -- content negotiation -------------------------------------------------------------------------

#: The three /metrics formats, with fixed content types: nothing of the client's Accept is echoed.
TEXT_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS_CONTENT_TYPE = "application/openmetrics-text; version=1.0.0; charset=utf-8"


def metrics_format(accept: str) -> tuple[Callable[[Any], bytes], str]:
    """The /metrics encoder and content type ``accept`` asks for: the protobuf exposition when it ranks
    first (Prometheus with native histograms enabled: the only format it reads them from), OpenMetrics
    1.0.0 (with exemplars) when offered, else the text format 0.0.4.

    Negotiated here rather than by prometheus_client's ``choose_encoder``, which copies the client's
    ``version=`` and ``escaping=`` parameters into the response's Content-Type (a header a client could
    fill with anything, and a render-cache key per variant: unbounded), raises on a version that is not
    numeric, and honours escaping schemes its own parser rejects. Three formats, three fixed types.
    """
    if wants_protobuf(accept):
        return promproto.generate, promproto.CONTENT_TYPE
    if _offers_openmetrics(accept):
        return generate_openmetrics, OPENMETRICS_CONTENT_TYPE
    return generate_text, TEXT_CONTENT_TYPE


def wants_protobuf(accept: str) -> bool:
    """Whether ``accept`` ranks the delimited MetricFamily protobuf at least as high as anything else."""
    best_other = 0.0
    proto = 0.0
    for media, q, params in _ranges(accept):
        if (media == "application/vnd.google.protobuf"
                and params.get("proto") == "io.prometheus.client.MetricFamily"
                and params.get("encoding") == "delimited"):
            proto = max(proto, q)
        elif media:
            best_other = max(best_other, q)
    return proto > 0 and proto >= best_other


def accepts_gzip(accept_encoding: str) -> bool:
    """Whether ``Accept-Encoding`` allows gzip: listed (or ``*``) with a q-value above 0."""
    return any(media in ("gzip", "*") and q > 0 for media, q, _ in _ranges(accept_encoding))


def _offers_openmetrics(accept: str) -> bool:
    """Whether ``accept`` lists ``application/openmetrics-text`` with a q-value above 0 (its parameters,
    version included, are not read: perfmon serves OpenMetrics 1.0.0)."""
    return any(media == "application/openmetrics-text" and q > 0 for media, q, _ in _ranges(accept))


def _ranges(header: str) -> Iterator[tuple[str, float, dict[str, str]]]:
    """(lower-cased media range or coding, q-value, its other parameters by lower-cased name) of an
    ``Accept``/``Accept-Encoding`` header; a q that is not a number (NaN included) is 0. At most 64: a
    header is at most 16 KiB, a client lists a handful."""
    for part in header.split(",")[:64]:
        fields = [f.strip() for f in part.split(";")]
        q = 1.0
        params: dict[str, str] = {}
        for f in fields[1:]:
            name, _, value = f.partition("=")
            name = name.strip().lower()
            if name == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
            else:
                params[name] = value.strip()
        yield fields[0].lower(), (q if q == q else 0.0), params


# -- shared renders ------------------------------------------------------------------------------

T = TypeVar("T")


class SharedRenders(Generic[T]):
    """One render at a time per key, shared by every request that may take it: the one render cache.

    Several Prometheus replicas, or a burst of 50 scrapes, cost one render instead of 50 (each ~2 ms of
    GIL-holding Python). A request may take a render of its key that is

    - still in flight: threads (the mounted WSGI/ASGI apps) wait for it instead of rendering again;
    - finished, if it started after the request was read (``read_at``, ``time.monotonic()``): the agent's
      own server, whose one thread never sees a render in flight, answers every request it read before a
      render started from that render, and a client that scrapes after its own calls always sees them.

    With no ``read_at`` a finished render is not kept: a request that arrives after it finished gets a
    fresh one. The caller's keys are what the answer depends on (format, gzip), never what a client
    sent, so the renders held are few whatever the clients send.
    """

    def __init__(self) -> None:
        self._renders: dict[Hashable, _Flight[T]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Renders held (in flight or kept)."""
        return len(self._renders)

    def get(self, key: Hashable, render: Callable[[], T], read_at: float | None = None) -> T:
        """The render of ``key`` this request may share, else ``render()``'s, shared from now on."""
        with self._lock:
            flight = self._renders.get(key)
            leader = flight is None or (flight.done.is_set() and (read_at is None or flight.started < read_at))
            if leader:
                flight = self._renders[key] = _Flight(time.monotonic())
        assert flight is not None
        if not leader:
            return flight.wait()
        try:
            flight.result = render()
        except BaseException as exc:
            flight.error = exc
            raise
        finally:
            if read_at is None or flight.error is not None:  # nobody may take it once finished
                with self._lock:
                    if self._renders.get(key) is flight:
                        del self._renders[key]
            flight.done.set()
        return flight.result


class _Flight(Generic[T]):
    """One render that concurrent requests wait for (or, finished, take)."""

    result: T

    def __init__(self, started: float) -> None:
        self.started = started
        self.done = threading.Event()
        self.error: BaseException | None = None

    def wait(self) -> T:
        if not self.done.wait(30):
            raise TimeoutError("metrics render did not finish")
        if self.error is not None:
            raise RuntimeError("metrics render failed") from self.error
        return self.result
