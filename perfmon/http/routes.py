"""HTTP routes: /metrics, /healthz, /stats, the status page and the capture API.

One router turns a request (method, path, headers, body) into a ``Response``. The agent's own
server (``agent_server.py``) calls it from its one thread; ``apps.py``'s WSGI/ASGI apps let a user mount
the same routes in their own server instead. It reads the agent only through the ``Agent`` protocol.
"""

from __future__ import annotations

import functools
import gzip
import json
import math
import weakref
from collections.abc import Callable, Mapping
from importlib import resources
from typing import Any

from ..exceptions import CaptureBusy, CaptureRateLimited, ConfigError
from .agent import Agent
from .openapi import openapi_document
from .security import authorize
from .wire import (
    JSON_CONTENT_TYPE,
    MAX_BODY_BYTES,
    Response,
    SharedBody,
    SharedRenders,
    accepts_gzip,
    metrics_format,
)

__all__ = ["Router"]

_JSON = JSON_CONTENT_TYPE

_CAPTURE_FIELDS: dict[str, type | tuple[type, ...]] = {
    "model": str, "steps": int, "max_seconds": (int, float), "record_shapes": bool, "with_stack": bool,
    "profile_memory": bool,
}


class Router:
    """Maps requests to the agent's views.

    ``/metrics``, ``/healthz`` and ``/stats`` are open. The control and trace routes (``/profile``,
    ``/profiles...``) need ``Authorization: Bearer <token>`` when a token is set; with no token they
    are served only by the agent's own server bound to a loopback address, to a peer connecting from
    a loopback address, with the ``X-Perfmon`` header, and answer 403 otherwise (a non-loopback bind
    or peer, or the app mounted in someone else's server). Either way a ``Host`` must name the agent,
    an ``Origin`` must be the agent's own, and a POST must be ``application/json`` (415): a web page
    in a browser on the machine can neither rebind a name to the agent nor send a simple request
    (``security.authorize``).
    """

    def __init__(self, agent: Agent, *, mounted: bool = True) -> None:
        self.agent = agent
        self.mounted = mounted
        #: The address the agent's own server is bound to (set by it once bound; None when mounted).
        self.bound: str | None = None
        #: Concurrent scrapes (threads of a host server) share one render per content type.
        self._renders: SharedRenders[bytes] = SharedRenders()
        #: Traces being sent, by capture id: each lives while an answer holds it, so many downloads of one trace hold
        #: it once (128 of a 256 MiB trace held 32 GiB); a request whose read differs gets its own.
        self._bodies: weakref.WeakValueDictionary[str, SharedBody] = weakref.WeakValueDictionary()
        self.open_routes: dict[str, Callable[[Mapping[str, str]], Response]] = {
            "/": self._page,
            "/openapi.json": self._openapi,
            "/metrics": self._metrics,
            "/healthz": self._healthz,
            "/stats": self._stats,
        }

    def handle(self, method: str, path: str, headers: Mapping[str, str], body: bytes = b"",
               peer: str | None = None, *, prefix: str = "") -> Response:
        """Answer one request (``peer``: the client's address as its socket reports it, None when unknown;
        ``prefix``: where the app is mounted, the path its links start with); internal failures become a 500 JSON
        body and are counted.

        HEAD is answered as GET, on every route (RFC 9110 9.3.2), body included: whoever writes the answer
        sends it without the body (``Response.head()``: the agent's server, the health port, the mounted
        apps), whatever the status.
        """
        try:
            return self._route("GET" if method == "HEAD" else method, path, headers, body, peer, _mount(prefix))
        except Exception as exc:
            self.agent.internal.report("http", exc)
            return Response.json(500, {"error": "internal error", "detail": type(exc).__name__})

    def _route(self, method: str, path: str, headers: Mapping[str, str], body: bytes,
               peer: str | None = None, prefix: str = "") -> Response:
        clean = path.rstrip("/") or path
        view = self.open_routes.get(clean)
        if view is not None:
            if method != "GET":
                return _not_allowed(method, "GET, HEAD")
            return view(headers)
        parts = clean.split("/")
        if clean == "/profile" or clean == "/profiles" or (len(parts) in (3, 4) and parts[1] == "profiles"):
            denied = authorize(self.agent.config, headers, peer, bound=self.bound, mounted=self.mounted)
            if denied is not None:
                return denied
            if clean == "/profile":
                if method != "POST":
                    return _not_allowed(method, "POST")
                media = headers.get("content-type", "").partition(";")[0].strip().lower()
                if media != _JSON:
                    return Response.json(415, {"error": "send the capture request as JSON",
                                               "detail": "POST /profile needs 'Content-Type: application/json'"})
                return self._post_profile(headers, body, prefix)
            if len(parts) == 3 and method == "DELETE":
                return self._cancel(parts[2], headers)
            if method != "GET":
                return _not_allowed(method, "GET, HEAD, DELETE" if len(parts) == 3 else "GET, HEAD")
            if clean == "/profiles":
                return Response.json(200, {"profiles": [_brief(p) for p in self.agent.profiles()]})
            if len(parts) == 3:
                meta = self.agent.profile(parts[2])
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
        return self._renders.get(content_type, lambda: encoder(self.agent.registry))

    def _healthz(self, headers: Mapping[str, str]) -> Response:
        healthy, detail = self.agent.health()
        return Response.json(200 if healthy else 503, {"status": "ok" if healthy else "degraded", **detail})

    def _stats(self, headers: Mapping[str, str]) -> Response:
        return Response.json(200, self.agent.stats())

    # -- control routes --------------------------------------------------------------------------

    def _post_profile(self, headers: Mapping[str, str], body: bytes, prefix: str = "") -> Response:
        if len(body) > MAX_BODY_BYTES:
            return Response.json(413, {"error": f"request body over {MAX_BODY_BYTES} bytes"})
        try:
            payload = json.loads(body, parse_constant=_no_constant) if body.strip() else {}
        except ValueError as exc:  # malformed, not UTF-8, NaN/Infinity, an integer of over 4,300 digits
            return Response.json(400, {"error": f"body is not valid JSON: {str(exc)[:200]}"})
        except RecursionError:  # nested deeper than the interpreter's recursion limit ("[[[[..." of 16 KiB)
            return Response.json(400, {"error": "body is not a capture request: JSON nested too deeply"})
        if not isinstance(payload, dict):
            return Response.json(400, {"error": "body must be a JSON object"})
        # Only what the JSON body decides here: known fields, JSON types. Value ranges are the capture's own
        # checks (Monitor.capture, the capture options): their ConfigError is answered 400 below.
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
            meta = self.agent.capture(requested_by=f"http ({agent or 'no user-agent'})", **payload)
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
                                   "links": {"self": f"{prefix}/profiles/{meta['id']}",
                                             "trace": f"{prefix}/profiles/{meta['id']}/trace"}})

    def _cancel(self, capture_id: str, headers: Mapping[str, str]) -> Response:
        """DELETE /profiles/{id}: the capture in flight ended (200 armed: aborted now; 202 recording: at its thread's
        next call); 404 no such capture, 409 one that has ended or is being exported."""
        agent = headers.get("user-agent", "")[:100]
        try:
            meta = self.agent.cancel_capture(capture_id, requested_by=f"http ({agent or 'no user-agent'})")
        except LookupError:
            if self.agent.profile(capture_id) is None:
                return _unknown_capture(capture_id)
            return Response.json(409, {"error": f"capture {capture_id} has ended", "id": capture_id})
        except CaptureBusy as exc:
            return Response.json(409, {"error": str(exc), "id": capture_id})
        return Response.json(200 if meta.get("outcome") else 202, meta)

    def _trace(self, capture_id: str) -> Response:
        meta = self.agent.profile(capture_id)
        if meta is None:
            return _unknown_capture(capture_id)
        # Read through the checked directory's descriptor, never following a link (store/traces.py), at every
        # request: a trace replaced or removed meanwhile is served as it is now.
        found = self.agent.read_trace(capture_id)
        if found is None:
            return Response.json(404, {"error": "this capture has no trace", "status": meta.get("status"),
                                       "outcome": meta.get("outcome")})
        shared = self._bodies.get(capture_id)  # being sent to another client now: answer with the same bytes
        if shared is None or shared.name != found[0] or shared.data != found[1]:  # (a memcmp: ~10 GB/s)
            shared = self._bodies[capture_id] = SharedBody(*found)
        del found  # this read's copy, when another connection's serves: one copy held, however many clients
        return Response(200, shared.data, "application/gzip",
                        [("Content-Disposition", f'attachment; filename="{shared.name}"')], shared)


@functools.cache
def _status_page() -> bytes:
    return resources.files("perfmon.http").joinpath("static/index.html").read_bytes()


def _no_constant(name: str) -> Any:
    """``json.loads``' hook for NaN, Infinity and -Infinity, which Python accepts and JSON does not."""
    raise ValueError(f"{name} is not a JSON value")


def _not_allowed(method: str, allow: str) -> Response:
    return Response.json(405, {"error": f"method {method[:20]} not allowed", "allowed": allow.split(", ")},
                         [("Allow", allow)])


def _unknown_capture(capture_id: str) -> Response:
    return Response.json(404, {"error": "no such capture", "id": capture_id[:64]})


def _brief(meta: dict[str, Any]) -> dict[str, Any]:
    """A capture without its op summary and per-step op table, its comparison reduced to the sentence,
    for listings (``/profiles/{id}`` has them all)."""
    out = {k: v for k, v in meta.items() if k not in ("summary", "ops", "top_ops", "step_sizes")}
    comparison = meta.get("comparison")
    if isinstance(comparison, dict):
        out["comparison"] = {k: comparison.get(k) for k in ("baseline", "summary", "error") if k in comparison}
    return out


def _typename(typ: type | tuple[type, ...]) -> str:
    names = {"str": "a string", "int": "an integer", "float": "a number", "bool": "true or false"}
    if isinstance(typ, tuple):
        return "a number"
    return names.get(typ.__name__, typ.__name__)


def _mount(prefix: str) -> str:
    """A mount point (the server's SCRIPT_NAME or root_path) as links start with it: "/perfmon", or "" at the root.
    Anything that is not a plain path is no prefix (the server's, but a link must never carry a header break)."""
    prefix = prefix.rstrip("/")
    if not prefix.startswith("/") or any(c in prefix for c in '\r\n\x00"?#') or len(prefix) > 1024:
        return ""
    return prefix
