"""HTTP: /metrics, /healthz, /stats — as a WSGI app, an ASGI app, and a small threaded server.

All three share one router: a request (method, path, headers) becomes a ``Response``. The agent's
own server runs the WSGI app on a daemon thread (stdlib ``wsgiref`` with a thread per request,
like prometheus_client's ``start_http_server``); ``wsgi_app``/``asgi_app`` let a user mount the
same routes in their own server instead.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client.exposition import choose_encoder

if TYPE_CHECKING:
    from .monitor import Monitor

__all__ = ["AgentServer", "Response", "Router", "make_asgi_app", "make_wsgi_app"]

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


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            500: "Internal Server Error", 503: "Service Unavailable"}


class Router:
    """Maps requests to the monitor's views."""

    def __init__(self, monitor: Monitor) -> None:
        self.monitor = monitor
        self.routes: dict[str, Callable[[Mapping[str, str]], Response]] = {
            "/metrics": self._metrics,
            "/healthz": self._healthz,
            "/stats": self._stats,
        }

    def handle(self, method: str, path: str, headers: Mapping[str, str]) -> Response:
        """Answer one request; internal failures become a 500 JSON body and are counted."""
        view = self.routes.get(path.rstrip("/") or path)
        if view is None:
            return Response.json(404, {"error": "not found", "path": path[:200],
                                       "routes": sorted(self.routes)})
        if method not in ("GET", "HEAD"):
            return Response.json(405, {"error": f"method {method[:20]} not allowed", "allowed": ["GET", "HEAD"]},
                                 [("Allow", "GET, HEAD")])
        try:
            resp = view(headers)
        except Exception as exc:
            self.monitor._hub.internal.report("http", exc)
            return Response.json(500, {"error": "internal error", "detail": type(exc).__name__})
        if method == "HEAD":
            resp.headers.append(("Content-Length", str(len(resp.body))))
            resp.body = b""
        return resp

    def _metrics(self, headers: Mapping[str, str]) -> Response:
        encoder, content_type = choose_encoder(headers.get("accept", ""))
        body = encoder(self.monitor.registry)
        extra: list[tuple[str, str]] = []
        if "gzip" in headers.get("accept-encoding", ""):
            body = gzip.compress(body, compresslevel=1)
            extra.append(("Content-Encoding", "gzip"))
        return Response(200, body, content_type, extra)

    def _healthz(self, headers: Mapping[str, str]) -> Response:
        healthy, detail = self.monitor.health()
        return Response.json(200 if healthy else 503, {"status": "ok" if healthy else "degraded", **detail})

    def _stats(self, headers: Mapping[str, str]) -> Response:
        return Response.json(200, self.monitor.stats())


def make_wsgi_app(monitor: Monitor) -> Callable[..., Iterable[bytes]]:
    """A WSGI app serving the monitor's routes (mount it under any prefix)."""
    router = Router(monitor)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        headers = {k[5:].replace("_", "-").lower(): v for k, v in environ.items() if k.startswith("HTTP_")}
        path = environ.get("PATH_INFO", "/") or "/"
        resp = router.handle(environ.get("REQUEST_METHOD", "GET"), path, headers)
        hdrs = [("Content-Type", resp.content_type), *resp.headers]
        if not any(k == "Content-Length" for k, _ in hdrs):
            hdrs.append(("Content-Length", str(len(resp.body))))
        start_response(f"{resp.status} {_REASONS.get(resp.status, '')}".strip(), hdrs)
        return [resp.body]

    return app


def make_asgi_app(monitor: Monitor) -> Callable[..., Any]:
    """An ASGI (3.0) app serving the monitor's routes; rendering runs in a worker thread."""
    router = Router(monitor)

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
        # A scrape renders for milliseconds: keep it off the event loop.
        resp = await asyncio.get_running_loop().run_in_executor(
            None, router.handle, scope.get("method", "GET"), path, headers)
        hdrs = [(b"content-type", resp.content_type.encode())]
        hdrs += [(k.lower().encode(), v.encode()) for k, v in resp.headers]
        if not any(k == b"content-length" for k, _ in hdrs):
            hdrs.append((b"content-length", str(len(resp.body)).encode()))
        await send({"type": "http.response.start", "status": resp.status, "headers": hdrs})
        await send({"type": "http.response.body", "body": resp.body})

    return app


class _Handler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """No access log: scrapes every few seconds would flood the server's stderr."""


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True


class _ThreadingServer6(_ThreadingServer):
    address_family = socket.AF_INET6


class AgentServer:
    """The agent's own HTTP server on a daemon thread."""

    def __init__(self, app: Callable[..., Any], host: str, port: int) -> None:
        server_class: type[_ThreadingServer] = _ThreadingServer6 if ":" in host else _ThreadingServer
        self._httpd = make_server(host, port, app, server_class=server_class, handler_class=_Handler)
        self.host = host
        self.port = int(self._httpd.server_port)
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="perfmon-http", daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_seconds: float) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout_seconds)
