"""Request spans for a whole server: ASGI and WSGI middleware that open one per HTTP request.

The span arrives when the server hands the request to the app (the middleware is called) and ends when
the response's last byte is handed back to the server: ASGI, after the final ``http.response.body``
(``more_body`` false: streaming responses included); WSGI, when the server closes the body iterable it
has written out. The app runs in the span's context: model work it does, in its task, its threads that
copy the context or ``run_in_threadpool``, is the span's model part; ``monitor.current_request()`` gives
the span to an endpoint that hands the request to a batcher (``span.enqueued()``, ``monitor.batch``).

Outcomes: ``ok`` once the whole response was sent with a status under 500; ``error`` when its status was 5xx
(a framework that turned the view's exception into a 500: Flask, Django, Starlette's handlers; counted ``ok``
until session 41), when the app raised an Exception (re-raised unchanged, the middleware never changes what
the app does) or returned without a complete response;
``cancelled`` when the client went away first (``http.disconnect`` before the end, a failing send, a
WSGI body closed unfinished) or a BaseException (task cancellation) passed through. Lifespan and
websocket scopes pass through untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from time import perf_counter_ns
from typing import Any

from ..agent.requests import RequestSpan, RequestTracker, check_span_name, current
from ..agent.streams import CANCELLED, ERROR, OK, outcome_of

__all__ = ["RequestMiddleware", "WSGIRequestMiddleware"]


def _tracker(monitor: Any) -> RequestTracker:
    """A monitor's request tracker (``monitor.requests``), or the tracker itself."""
    tracker = monitor if isinstance(monitor, RequestTracker) else getattr(monitor, "requests", None)
    if not isinstance(tracker, RequestTracker):
        raise TypeError(f"expected a perfmon Monitor (or its .requests), got {type(monitor).__name__!r}")
    return tracker


class RequestMiddleware:
    """ASGI middleware: a request span per HTTP request (``app.add_middleware(RequestMiddleware, monitor=m)``).

    ``name`` fixes every span's ``model`` label (default: each request's first model work's model).
    """

    def __init__(self, app: Callable[..., Any], monitor: Any, *, name: str | None = None) -> None:
        self.app = app
        self._tracker = _tracker(monitor)
        if name is not None:
            check_span_name(name)  # here, when the server is set up, rather than refused at every request
        self._name = name

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        span = self._tracker.open(self._name)
        done_ns = 0  # when the final body message was handed to the server
        gone = False  # the client went away before that
        status = 0  # the response's, from http.response.start

        async def receive_() -> Any:
            nonlocal gone
            message = await receive()
            if message.get("type") == "http.disconnect" and not done_ns:
                gone = True
            return message

        async def send_(message: dict[str, Any]) -> None:
            nonlocal done_ns, gone, status
            try:
                await send(message)
            except BaseException:
                if not done_ns:
                    gone = True
                raise
            kind = message.get("type")
            if kind == "http.response.start":
                status = _status(message.get("status"))
            final = kind == "http.response.pathsend" or (kind == "http.response.body" and not message.get("more_body"))
            if final and not done_ns:
                done_ns = perf_counter_ns()

        token = current.set(span)
        try:
            await self.app(scope, receive_, send_)
        except BaseException as exc:
            current.reset(token)
            span.finish(CANCELLED if gone and not done_ns else outcome_of(exc), done_ns or None)
            raise
        current.reset(token)
        span.finish((OK if status < 500 else ERROR) if done_ns else CANCELLED if gone else ERROR, done_ns or None)


class WSGIRequestMiddleware:
    """WSGI middleware: a request span per HTTP request (``app.wsgi_app = WSGIRequestMiddleware(app.wsgi_app, m)``).

    The span ends when the server closes the body iterable (PEP 3333: after writing it out).
    """

    def __init__(self, app: Callable[..., Iterable[bytes]], monitor: Any, *, name: str | None = None) -> None:
        self.app = app
        self._tracker = _tracker(monitor)
        if name is not None:
            check_span_name(name)  # here, when the server is set up, rather than refused at every request
        self._name = name

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        span = self._tracker.open(self._name)
        status = [0]  # the last status the app started (PEP 3333: again, with exc_info, to replace it)

        def start_response_(code: str, headers: Any, *exc_info: Any) -> Any:
            status[0] = _status(code.split(None, 1)[0] if isinstance(code, str) and code else None)
            return start_response(code, headers, *exc_info)

        token = current.set(span)
        try:
            body = self.app(environ, start_response_)
        except BaseException as exc:
            current.reset(token)
            span.finish(outcome_of(exc))
            raise
        current.reset(token)
        return _Body(body, span, status)


class _Body:
    """The app's body iterable, iterated in the span's context; ends the span when the server closes it."""

    __slots__ = ("_body", "_exhausted", "_it", "_span", "_status")

    def __init__(self, body: Iterable[bytes], span: RequestSpan, status: list[int]) -> None:
        self._body = body
        self._it: Iterator[bytes] | None = None
        self._span = span
        self._exhausted = False
        self._status = status

    def __iter__(self) -> Iterator[bytes]:
        return self

    def __next__(self) -> bytes:
        token = current.set(self._span)
        try:
            if self._it is None:
                self._it = iter(self._body)
            return next(self._it)
        except StopIteration:
            self._exhausted = True
            raise
        except BaseException as exc:
            self._span.finish(outcome_of(exc))
            raise
        finally:
            current.reset(token)

    def close(self) -> None:
        try:
            close = getattr(self._body, "close", None)
            if close is not None:
                close()
        finally:
            self._span.finish((OK if self._status[0] < 500 else ERROR) if self._exhausted else CANCELLED)


def _status(value: Any) -> int:
    """An HTTP status as a number; 0 for anything that is not one (an odd app's: judged by its exceptions)."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0
