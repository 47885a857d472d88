"""Exemplars: a timed call inside a sampled OpenTelemetry span links its latency bucket to its trace."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("opentelemetry.trace", reason="exemplars need opentelemetry-api (perfmon[otel])")
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from perfmon.agent.exemplars import otel_reader
from perfmon.testing import BusyWait

from .conftest import hist_count, http, promtool_check, wait_until
from .prom import running_prometheus

TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C
SPAN_ID = 0xB7AD6B7169203331
OPENMETRICS = "application/openmetrics-text; version=1.0.0"


def _span(sampled: bool = True, trace_id: int = TRACE_ID, span_id: int = SPAN_ID) -> Any:
    """The application's current span, as an instrumented server would have it (no SDK needed)."""
    flags = TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT)
    return trace.use_span(NonRecordingSpan(SpanContext(trace_id, span_id, is_remote=False, trace_flags=flags)))


def _bucket_lines(body: bytes, model: str) -> list[str]:
    return [ln for ln in body.decode().splitlines()
            if ln.startswith("perfmon_forward_duration_seconds_bucket{") and f'model="{model}"' in ln]


def test_the_span_is_read_on_timed_calls_only(make_monitor) -> None:
    """The trace reader runs once per timed call and never on an unsampled one."""
    reads = []
    real = otel_reader()
    assert real is not None  # opentelemetry-api is installed in the test environment

    def counting() -> Any:
        reads.append(1)
        return real()

    mon = make_monitor(sample_rate=0.02, warmup_calls=3, trace_reader=counting).start()
    model = mon.wrap(torch.nn.Linear(4, 4), name="lin")
    with _span():
        for _ in range(2000):
            model(torch.randn(1, 4))
    assert mon.flush()
    sampled = mon.stats()["models"]["lin"]["sampled"]
    assert 3 <= len(reads) == sampled < 200, (len(reads), sampled)


def test_openmetrics_scrape_carries_the_latest_exemplar_per_bucket_and_text_does_not(make_monitor) -> None:
    """OpenMetrics shows {trace_id, span_id} value timestamp on the bucket a call fell in; text is unchanged."""
    mon = make_monitor(port=0, sample_rate=1.0, warmup_calls=1).start()
    model = mon.wrap(BusyWait(0.002), name="busy")
    plain = mon.wrap(BusyWait(0.002), name="plain")
    with _span(trace_id=1, span_id=1):
        model(torch.zeros(1))  # the cold call: its own phase's histogram
    with _span():
        for _ in range(5):
            model(torch.zeros(1))  # the latest of these is the bucket's exemplar
    with _span(sampled=False, trace_id=2, span_id=2):
        plain(torch.zeros(1))  # an unsampled trace: nothing to link to
    plain(torch.zeros(1))  # no span at all
    assert mon.flush()
    _, headers, om = http(mon.url + "/metrics", headers={"Accept": OPENMETRICS})
    assert headers["content-type"].startswith("application/openmetrics-text")
    # Every bucket the five steady calls fell in (usually one; a loaded box preempts a 2 ms busy-wait into
    # others) carries exactly one exemplar, from that span, whose value lies in that bucket; empty ones none.
    previous_le, previous_count, with_exemplar = 0.0, 0.0, 0
    for line in (ln for ln in _bucket_lines(om, "busy") if 'phase="steady"' in ln):
        sample, _, exemplar = line.partition(" # ")
        le = float(sample.split('le="', 1)[1].split('"', 1)[0])
        count = float(sample.rsplit(" ", 1)[1])
        assert bool(exemplar) == (count > previous_count), line
        if exemplar:
            with_exemplar += 1
            assert exemplar.startswith('{span_id="b7ad6b7169203331",trace_id="0af7651916cd43dd8448eb211c80319c"} ')
            value, stamp = (float(x) for x in exemplar.split("} ", 1)[1].split())
            assert previous_le < value <= le and value >= 0.002 and abs(stamp - time.time()) < 60, line
        previous_le, previous_count = le, count
    assert previous_count == 5 and 1 <= with_exemplar <= 5
    assert not [ln for ln in _bucket_lines(om, "plain") if " # " in ln]
    _, headers, text = http(mon.url + "/metrics")
    assert headers["content-type"].startswith("text/plain; version=0.0.4")
    assert "trace_id" not in text.decode() and promtool_check(text).returncode == 0


@pytest.mark.prometheus
@pytest.mark.parametrize("features", [("exemplar-storage",), ("exemplar-storage", "native-histograms")],
                         ids=["openmetrics", "protobuf"])
def test_real_prometheus_returns_the_exemplar(make_monitor, tmp_path: Path, features: tuple[str, ...]) -> None:
    """Prometheus 2.42 with exemplar storage scrapes the agent and returns the call's trace id from
    /api/v1/query_exemplars (through OpenMetrics, and through protobuf with native histograms on)."""
    mon = make_monitor(port=0, sample_rate=0.25).start()
    model = mon.wrap(BusyWait(0.001), name="traced")
    stop = threading.Event()

    def drive() -> None:
        x = torch.zeros(1)
        deadline = time.monotonic() + 120
        with _span():
            while not stop.is_set() and time.monotonic() < deadline:
                model(x)
                stop.wait(0.002)

    t = threading.Thread(target=drive)
    t.start()
    try:
        with running_prometheus(tmp_path, [mon.url.removeprefix("http://")], features=features) as prom:
            started = time.time() - 60
            name = ("perfmon_forward_duration_seconds" if "native-histograms" in features
                    else "perfmon_forward_duration_seconds_bucket")

            def exemplars() -> list[dict[str, Any]]:
                return [e for series in prom.query_exemplars(f'{name}{{model="traced"}}', started, time.time() + 60)
                        for e in series.get("exemplars", [])]

            found = wait_until(exemplars, timeout=40, what="an exemplar in Prometheus")
            assert {e["labels"]["trace_id"] for e in found} == {f"{TRACE_ID:032x}"}
            assert {e["labels"]["span_id"] for e in found} == {f"{SPAN_ID:016x}"}
            assert all(0.001 <= float(e["value"]) < 0.1 for e in found)
            # no label or series per trace id: the series are the usual ones
            assert not prom.query('{__name__=~"perfmon_forward_duration_seconds.*", trace_id!=""}')
    finally:
        stop.set()
        t.join(10)


def test_a_failing_trace_reader_costs_the_exemplar_not_the_sample(make_monitor) -> None:
    """A tracer that raises is counted as an internal error; the call is still timed and returns."""
    def broken() -> Any:
        raise RuntimeError("tracer broke")

    mon = make_monitor(sample_rate=1.0, warmup_calls=1, trace_reader=broken).start()
    model = mon.wrap(torch.nn.Linear(4, 4), name="lin")
    for _ in range(5):
        assert model(torch.randn(1, 4)).shape == (1, 4)
    assert mon.flush()
    assert mon.registry.get_sample_value("perfmon_internal_errors_total", {"stage": "exemplar"}) == 5
    assert mon.registry.get_sample_value("perfmon_forward_duration_seconds_count",
                                         {"model": "lin", "device": "cpu", "phase": "steady", "stage": ""}) == 4


def _exemplars(mon: Any, model: str) -> set[str]:
    """The exemplars' label sets on ``model``'s steady latency buckets, from its registry rendered as OpenMetrics."""
    from prometheus_client.openmetrics.exposition import generate_latest

    body = generate_latest(mon.registry)
    return {ln.split(" # ", 1)[1].split("}", 1)[0] + "}" for ln in _bucket_lines(body, model)
            if 'phase="steady"' in ln and " # " in ln}


def test_the_exemplar_is_the_span_the_call_ran_in_read_off_the_request_thread(monkeypatch: pytest.MonkeyPatch,
                                                                             make_monitor) -> None:
    """By default the request thread takes OpenTelemetry's current context and the resolver thread finds the span
    in it (exemplars.otel_deferred: the lookup's five frames cost a server's cold request thread ~8 µs a timed call).
    The exemplar is still the span the call ran in, though that span has ended and another is current when it is
    read; opentelemetry's span lookup never runs on the request thread."""
    import opentelemetry.trace as otel_trace

    looked: list[int] = []
    real = otel_trace.get_current_span

    def recording(*args: Any, **kwargs: Any) -> Any:
        looked.append(threading.get_ident())
        return real(*args, **kwargs)

    monkeypatch.setattr(otel_trace, "get_current_span", recording)  # read when the monitor makes its reader
    mon = make_monitor(sample_rate=1.0, warmup_calls=1).start()
    model = mon.wrap(torch.nn.Linear(4, 4), name="lin")
    model(torch.randn(1, 4))  # the cold call
    with _span(trace_id=7, span_id=9):
        for _ in range(3):
            model(torch.randn(1, 4))
    with _span(trace_id=8, span_id=10):  # current while the resolver reads, on its own thread
        wait_until(lambda: hist_count(mon, "lin", "steady") == 3,
                   timeout=20, what="the resolver thread's pass")
    assert _exemplars(mon, "lin") == {f'{{span_id="{9:016x}",trace_id="{7:032x}"}}'}
    assert looked and threading.get_ident() not in looked, looked


def test_a_user_deferred_reader_is_taken_on_the_request_thread_and_read_on_the_resolvers(make_monitor) -> None:
    """``Monitor(trace_reader=Deferred(take, read))``: ``take`` on the calling thread at each timed call, ``read`` on
    the resolver thread with what ``take`` gave; a ``read`` that raises costs that exemplar, not the sample."""
    from perfmon.agent.exemplars import Deferred

    took: list[int] = []
    read: list[tuple[int, int]] = []

    def take() -> int:
        took.append(threading.get_ident())
        return len(took)

    def reading(taken: int) -> tuple[int, int] | None:
        read.append((taken, threading.get_ident()))
        if taken == 2:
            raise RuntimeError("tracer broke")
        return (taken, 1)

    mon = make_monitor(sample_rate=1.0, warmup_calls=1, trace_reader=Deferred(take, reading)).start()
    model = mon.wrap(torch.nn.Linear(4, 4), name="lin")
    for _ in range(4):
        model(torch.randn(1, 4))
    wait_until(lambda: len(read) == 4, timeout=20, what="the resolver reading every timed call's trace")
    assert took == [threading.get_ident()] * 4
    assert sorted(t for t, _ in read) == [1, 2, 3, 4] and threading.get_ident() not in {i for _, i in read}
    wait_until(lambda: hist_count(mon, "lin", "steady") == 3,
               timeout=20, what="every steady sample counted, the one whose read raised too")
    assert mon.registry.get_sample_value("perfmon_internal_errors_total", {"stage": "exemplar"}) == 1
    assert _exemplars(mon, "lin") == {f'{{span_id="{1:016x}",trace_id="{4:032x}"}}'}  # the latest steady call's


@pytest.mark.parametrize("trace_id, span_id, kept", [
    (0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, True), ((1 << 128) - 1, (1 << 64) - 1, True),
    (1 << 128, 1, False), (1, 1 << 64, False), (-5, 7, False), ("abc", 7, False), (1.5, 7, False), (0, 7, False),
])
def test_only_w3c_sized_sampled_ids_make_exemplars(monkeypatch: pytest.MonkeyPatch, trace_id, span_id,
                                                    kept: bool) -> None:
    """A non-SDK tracer may hand any ids: only a 128-bit trace id and a 64-bit span id, non-zero, are read
    (oversized ones made labels no OpenMetrics parser accepts; strings made the histogram drop the sample)."""
    import types

    import opentelemetry.trace as otel_trace

    from perfmon.agent.exemplars import otel_deferred, otel_reader

    ctx = types.SimpleNamespace(trace_id=trace_id, span_id=span_id, trace_flags=types.SimpleNamespace(sampled=True))
    monkeypatch.setattr(otel_trace, "get_current_span",
                        lambda context=None: types.SimpleNamespace(get_span_context=lambda: ctx))
    reader, deferred = otel_reader(), otel_deferred()
    assert reader is not None and deferred is not None
    assert (reader() is not None) is kept
    assert (deferred.read(deferred.take()) is not None) is kept  # the default: the same checks, on the resolver


def test_an_exemplar_that_cannot_be_built_costs_the_exemplar_not_the_sample() -> None:
    """Metrics.observe with ids it cannot render still counts the sample in the histogram."""
    from prometheus_client import CollectorRegistry

    from perfmon.agent.records import STEADY, Sample
    from perfmon.config import Config
    from perfmon.faults import InternalErrors
    from perfmon.metrics.store import Metrics

    reg = CollectorRegistry()
    metrics = Metrics(reg, Config.from_env({}), states=list, internal=InternalErrors(),
                      first_forward_origin=lambda end_ns: 0, process_collectors=False)
    metrics.observe([Sample("m", "cpu", STEADY, 0, 0.002, 0.002, 1, trace=("not", "ints"))])  # type: ignore[list-item]
    count = reg.get_sample_value("perfmon_forward_duration_seconds_count",
                                 {"model": "m", "device": "cpu", "phase": "steady", "stage": ""})
    assert count == 1
