"""Request spans: queue / model / rest per request, in every way a server runs a request's model work.

Fakes stand in for the server: threads (plain, a copied context, run_in_threadpool's way), a batcher thread,
an ASGI server's receive/send, a WSGI server's start_response. Times are controlled with explicit stamps
(``arrived_ns=``, ``enqueued(at_ns=)``) or bounded by waits the test makes itself.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

import perfmon
from perfmon.agent.requests import REQUEST_BUCKETS

from .conftest import value


def _linear(mon: perfmon.Monitor, name: str = "lin") -> Any:
    return mon.wrap(torch.nn.Linear(4, 4), name=name)


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_a_model_call_in_the_span_is_its_model_part_and_the_parts_add_up(make_monitor) -> None:
    """queue = enqueued -> model start, model = the wrapped call, rest = the remainder; total = their sum."""
    mon = make_monitor().start()
    lin = _linear(mon)
    with mon.request() as span:
        _busy(0.002)  # pre-processing: rest, since it comes before the enqueue
        span.enqueued()
        _busy(0.003)  # waiting: queue
        before = time.perf_counter_ns()
        lin(torch.randn(2, 4))
        after = time.perf_counter_ns()
        _busy(0.001)  # post-processing: rest
    parts = span.parts()
    assert parts is not None and span.outcome == "ok" and span.label == "lin"
    assert parts["queue"] >= 0.003 and parts["rest"] >= 0.003
    assert 0 < parts["model"] <= (after - before) / 1e9
    assert parts["queue"] + parts["model"] + parts["rest"] == pytest.approx(parts["total"], abs=1e-9)
    assert mon.flush()
    assert value(mon, "perfmon_requests_total", model="lin", outcome="ok") == 1
    for part in ("queue", "model", "rest"):
        assert value(mon, "perfmon_request_seconds_sum", model="lin", part=part) == pytest.approx(parts[part])
    assert value(mon, "perfmon_request_duration_seconds_sum", model="lin") == pytest.approx(parts["total"])


def test_no_enqueue_means_no_queue_time_and_model_is_first_start_to_last_end(make_monitor) -> None:
    """Without enqueued() the queue part is 0; two calls make one model part from the first start to the last end."""
    mon = make_monitor().start()
    lin = _linear(mon)
    with mon.request() as span:
        _busy(0.002)
        t0 = time.perf_counter_ns()
        lin(torch.randn(2, 4))
        _busy(0.002)  # between the calls: inside the model part
        lin(torch.randn(2, 4))
        t1 = time.perf_counter_ns()
    parts = span.parts()
    assert parts is not None and parts["queue"] == 0
    assert 0.002 <= parts["model"] <= (t1 - t0) / 1e9
    assert parts["rest"] >= 0.002


def test_thread_per_request_sees_the_span_through_a_copied_context(make_monitor) -> None:
    """A thread started with the span's context copied (run_in_threadpool's way) stamps the span; one without
    does not, and neither does a span open on another thread (no cross-talk)."""
    mon = make_monitor().start()
    lin = _linear(mon)
    with mon.request(name="svc") as span:
        ctx = contextvars.copy_context()
        with ThreadPoolExecutor(1) as pool:
            pool.submit(ctx.run, lin, torch.randn(2, 4)).result(timeout=10)
    assert span.parts() is not None and span.model_start_ns is not None
    with mon.request(name="svc") as bare:
        t = threading.Thread(target=lin, args=(torch.randn(2, 4),))  # a plain thread: a fresh context
        t.start()
        t.join(10)
    assert bare.model_start_ns is None and bare.parts() is None
    assert mon.flush()
    assert value(mon, "perfmon_requests_total", model="svc", outcome="ok") == 2
    assert value(mon, "perfmon_request_duration_seconds_count", model="svc") == 1  # no model work: counted only


def test_run_in_threadpool_from_an_async_span(make_monitor) -> None:
    """An async endpoint's span sees the model call it hands to a worker thread (asyncio.to_thread copies the
    context, as Starlette's run_in_threadpool does)."""
    mon = make_monitor().start()
    lin = _linear(mon, "async_lin")

    async def endpoint() -> perfmon.RequestSpan:
        async with mon.request() as span:
            span.enqueued()
            await asyncio.to_thread(lin, torch.randn(2, 4))
        return span

    span = asyncio.run(endpoint())
    assert span.label == "async_lin" and span.parts() is not None


def test_a_batch_stamps_every_span_and_each_keeps_its_own_queue_wait(make_monitor) -> None:
    """monitor.batch(spans) on a batcher thread: every span's model part is the batch's, labelled by the wrapped
    call inside it; each span's queue is its own enqueue -> the batch start."""
    mon = make_monitor().start()
    lin = _linear(mon, "batched")
    base = time.perf_counter_ns()
    spans = [mon.request(arrived_ns=base + i * 1_000_000) for i in range(3)]
    for i, s in enumerate(spans):
        s.enqueued(at_ns=base + i * 1_000_000 + 500_000)
    _busy(0.004)

    def batcher() -> None:
        with mon.batch([*spans, None]):  # None: a request that came without a span
            lin(torch.randn(3, 4))

    t = threading.Thread(target=batcher)
    t.start()
    t.join(10)
    for s in spans:
        s.finish()
    starts = {s.model_start_ns for s in spans}
    ends = {s.model_end_ns for s in spans}
    assert len(starts) == 1 and len(ends) == 1  # one batch, one model part
    queues = [s.parts()["queue"] for s in spans]  # type: ignore[index]
    assert queues[0] > queues[1] > queues[2] > 0.001  # the batch started >= 4 ms after base
    assert queues[0] - queues[2] == pytest.approx(0.002, abs=1e-6)  # the enqueue stamps were 1 ms apart
    assert {s.label for s in spans} == {"batched"}
    assert mon.flush()
    assert value(mon, "perfmon_request_seconds_count", model="batched", part="queue") == 3


def test_a_batch_name_labels_spans_without_a_wrapped_call(make_monitor) -> None:
    """monitor.batch(spans, name=...) labels spans whose batch ran no wrapped call; a span's own name wins."""
    mon = make_monitor().start()
    a, b = mon.request(), mon.request(name="mine")
    with mon.batch([a, b], name="raw"):
        _busy(0.001)
    a.finish()
    b.finish()
    assert (a.label, b.label) == ("raw", "mine")
    assert a.parts()["model"] >= 0.001  # type: ignore[index]


def test_the_users_exception_passes_through_unchanged_and_counts_as_error(make_monitor) -> None:
    """An Exception in the span is re-raised as the same object (traceback intact), outcome error; a
    BaseException (task cancellation) is cancelled; neither is put in the histograms."""
    mon = make_monitor().start()
    lin = _linear(mon, "err")
    boom = ValueError("boom")
    with pytest.raises(ValueError) as caught, mon.request():
        lin(torch.randn(2, 4))
        raise boom
    assert caught.value is boom
    assert caught.traceback[-1].name == "test_the_users_exception_passes_through_unchanged_and_counts_as_error"
    with pytest.raises(asyncio.CancelledError), mon.request():
        lin(torch.randn(2, 4))
        raise asyncio.CancelledError
    assert mon.flush()
    assert value(mon, "perfmon_requests_total", model="err", outcome="error") == 1
    assert value(mon, "perfmon_requests_total", model="err", outcome="cancelled") == 1
    assert value(mon, "perfmon_request_duration_seconds_count", model="err") is None
    assert mon.requests.open_spans == 0


def test_a_model_calling_a_monitored_model_and_a_track_block_give_the_outermost_interval(make_monitor) -> None:
    """Nested monitored calls and a track() block in a span: the model part is the outermost work (the inner
    call's stamps fall inside it), labelled by the earliest-starting one."""
    mon = make_monitor().start()
    inner = _linear(mon, "inner")

    class Outer(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.inner_start = time.perf_counter_ns()  # before the inner call: the outer's start is earlier
            y = inner(x)
            self.inner_done = time.perf_counter_ns()  # after it: the outer's end is later
            return y

    outer = mon.wrap(Outer(), name="outer")
    with mon.request() as span:
        before = time.perf_counter_ns()
        outer(torch.randn(2, 4))
        after = time.perf_counter_ns()
    assert span.label == "outer"
    assert span.model_start_ns is not None and span.model_end_ns is not None
    assert before <= span.model_start_ns <= outer.inner_start and outer.inner_done <= span.model_end_ns <= after
    with mon.request() as tracked, mon.track("pipeline"):
        inner(torch.randn(2, 4))
    assert tracked.label == "pipeline"
    assert mon.stats()["models"]["inner"]["calls"] == 2  # still counted as calls


def test_no_span_open_leaves_the_hot_path_and_metrics_as_they_were(make_monitor) -> None:
    """With no span open the calls are counted as always, no request series exist, and the open count is 0; a
    span open on another context does not stamp calls outside it."""
    mon = make_monitor().start()
    lin = _linear(mon, "plain")
    for _ in range(20):
        lin(torch.randn(2, 4))
    assert mon.flush()
    assert mon.requests.open_spans == 0 and mon.current_request() is None
    assert value(mon, "perfmon_forward_calls_total", model="plain") == 20
    assert [m for m in mon.registry.collect() if m.name.startswith("perfmon_request") and m.samples] == []
    other: list[perfmon.RequestSpan] = []
    opened, release = threading.Event(), threading.Event()

    def elsewhere() -> None:
        with mon.request(name="elsewhere") as s:
            other.append(s)
            opened.set()
            release.wait(10)

    t = threading.Thread(target=elsewhere)
    t.start()
    assert opened.wait(10) and mon.requests.open_spans == 1
    lin(torch.randn(2, 4))  # this thread's context holds no span
    release.set()
    t.join(10)
    assert other[0].model_start_ns is None and mon.requests.open_spans == 0


def test_recent_gives_the_split_of_a_time_range(make_monitor) -> None:
    """RequestTracker.recent(model, since_ns, until_ns) summarises each part over requests that ended in range."""
    mon = make_monitor().start()
    lin = _linear(mon, "rec")
    t0 = time.perf_counter_ns()
    for _ in range(4):
        with mon.request() as span:
            span.enqueued()
            _busy(0.002)
            lin(torch.randn(2, 4))
    t1 = time.perf_counter_ns()
    assert mon.flush()
    got = mon.requests.recent("rec", t0, t1)
    assert set(got) == {"queue", "model", "rest", "total"}
    assert got["queue"]["count"] == 4 and got["queue"]["p50_seconds"] >= 0.002
    assert mon.requests.recent("rec", t1 + 1)["queue"] == {"count": 0}
    stats = mon.stats()["requests"]
    assert stats["open"] == 0 and stats["models"]["rec"]["requests"]["ok"] == 4
    assert stats["models"]["rec"]["model"]["count"] == 4


def test_a_stats_read_between_the_resolvers_drains_shows_the_split_of_every_counted_request(make_monitor) -> None:
    """/stats settles the queued records itself: with no resolver running (a monitor not started), the split
    covers every request the exact counts do, and the histograms get each request once."""
    mon = make_monitor()
    lin = _linear(mon, "unsettled")
    for _ in range(3):
        with mon.request() as span:
            span.enqueued()
            _busy(0.001)
            lin(torch.randn(2, 4))
    stats = mon.stats()["requests"]["models"]["unsettled"]
    assert stats["requests"]["ok"] == 3
    assert stats["queue"]["count"] == 3 and stats["queue"]["p50_seconds"] >= 0.001
    assert mon.stats()["requests"]["models"]["unsettled"]["total"]["count"] == 3  # a second read: nothing twice
    assert value(mon, "perfmon_request_duration_seconds_count", model="unsettled") == 3


def test_request_names_are_checked_and_bounded(make_monitor) -> None:
    """A bad span name or one past max_models never raises into the request: the span goes on unnamed (its model
    work's label) and the fault is counted; the buckets are the documented grid."""
    mon = make_monitor(max_models=2).start()
    model = mon.wrap(torch.nn.Linear(2, 2), name="lin")
    mon.request(name="a").finish()
    mon.request(name="b").finish()
    for bad in ("c", "", "a\nb", ["a"]):  # (an unhashable name raised TypeError)
        with mon.request(name=bad) as span:  # type: ignore[arg-type]
            model(torch.ones(1, 2))
        assert span.outcome == "ok" and span.label == "lin"
    for bad_batch in ("d", {"a": 1}):  # a batch's name counts toward the cap too (it labels its spans)
        span = mon.request()
        with mon.batch([span], name=bad_batch):  # type: ignore[arg-type]
            model(torch.ones(1, 2))
        span.finish()
        assert span.label == "lin"
    assert value(mon, "perfmon_internal_errors_total", stage="requests") == 6
    assert mon.flush()
    assert value(mon, "perfmon_request_duration_seconds_count", model="lin") == 6
    assert set(mon.stats()["requests"]["models"]) == {"a", "b", "lin"}
    with pytest.raises(perfmon.ConfigError, match="request span name"):  # a middleware's name: at set-up
        perfmon.RequestMiddleware(lambda *a: None, monitor=mon, name="bad\nname")
    with pytest.raises(perfmon.ConfigError, match="request span name"):
        perfmon.WSGIRequestMiddleware(lambda *a: [], monitor=mon, name="")
    assert REQUEST_BUCKETS[0] == 0.0001 and len(REQUEST_BUCKETS) == 30


# -- ASGI ---------------------------------------------------------------------------------------------


class FakeAsgiServer:
    """What an ASGI server gives an app: a receive that yields the request (then, optionally, a disconnect)
    and a send that records the messages."""

    def __init__(self, *, disconnect_after: int | None = None) -> None:
        self.sent: list[dict[str, Any]] = []
        self.disconnect_after = disconnect_after  # disconnect once this many body messages were sent
        self._request_given = False

    async def receive(self) -> dict[str, Any]:
        if not self._request_given:
            self._request_given = True
            return {"type": "http.request", "body": b"", "more_body": False}
        for _ in range(1000):  # bounded: the app polls until the client leaves
            bodies = sum(m["type"] == "http.response.body" for m in self.sent)
            if self.disconnect_after is not None and bodies >= self.disconnect_after:
                return {"type": "http.disconnect"}
            await asyncio.sleep(0.001)
        raise AssertionError("the fake client never left")

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    def run(self, app: Callable[..., Any], scope_type: str = "http") -> None:
        asyncio.run(app({"type": scope_type, "method": "GET", "path": "/"}, self.receive, self.send))


def _streaming_app(model: Any, chunks: int, *, stop_on_disconnect: bool) -> Callable[..., Any]:
    async def app(scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for i in range(chunks):
            await asyncio.to_thread(model, torch.randn(1, 4))
            await send({"type": "http.response.body", "body": b"x", "more_body": True})
            if stop_on_disconnect and i >= 1 and (await receive())["type"] == "http.disconnect":
                return
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


def test_asgi_streaming_response_ends_when_the_last_body_is_sent(make_monitor) -> None:
    """A streaming response's span ends ok after the final body message; its model part spans the chunks'
    model calls, run in worker threads."""
    mon = make_monitor().start()
    lin = _linear(mon, "asgi")
    server = FakeAsgiServer()
    server.run(perfmon.RequestMiddleware(_streaming_app(lin, 3, stop_on_disconnect=False), monitor=mon))
    assert server.sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert mon.flush()
    assert value(mon, "perfmon_requests_total", model="asgi", outcome="ok") == 1
    assert value(mon, "perfmon_request_seconds_count", model="asgi", part="model") == 1
    assert mon.requests.open_spans == 0


def test_asgi_client_disconnect_is_cancelled(make_monitor) -> None:
    """A client that leaves mid-stream (http.disconnect before the final body) ends the span cancelled."""
    mon = make_monitor().start()
    lin = _linear(mon, "gone")
    server = FakeAsgiServer(disconnect_after=2)
    server.run(perfmon.RequestMiddleware(_streaming_app(lin, 50, stop_on_disconnect=True), monitor=mon))
    assert mon.flush()
    assert value(mon, "perfmon_requests_total", model="gone", outcome="cancelled") == 1
    assert value(mon, "perfmon_requests_total", model="gone", outcome="ok") == 0


def test_asgi_app_exception_passes_through_and_other_scopes_pass_untouched(make_monitor) -> None:
    """The app's exception reaches the server unchanged (outcome error); lifespan and websocket scopes open no
    span and reach the app as they came."""
    mon = make_monitor().start()
    lin = _linear(mon, "asgi_err")
    boom = RuntimeError("app failed")
    seen: list[str] = []

    async def app(scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        seen.append(scope["type"])
        if scope["type"] == "http":
            await asyncio.to_thread(lin, torch.randn(1, 4))
            raise boom

    wrapped = perfmon.RequestMiddleware(app, monitor=mon)
    with pytest.raises(RuntimeError) as caught:
        FakeAsgiServer().run(wrapped)
    assert caught.value is boom
    FakeAsgiServer().run(wrapped, "lifespan")
    FakeAsgiServer().run(wrapped, "websocket")
    assert seen == ["http", "lifespan", "websocket"]
    assert mon.flush()
    assert value(mon, "perfmon_requests_total", model="asgi_err", outcome="error") == 1
    assert sum(c.request_counts()["ok"] + c.request_counts()["error"] for c in mon.requests.names()) == 1


# -- WSGI ---------------------------------------------------------------------------------------------


def _wsgi_app(model: Any, chunks: int) -> Callable[..., Any]:
    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        start_response("200 OK", [("Content-Type", "text/plain")])
        model(torch.randn(1, 4))

        def body() -> Any:
            for _ in range(chunks):
                model(torch.randn(1, 4))  # model work while the body streams: in the span too
                yield b"x"

        return body()

    return app


def test_wsgi_app_span_ends_when_the_server_closes_the_body(make_monitor) -> None:
    """A WSGI server that writes the whole body and closes it: ok, the model part spanning the app call and the
    body's chunks; a body closed early is cancelled; the app's exception passes through as error."""
    mon = make_monitor().start()
    lin = _linear(mon, "wsgi")
    app = perfmon.WSGIRequestMiddleware(_wsgi_app(lin, 3), mon)
    statuses: list[str] = []
    body = app({"REQUEST_METHOD": "GET", "PATH_INFO": "/"}, lambda status, headers: statuses.append(status))
    assert b"".join(body) == b"xxx"
    assert mon.requests.open_spans == 1  # written, not yet closed by the server
    body.close()  # type: ignore[attr-defined]
    early = app({"REQUEST_METHOD": "GET", "PATH_INFO": "/"}, lambda status, headers: None)
    next(iter(early))
    early.close()  # type: ignore[attr-defined]
    boom = KeyError("wsgi")

    def failing(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        lin(torch.randn(1, 4))
        raise boom

    with pytest.raises(KeyError) as caught:
        perfmon.WSGIRequestMiddleware(failing, mon)({}, lambda *a: None)
    assert caught.value is boom and statuses == ["200 OK"]
    assert mon.flush()
    assert value(mon, "perfmon_requests_total", model="wsgi", outcome="ok") == 1
    assert value(mon, "perfmon_requests_total", model="wsgi", outcome="cancelled") == 1
    assert value(mon, "perfmon_requests_total", model="wsgi", outcome="error") == 1
    assert mon.requests.open_spans == 0


def _answering(code: int, model: Any) -> Callable[..., Any]:
    """An ASGI app that answers ``code`` in full, as a framework does with a view's exception (a 500)."""

    async def app(scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        await receive()
        await asyncio.to_thread(model, torch.randn(1, 4))
        await send({"type": "http.response.start", "status": code, "headers": []})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})

    return app


def test_a_5xx_response_is_an_error_and_a_4xx_is_not(make_monitor) -> None:
    """Flask, Django and Starlette's handlers turn a view's exception into a whole 500 response: the app returns,
    it raises nothing. Such a request was counted ok; a 5xx is an error (ASGI and WSGI). A 4xx is the client's
    mistake, answered: ok."""
    mon = make_monitor().start()
    lin = _linear(mon, "status")
    for code in (200, 404, 500, 503):
        FakeAsgiServer().run(perfmon.RequestMiddleware(_answering(code, lin), monitor=mon))

    def wsgi(status: str) -> Callable[..., Any]:
        def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
            lin(torch.randn(1, 4))
            start_response(status, [("Content-Type", "text/plain")])
            return [b"x"]
        return app

    for status in ("200 OK", "400 Bad Request", "500 Internal Server Error"):
        seen: list[str] = []
        body = perfmon.WSGIRequestMiddleware(wsgi(status), mon)({"REQUEST_METHOD": "GET"},
                                                                 lambda s, h, *e, seen=seen: seen.append(s))
        assert b"".join(body) == b"x" and seen == [status]  # the server sees what the app started
        body.close()  # type: ignore[attr-defined]
    assert mon.flush()
    assert value(mon, "perfmon_requests_total", model="status", outcome="ok") == 4
    assert value(mon, "perfmon_requests_total", model="status", outcome="error") == 3
    assert mon.requests.open_spans == 0


def test_a_flask_view_that_raises_is_an_error(make_monitor) -> None:
    """The README's Flask embedding: a view that raises is answered 500 by Flask (the exception never reaches the
    middleware), and its request counts as an error."""
    flask = pytest.importorskip("flask")
    mon = make_monitor().start()
    lin = _linear(mon, "flask")
    app = flask.Flask("t")

    @app.get("/ok")
    def ok() -> str:
        lin(torch.randn(1, 4))
        return "fine"

    @app.get("/fail")
    def fail() -> str:
        lin(torch.randn(1, 4))
        raise ValueError("the view failed")

    app.wsgi_app = perfmon.WSGIRequestMiddleware(app.wsgi_app, mon)  # type: ignore[method-assign]
    client = app.test_client()
    for path, code in (("/ok", 200), ("/fail", 500)):
        with client.get(path, buffered=True) as response:  # buffered: the body written out and closed, as a server
            assert response.status_code == code
    assert mon.flush()
    assert value(mon, "perfmon_requests_total", model="flask", outcome="ok") == 1
    assert value(mon, "perfmon_requests_total", model="flask", outcome="error") == 1


def test_torch_compile_of_a_wrapped_model_inside_a_span_compiles_with_no_graph_break(make_monitor) -> None:
    """torch.compile(wrap(m)) called in a request span: the span gets the model part, the model is still compiled
    (one graph per shape, zero graph breaks: in_request is marked like the hot path)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    mon = make_monitor(sample_rate=1.0).start()
    model = torch.compile(mon.wrap(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()), name="compiled"),
                          backend="eager")
    spans = []
    with torch.inference_mode():
        for i in range(6):
            with mon.request() as span:
                model(torch.randn(2 + i % 2, 8))
            spans.append(span)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 2
    assert all(s.label == "compiled" and s.parts() is not None for s in spans)
    assert mon.flush()
    assert mon.stats()["models"]["compiled"]["calls"] == 6


def test_a_forked_child_starts_with_no_open_span_and_leaves_the_parents_uncounted(make_monitor) -> None:
    """After fork (Monitor.after_fork_in_child) no span is open and the counts and histograms are empty; a span
    the parent opened and the child ends is neither counted nor makes the open count negative."""
    mon = make_monitor().start()
    lin = _linear(mon, "forked")
    with mon.request():
        lin(torch.randn(2, 4))
    parents = mon.request()
    assert mon.flush() and mon.requests.open_spans == 1
    mon.after_fork_in_child()  # what perfmon.process runs in a forked child (no real fork needed here)
    assert mon.requests.open_spans == 0 and mon.requests.names() == []
    assert value(mon, "perfmon_request_duration_seconds_count", model="forked") is None
    parents.finish()
    assert mon.requests.open_spans == 0 and mon.requests.names() == []
    with mon.request():
        lin(torch.randn(2, 4))
    assert mon.flush()
    assert value(mon, "perfmon_requests_total", model="forked", outcome="ok") == 1
