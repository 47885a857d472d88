"""The agent's routes as WSGI and ASGI apps, to mount in the user's own server instead of the agent's port."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Iterable
from typing import Any

from .agent import Agent
from .routes import Router
from .wire import MAX_BODY_BYTES, REASONS

__all__ = ["AppsApi", "make_asgi_app", "make_wsgi_app"]


class AppsApi:
    """The mountable-apps part of ``Monitor``'s surface: its routes as WSGI and ASGI apps."""

    @property
    def wsgi_app(self) -> Callable[..., Any]:
        """/metrics, /healthz and /stats as a WSGI app, to mount in your own server."""
        return make_wsgi_app(self)  # type: ignore[arg-type]  # a Monitor: the Agent protocol

    @property
    def asgi_app(self) -> Callable[..., Any]:
        """/metrics, /healthz and /stats as an ASGI app, to mount in your own server."""
        return make_asgi_app(self)  # type: ignore[arg-type]  # a Monitor: the Agent protocol


def make_wsgi_app(monitor: Agent, *, mounted: bool = True) -> Callable[..., Iterable[bytes]]:
    """A WSGI app serving the monitor's routes (mount it under any prefix)."""
    router = Router(monitor, mounted=mounted)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        headers = {k[5:].replace("_", "-").lower(): v for k, v in environ.items() if k.startswith("HTTP_")}
        if environ.get("CONTENT_TYPE"):  # PEP 3333 puts it apart from the HTTP_ variables (POST /profile needs it)
            headers["content-type"] = environ["CONTENT_TYPE"]
        path = environ.get("PATH_INFO", "/") or "/"
        try:
            length = int(environ.get("CONTENT_LENGTH") or 0)
        except ValueError:
            length = 0
        # Read at most one byte past the limit: a huge body is refused without being read.
        body = environ["wsgi.input"].read(min(length, MAX_BODY_BYTES + 1)) if length > 0 else b""
        method = environ.get("REQUEST_METHOD", "GET")
        with monitor.cpu.measure("http"):
            resp = router.handle(method, path, headers, body, prefix=environ.get("SCRIPT_NAME", ""))
        if method == "HEAD":
            resp = resp.head()  # the GET answer's headers, never a body (not every WSGI server drops it)
        hdrs = [("Content-Type", resp.content_type), *resp.headers]
        if not any(k == "Content-Length" for k, _ in hdrs):
            hdrs.append(("Content-Length", str(len(resp.body))))
        start_response(f"{resp.status} {REASONS.get(resp.status, '')}".strip(), hdrs)
        return [resp.body]

    return app


def make_asgi_app(monitor: Agent, *, mounted: bool = True) -> Callable[..., Any]:
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
        method = scope.get("method", "GET")
        resp = await asyncio.get_running_loop().run_in_executor(
            None, functools.partial(router.handle, method, path, headers, body, prefix=root))
        if method == "HEAD":
            resp = resp.head()  # the GET answer's headers, never a body
        hdrs = [(b"content-type", resp.content_type.encode())]
        hdrs += [(k.lower().encode(), v.encode()) for k, v in resp.headers]
        if not any(k == b"content-length" for k, _ in hdrs):
            hdrs.append((b"content-length", str(len(resp.body)).encode()))
        await send({"type": "http.response.start", "status": resp.status, "headers": hdrs})
        await send({"type": "http.response.body", "body": resp.body})

    return app
