"""HTTP routes: /metrics, /healthz, /stats, the status page and the capture API.

One router turns a request (method, path, headers, body) into a ``Response``. The agent's own
server (``httpd.py``) calls it from its one thread; ``wsgi_app``/``asgi_app`` let a user mount the
same routes in their own server instead.
"""

from __future__ import annotations

import asyncio
import functools
import gzip
import hmac
import ipaddress
import json
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import TYPE_CHECKING, Any

from prometheus_client.exposition import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from .._version import __version__
from ..exceptions import CaptureBusy, CaptureRateLimited, ConfigError
from ..metrics import promproto

if TYPE_CHECKING:
    from ..monitor import Monitor

__all__ = ["CONTROL_HEADER", "MAX_BODY_BYTES", "REASONS", "Response", "Router", "accepts_gzip", "host_names_agent",
           "is_loopback", "make_asgi_app", "make_wsgi_app", "metrics_format", "owner_without_token"]

_JSON = "application/json"


@dataclass
class Response:
    status: int
    body: bytes
    content_type: str = _JSON
    headers: list[tuple[str, str]] = field(default_factory=list)

    @classmethod
    def json(cls, status: int, payload: Any, headers: list[tuple[str, str]] | None = None) -> Response:
        body = json.dumps(payload, indent=1, sort_keys=True, allow_nan=False, default=str).encode() + b"\n"
        return cls(status, body, _JSON, headers or [])


REASONS = {200: "OK", 202: "Accepted", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden",
           404: "Not Found", 405: "Method Not Allowed", 409: "Conflict", 411: "Length Required",
           413: "Payload Too Large", 415: "Unsupported Media Type", 429: "Too Many Requests",
           431: "Request Header Fields Too Large",
           500: "Internal Server Error", 503: "Service Unavailable"}

#: Largest request body accepted (a capture request is a few fields of JSON).
MAX_BODY_BYTES = 16 * 1024

_CAPTURE_FIELDS: dict[str, type | tuple[type, ...]] = {
    "model": str, "steps": int, "max_seconds": (int, float), "record_shapes": bool, "with_stack": bool,
    "profile_memory": bool,
}
#: Sent by perfmon's own clients (the CLI, the status page) on every control and trace request when no
#: token is set: a cross-site page cannot send it without a CORS preflight, which the agent never grants.
CONTROL_HEADER = "X-Perfmon"


def _ip(text: str | None) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address ``text`` spells (brackets, an IPv6 zone and IPv4-mapped IPv6 unwrapped), else None."""
    if not text:
        return None
    try:
        addr = ipaddress.ip_address(text.strip("[]").partition("%")[0])
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


def is_loopback(address: str | None) -> bool:
    """True only for an IP address on the loopback network; a name (``localhost.corp.example``) is never."""
    addr = _ip(address)
    return addr is not None and addr.is_loopback


def owner_without_token(bound: str | None, peer: str | None) -> bool:
    """Whether a request may use the control API with no token: the socket is bound to a loopback address
    and the peer connected from one (addresses as the sockets report them, never the configured string)."""
    return is_loopback(bound) and is_loopback(peer)


def host_names_agent(host: str, bound: str | None, allowed: tuple[str, ...] = ()) -> bool:
    """Whether a ``Host`` header value names this agent (what stops DNS rebinding).

    Accepted: ``localhost``, a loopback address, the bound address, any IP address when bound to all
    addresses (or when mounted: the bound address is the host server's), and the ``allowed_hosts``
    names. A rebinding attack needs a DNS name of the attacker's, which none of these is.
    """
    name = host.strip().lower()
    if name.startswith("["):
        name = name[1:name.find("]")] if "]" in name else name
    elif name.count(":") == 1:
        name = name.partition(":")[0]
    name = name.rstrip(".")
    if not name:
        return False
    if "*" in allowed or name in {a.lower().rstrip(".") for a in allowed} or name == "localhost":
        return True
    addr = _ip(name)
    if addr is None:
        return False
    bound_addr = _ip(bound)
    return addr.is_loopback or bound_addr is None or bound_addr.is_unspecified or addr == bound_addr


class Router:
    """Maps requests to the monitor's views.

    ``/metrics``, ``/healthz`` and ``/stats`` are open. The control and trace routes (``/profile``,
    ``/profiles...``) need ``Authorization: Bearer <token>`` when a token is set; with no token they
    are served only by the agent's own server bound to a loopback address, to a peer connecting from
    a loopback address, with the ``X-Perfmon`` header, and answer 403 otherwise (a non-loopback bind
    or peer, or the app mounted in someone else's server). Either way a ``Host`` must name the agent,
    an ``Origin`` must be the agent's own, and a POST must be ``application/json`` (415): a web page
    in a browser on the machine can neither rebind a name to the agent nor send a simple request.
    """

    def __init__(self, monitor: Monitor, *, mounted: bool = True) -> None:
        self.monitor = monitor
        self.mounted = mounted
        #: The address the agent's own server is bound to (set by it once bound; None when mounted).
        self.bound: str | None = None
        self._flights: dict[str, _Flight] = {}
        self._flight_lock = threading.Lock()
        self.open_routes: dict[str, Callable[[Mapping[str, str]], Response]] = {
            "/": self._page,
            "/openapi.json": self._openapi,
            "/metrics": self._metrics,
            "/healthz": self._healthz,
            "/stats": self._stats,
        }

    def handle(self, method: str, path: str, headers: Mapping[str, str], body: bytes = b"",
               peer: str | None = None) -> Response:
        """Answer one request (``peer``: the client's address as its socket reports it, None when unknown);
        internal failures become a 500 JSON body and are counted."""
        try:
            return self._route(method, path, headers, body, peer)
        except Exception as exc:
            self.monitor._hub.internal.report("http", exc)
            return Response.json(500, {"error": "internal error", "detail": type(exc).__name__})

    def _route(self, method: str, path: str, headers: Mapping[str, str], body: bytes,
               peer: str | None = None) -> Response:
        clean = path.rstrip("/") or path
        view = self.open_routes.get(clean)
        if view is not None:
            if method not in ("GET", "HEAD"):
                return _not_allowed(method, "GET, HEAD")
            resp = view(headers)
            if method == "HEAD":
                resp.headers.append(("Content-Length", str(len(resp.body))))
                resp.body = b""
            return resp
        parts = clean.split("/")
        if clean == "/profile" or clean == "/profiles" or (len(parts) in (3, 4) and parts[1] == "profiles"):
            denied = self._authorize(headers, peer)
            if denied is not None:
                return denied
            if clean == "/profile":
                if method != "POST":
                    return _not_allowed(method, "POST")
                media = headers.get("content-type", "").partition(";")[0].strip().lower()
                if media != _JSON:
                    return Response.json(415, {"error": "send the capture request as JSON",
                                               "detail": "POST /profile needs 'Content-Type: application/json'"})
                return self._post_profile(headers, body)
            if method not in ("GET", "HEAD"):
                return _not_allowed(method, "GET, HEAD")
            if clean == "/profiles":
                return Response.json(200, {"profiles": [_brief(p) for p in self.monitor.profiles()]})
            if len(parts) == 3:
                meta = self.monitor.profile(parts[2])
                if meta is None:
                    return _unknown_capture(parts[2])
                return Response.json(200, meta)
            if parts[3] == "trace":
                return self._trace(parts[2])
        return Response.json(404, {"error": "not found", "path": path[:200],
                                   "routes": [*sorted(self.open_routes), "/profile", "/profiles",
                                              "/profiles/{id}", "/profiles/{id}/trace"]})

    # -- open routes ---------------------------------------------------------------------------

    def _metrics(self, headers: Mapping[str, str]) -> Response:
        encoder, content_type = metrics_format(headers.get("accept", ""))
        body = self._render(encoder, content_type)
        extra: list[tuple[str, str]] = []
        if accepts_gzip(headers.get("accept-encoding", "")):
            body = gzip.compress(body, compresslevel=1)
            extra.append(("Content-Encoding", "gzip"))
        return Response(200, body, content_type, extra)

    def _page(self, headers: Mapping[str, str]) -> Response:
        """The status page: static, self-contained (no CDN), holds no secret; it reads /stats and /profiles."""
        return Response(200, _status_page(), "text/html; charset=utf-8",
                        [("Cache-Control", "no-cache"), ("X-Content-Type-Options", "nosniff"),
                         ("Content-Security-Policy", "default-src 'self'; script-src 'unsafe-inline'; "
                                                     "style-src 'unsafe-inline'; img-src 'self' blob: data:")])

    def _openapi(self, headers: Mapping[str, str]) -> Response:
        return Response.json(200, openapi_document())

    def _render(self, encoder: Callable[[Any], bytes], content_type: str) -> bytes:
        """Render the registry; concurrent scrapes share one render (single flight).

        Several Prometheus replicas, or a burst of 50 scrapes, cost one render instead of 50 (each
        ~2 ms of GIL-holding Python). A scrape that arrives after a render finished gets a fresh one.
        """
        with self._flight_lock:
            flight = self._flights.get(content_type)
            leader = flight is None
            if leader:
                flight = self._flights[content_type] = _Flight()
        assert flight is not None
        if not leader:
            return flight.wait()
        try:
            flight.result = encoder(self.monitor.registry)
        except BaseException as exc:
            flight.error = exc
            raise
        finally:
            with self._flight_lock:
                self._flights.pop(content_type, None)
            flight.done.set()
        return flight.result

    def _healthz(self, headers: Mapping[str, str]) -> Response:
        healthy, detail = self.monitor.health()
        return Response.json(200 if healthy else 503, {"status": "ok" if healthy else "degraded", **detail})

    def _stats(self, headers: Mapping[str, str]) -> Response:
        return Response.json(200, self.monitor.stats())

    # -- control routes --------------------------------------------------------------------------

    def _authorize(self, headers: Mapping[str, str], peer: str | None) -> Response | None:
        token = self.monitor.config.token
        if token is None and self.mounted:
            return _forbidden("control API disabled", "the agent is mounted in another server and no token is set; "
                              "set PERFMON_TOKEN (or token=) and send 'Authorization: Bearer <token>'")
        host = headers.get("host")
        if host is not None and not host_names_agent(host, self.bound, self.monitor.config.allowed_hosts):
            return _forbidden("forbidden Host", f"Host {host[:100]!r} does not name this agent; use its address or "
                              "localhost, or add the name to allowed_hosts (PERFMON_ALLOWED_HOSTS)")
        origin = headers.get("origin")
        if origin is not None and (host is None or origin.lower().partition("://")[2] != host.lower()
                                   or not origin.lower().startswith(("http://", "https://"))):
            return _forbidden("cross-origin request refused",
                              f"Origin {origin[:100]!r} is not this agent's own origin")
        if token is None:
            if not owner_without_token(self.bound, peer):
                where = (f"listening on {self.monitor.config.host}" if not is_loopback(self.bound)
                         else f"asked from {peer or 'an unknown address'}, not loopback")
                return _forbidden("control API disabled",
                                  f"the agent is {where} and no token is set; set PERFMON_TOKEN (or token=) and "
                                  "send 'Authorization: Bearer <token>'")
            if not headers.get(CONTROL_HEADER.lower()):
                return _forbidden(f"missing {CONTROL_HEADER} header",
                                  f"send '{CONTROL_HEADER}: 1' (perfmon's CLI and status page do): a request without "
                                  "it could come from a web page in a browser on this machine")
            return None
        scheme, _, credential = headers.get("authorization", "").partition(" ")
        # Constant-time comparison: the response time must not reveal how much of a guess was right.
        if scheme.lower() != "bearer" or not hmac.compare_digest(credential.strip().encode(), token.encode()):
            return Response.json(401, {"error": "unauthorized", "detail": "send 'Authorization: Bearer <token>'"},
                                 [("WWW-Authenticate", 'Bearer realm="perfmon"')])
        return None

    def _post_profile(self, headers: Mapping[str, str], body: bytes) -> Response:
        if len(body) > MAX_BODY_BYTES:
            return Response.json(413, {"error": f"request body over {MAX_BODY_BYTES} bytes"})
        try:
            payload = json.loads(body) if body.strip() else {}
        except ValueError as exc:
            return Response.json(400, {"error": f"body is not valid JSON: {exc}"})
        if not isinstance(payload, dict):
            return Response.json(400, {"error": "body must be a JSON object"})
        unknown = sorted(set(payload) - set(_CAPTURE_FIELDS))
        if unknown:
            return Response.json(400, {"error": f"unknown field(s): {', '.join(map(str, unknown))[:200]}",
                                       "allowed": sorted(_CAPTURE_FIELDS)})
        for name, typ in _CAPTURE_FIELDS.items():
            v = payload.get(name)
            if v is not None and (not isinstance(v, typ) or (typ is not bool and isinstance(v, bool))):
                return Response.json(400, {"error": f"{name}: expected {_typename(typ)}"})
        agent = headers.get("user-agent", "")[:100]
        try:
            meta = self.monitor.capture(requested_by=f"http ({agent or 'no user-agent'})", **payload)
        except LookupError as exc:
            return Response.json(404, {"error": str(exc.args[0]) if exc.args else "unknown model"})
        except ConfigError as exc:
            return Response.json(400, {"error": str(exc)})
        except CaptureBusy as exc:
            return Response.json(409, {"error": str(exc), "running": exc.running_id})
        except CaptureRateLimited as exc:
            retry = max(1, math.ceil(exc.retry_after))
            return Response.json(429, {"error": str(exc), "retry_after_seconds": retry},
                                 [("Retry-After", str(retry))])
        return Response.json(202, {"id": meta["id"], "status": meta["status"], "model": meta["model"],
                                   "links": {"self": f"/profiles/{meta['id']}",
                                             "trace": f"/profiles/{meta['id']}/trace"}})

    def _trace(self, capture_id: str) -> Response:
        meta = self.monitor.profile(capture_id)
        if meta is None:
            return _unknown_capture(capture_id)
        # Read through the checked directory's descriptor, never following a link (traces.py).
        found = self.monitor.traces.read_trace(capture_id)
        if found is None:
            return Response.json(404, {"error": "this capture has no trace", "status": meta.get("status"),
                                       "outcome": meta.get("outcome")})
        name, data = found
        return Response(200, data, "application/gzip", [("Content-Disposition", f'attachment; filename="{name}"')])


class _Flight:
    """One in-progress render that concurrent scrapes wait for."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.result = b""
        self.error: BaseException | None = None

    def wait(self) -> bytes:
        if not self.done.wait(30):
            raise TimeoutError("metrics render did not finish")
        if self.error is not None:
            raise RuntimeError("metrics render failed") from self.error
        return self.result


def openapi_document() -> dict[str, Any]:
    """The control API as OpenAPI 3.1 (served at /openapi.json; the fuzz tests are driven from it)."""
    error = {"$ref": "#/components/schemas/Error"}

    def errors(*codes: int) -> dict[str, Any]:
        return {str(c): {"description": REASONS[c], "content": {_JSON: {"schema": error}}} for c in codes}

    capture_id = {"name": "id", "in": "path", "required": True,
                  "schema": {"type": "string", "pattern": "^[0-9a-f]{22}$"}}
    auth: list[dict[str, list[str]]] = [{"bearer": []}]
    control = {"name": CONTROL_HEADER, "in": "header", "required": False, "schema": {"type": "string"},
               "description": "Required (any value, e.g. 1) when the agent has no token: with no token the control "
                              "routes answer only a loopback peer of an agent bound to loopback that sends it. "
                              "On every control route a Host that does not name the agent (localhost, its "
                              "addresses, allowed_hosts) or an Origin other than the agent's own is refused 403."}
    return {
        "openapi": "3.1.0",
        "info": {"title": "perfmon agent", "version": __version__,
                 "description": "Metrics, stats and the profiler capture API of an in-process perfmon agent."},
        "paths": {
            "/metrics": {"get": {"summary": "Prometheus metrics (text; OpenMetrics or protobuf by Accept)",
                                 "responses": {"200": {"description": "OK", "content": {"text/plain": {}}}}}},
            "/healthz": {"get": {"summary": "Liveness", "responses": {"200": {"description": "OK"},
                                                                       **errors(503)}}},
            "/stats": {"get": {"summary": "Counts, exact percentiles, devices, short time series (JSON)",
                               "responses": {"200": {"description": "OK", "content": {_JSON: {}}}}}},
            "/profile": {"post": {
                "summary": "Arm a profiler capture of a model's next calls (Content-Type: application/json, "
                           "else 415)", "security": auth, "parameters": [control],
                "requestBody": {"required": False, "content": {_JSON: {"schema": {
                    "type": "object", "additionalProperties": False,
                    "properties": {"model": {"type": "string"}, "steps": {"type": "integer", "minimum": 1,
                                                                            "maximum": 100},
                                   "max_seconds": {"type": "number", "exclusiveMinimum": 0, "maximum": 60},
                                   "record_shapes": {"type": "boolean"}, "with_stack": {"type": "boolean"},
                                   "profile_memory": {"type": "boolean"}}}}}},
                "responses": {"202": {"description": "Armed", "content": {_JSON: {}}},
                              **errors(400, 401, 403, 404, 409, 413, 415, 429)}}},
            "/profiles": {"get": {"summary": "Captures, newest first", "security": auth, "parameters": [control],
                                  "responses": {"200": {"description": "OK", "content": {_JSON: {}}},
                                                **errors(401, 403)}}},
            "/profiles/{id}": {"get": {"summary": "A capture's metadata, op summary, per-step op table and "
                                                  "comparison with its model's baseline capture", "security": auth,
                                       "parameters": [capture_id, control],
                                       "responses": {"200": {"description": "OK", "content": {_JSON: {}}},
                                                     **errors(401, 403, 404)}}},
            "/profiles/{id}/trace": {"get": {
                "summary": "The capture's Chrome trace (gzip; Perfetto, TensorBoard)", "security": auth,
                "parameters": [capture_id, control],
                "responses": {"200": {"description": "OK", "content": {"application/gzip": {}}},
                              **errors(401, 403, 404)}}},
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {"Error": {"type": "object", "required": ["error"],
                                  "properties": {"error": {"type": "string"}, "detail": {"type": "string"}}}},
        },
    }


@functools.cache
def _status_page() -> bytes:
    return resources.files("perfmon.http").joinpath("static/index.html").read_bytes()


def _forbidden(error: str, detail: str) -> Response:
    return Response.json(403, {"error": error, "detail": detail})


def _not_allowed(method: str, allow: str) -> Response:
    return Response.json(405, {"error": f"method {method[:20]} not allowed", "allowed": allow.split(", ")},
                         [("Allow", allow)])


def _unknown_capture(capture_id: str) -> Response:
    return Response.json(404, {"error": "no such capture", "id": capture_id[:64]})


def _brief(meta: dict[str, Any]) -> dict[str, Any]:
    """A capture without its op summary and per-step op table, its comparison reduced to the sentence,
    for listings (``/profiles/{id}`` has them all)."""
    out = {k: v for k, v in meta.items() if k not in ("summary", "ops")}
    comparison = meta.get("comparison")
    if isinstance(comparison, dict):
        out["comparison"] = {k: comparison.get(k) for k in ("baseline", "summary", "error") if k in comparison}
    return out


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
    if promproto.wants_protobuf(accept):
        return promproto.generate, promproto.CONTENT_TYPE
    if _offers_openmetrics(accept):
        return generate_openmetrics, OPENMETRICS_CONTENT_TYPE
    return generate_latest, TEXT_CONTENT_TYPE


def accepts_gzip(accept_encoding: str) -> bool:
    """Whether ``Accept-Encoding`` allows gzip: listed (or ``*``) with a q-value above 0."""
    return any(media in ("gzip", "*") and q > 0 for media, q in _ranges(accept_encoding))


def _offers_openmetrics(accept: str) -> bool:
    """Whether ``accept`` lists ``application/openmetrics-text`` with a q-value above 0 (its parameters,
    version included, are not read: perfmon serves OpenMetrics 1.0.0)."""
    return any(media == "application/openmetrics-text" and q > 0 for media, q in _ranges(accept))


def _ranges(header: str) -> Iterator[tuple[str, float]]:
    """(lower-cased media range or coding, q-value) of an ``Accept``/``Accept-Encoding`` header; a q that is
    not a number (NaN included) is 0. At most 64: a header is at most 16 KiB, a client lists a handful."""
    for part in header.split(",")[:64]:
        fields = [f.strip() for f in part.split(";")]
        q = 1.0
        for f in fields[1:]:
            name, _, value = f.partition("=")
            if name.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        yield fields[0].lower(), (q if q == q else 0.0)


def _typename(typ: type | tuple[type, ...]) -> str:
    names = {"str": "a string", "int": "an integer", "float": "a number", "bool": "true or false"}
    if isinstance(typ, tuple):
        return "a number"
    return names.get(typ.__name__, typ.__name__)


def make_wsgi_app(monitor: Monitor, *, mounted: bool = True) -> Callable[..., Iterable[bytes]]:
    """A WSGI app serving the monitor's routes (mount it under any prefix)."""
    router = Router(monitor, mounted=mounted)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        headers = {k[5:].replace("_", "-").lower(): v for k, v in environ.items() if k.startswith("HTTP_")}
        path = environ.get("PATH_INFO", "/") or "/"
        try:
            length = int(environ.get("CONTENT_LENGTH") or 0)
        except ValueError:
            length = 0
        # Read at most one byte past the limit: a huge body is refused without being read.
        body = environ["wsgi.input"].read(min(length, MAX_BODY_BYTES + 1)) if length > 0 else b""
        with monitor._hub.cpu.measure("http"):
            resp = router.handle(environ.get("REQUEST_METHOD", "GET"), path, headers, body)
        hdrs = [("Content-Type", resp.content_type), *resp.headers]
        if not any(k == "Content-Length" for k, _ in hdrs):
            hdrs.append(("Content-Length", str(len(resp.body))))
        start_response(f"{resp.status} {REASONS.get(resp.status, '')}".strip(), hdrs)
        return [resp.body]

    return app


def make_asgi_app(monitor: Monitor, *, mounted: bool = True) -> Callable[..., Any]:
    """An ASGI (3.0) app serving the monitor's routes; rendering runs in a worker thread."""
    router = Router(monitor, mounted=mounted)

    async def app(scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        path = scope.get("path", "/")
        root = scope.get("root_path", "")
        if root and path.startswith(root):  # mounted under a prefix (Starlette's Mount keeps the full path)
            path = path[len(root):] or "/"
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if len(body) > MAX_BODY_BYTES or not msg.get("more_body"):
                break
        # A scrape renders for milliseconds: keep it off the event loop.
        resp = await asyncio.get_running_loop().run_in_executor(
            None, router.handle, scope.get("method", "GET"), path, headers, body)
        hdrs = [(b"content-type", resp.content_type.encode())]
        hdrs += [(k.lower().encode(), v.encode()) for k, v in resp.headers]
        if not any(k == b"content-length" for k, _ in hdrs):
            hdrs.append((b"content-length", str(len(resp.body)).encode()))
        await send({"type": "http.response.start", "status": resp.status, "headers": hdrs})
        await send({"type": "http.response.body", "body": resp.body})

    return app
