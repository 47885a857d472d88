"""Native histograms: exponential buckets, the hand-written protobuf exposition, a real Prometheus reading it."""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.metrics_core import InfoMetricFamily, StateSetMetricFamily, UnknownMetricFamily
from prometheus_client.samples import Exemplar

import perfmon
from perfmon.http.wire import metrics_format, wants_protobuf
from perfmon.metrics import native, promproto
from perfmon.testing import BusyWait

from . import protowire
from .conftest import http, promtool_check, wait_until
from .prom import running_prometheus

#: What Prometheus 2.42 sends with --enable-feature=native-histograms (scrape/scrape.go).
PROMETHEUS_NATIVE_ACCEPT = ("application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;"
                            "encoding=delimited,application/openmetrics-text;version=1.0.0;q=0.8,"
                            "application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,"
                            "*/*;q=0.1")
PROMETHEUS_DEFAULT_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
                             "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


@pytest.mark.parametrize("schema", [8, 3, 1, 0, -1, -2])
def test_bucket_index_follows_prometheus_bucket_boundaries(schema: int) -> None:
    """Bucket i of schema s holds (base**(i-1), base**i] with base = 2**(2**-s), powers of two included."""
    base = 2.0 ** (2.0**-schema)
    rng = random.Random(schema)
    values = [2.0**e for e in range(-20, 20)] + [rng.lognormvariate(-5, 3) for _ in range(2000)]
    for v in values:
        i = native.bucket_index(v, schema)
        lo, hi = base ** (i - 1), base**i
        assert lo * (1 - 1e-12) < v <= hi * (1 + 1e-12), (v, i, lo, hi)


def test_native_buckets_stay_bounded_by_halving_resolution() -> None:
    """A spread wider than MAX_BUCKETS buckets lowers the schema; no observation is lost."""
    nb = native.NativeBuckets()
    rng = random.Random(1)
    values = [rng.lognormvariate(-5, 6) for _ in range(50_000)] + [0.0]
    for v in values:
        nb.observe(v)
    assert len(nb.counts) <= native.MAX_BUCKETS and nb.schema < native.SCHEMA
    assert sum(nb.counts.values()) + nb.zero_count == len(values) and nb.zero_count == 1
    # every value is still in the bucket that holds it at the final schema
    expected: dict[int, int] = {}
    for v in values[:-1]:
        k = native.bucket_index(v, nb.schema)
        expected[k] = expected.get(k, 0) + 1
    assert expected == nb.counts


def test_observe_many_counts_as_observe_one_by_one() -> None:
    """A request's inter-token gaps are folded in one loop (observe_many): the same buckets, zero count and schema as
    observing them one at a time, weights (chunks of tokens) included, through a halving of the resolution."""
    rng = random.Random(2)
    runs = [[rng.lognormvariate(-6, 3) for _ in range(rng.randint(1, 64))] for _ in range(400)]
    runs.append([0.0, math.inf, 1e-3, -1.0])
    one, many = native.NativeBuckets(), native.NativeBuckets()
    for i, run in enumerate(runs):
        weights = [rng.randint(1, 4) for _ in run] if i % 3 == 0 else None
        for j, v in enumerate(run):
            one.observe(v, 1 if weights is None else weights[j])
        many.observe_many(run, weights)
    assert many.schema == one.schema < native.SCHEMA  # the spread forced at least one halving
    assert many.zero_count == one.zero_count and many.counts == one.counts


def test_spans_and_deltas_round_trip() -> None:
    """Spans (absolute first offset, then gaps) and deltas rebuild the populated buckets exactly."""
    counts = {-140: 3, -139: 1, -137: 5, -120: 2, 4: 1}
    span_list, deltas = native.spans(counts)
    rebuilt: dict[int, int] = {}
    index, running, it = 0, 0, iter(deltas)
    for offset, length in span_list:
        index += offset
        for _ in range(length):
            running += next(it)
            if running:
                rebuilt[index] = running
            index += 1
    assert rebuilt == counts
    assert len(span_list) == 3  # the one-bucket gap is filled with a zero, the wide ones are spans


def test_negotiation_serves_protobuf_only_when_asked_first() -> None:
    """Prometheus' native-histogram Accept gets protobuf; its default Accept, none or text get what they did."""
    assert metrics_format(PROMETHEUS_NATIVE_ACCEPT)[1] == promproto.CONTENT_TYPE
    assert metrics_format(PROMETHEUS_DEFAULT_ACCEPT)[1].startswith("application/openmetrics-text")
    assert metrics_format("")[1].startswith("text/plain; version=0.0.4")
    assert metrics_format("text/plain")[1].startswith("text/plain; version=0.0.4")
    # ranked below another format, or with q=0, protobuf is not chosen
    below = ("application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited;q=0.2,"
             "text/plain")
    assert not wants_protobuf(below)
    assert not wants_protobuf("application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;"
                              "encoding=delimited;q=0")
    assert not wants_protobuf("application/vnd.google.protobuf;proto=other;encoding=delimited")


def test_every_family_type_round_trips_through_protobuf() -> None:
    """Counters (with _total and created), gauges, summaries, info, stateset and unknown decode to their values."""
    counter = CounterMetricFamily("c", "a counter", labels=["k"])
    counter.add_metric(["a"], 3.0, created=1700000000.5)
    gauge = GaugeMetricFamily("g", "a gauge", labels=["k"])
    gauge.add_metric(["a"], -1.5)
    gauge.add_metric(["b"], 0.0)
    summary = SummaryMetricFamily("s", "a summary", count_value=4, sum_value=2.5)
    info = InfoMetricFamily("i", "info", value={"version": "1"})
    state = StateSetMetricFamily("st", "a stateset", value={"on": True, "off": False})
    unknown = UnknownMetricFamily("u", "untyped", value=7.0)
    fams = {f["name"]: f for f in protowire.families(promproto.encode_families(
        [counter, gauge, summary, info, state, unknown]))}
    assert set(fams) == {"c_total", "g", "s", "i_info", "st", "u"}
    c = fams["c_total"]
    assert c.get("type", 0) == 0 and c["help"] == "a counter"
    assert c["metric"][0]["counter"]["value"] == 3.0 and protowire.labels(c["metric"][0]) == {"k": "a"}
    assert c["metric"][0]["counter"]["created_timestamp"] == {"seconds": 1700000000, "nanos": 500_000_000}
    assert [m["gauge"].get("value", 0.0) for m in fams["g"]["metric"]] == [-1.5, 0.0] and fams["g"]["type"] == 1
    assert fams["s"]["type"] == 2 and fams["s"]["metric"][0]["summary"] == {"sample_count": 4, "sample_sum": 2.5}
    assert fams["i_info"]["type"] == 1 and protowire.labels(fams["i_info"]["metric"][0]) == {"version": "1"}
    assert {protowire.labels(m)["st"]: m["gauge"].get("value", 0.0) for m in fams["st"]["metric"]} == {"on": 1.0,
                                                                                                        "off": 0.0}
    assert fams["u"]["type"] == 3 and fams["u"]["metric"][0]["untyped"]["value"] == 7.0


@contextmanager
def _driven(model: torch.nn.Module, pause: float = 0.001) -> Iterator[list[int]]:
    """Call ``model`` on a thread until the block ends (bounded to 120 s); yields [calls so far]."""
    stop = threading.Event()
    calls = [0]

    def drive() -> None:
        x = torch.zeros(1)
        deadline = time.monotonic() + 120
        while not stop.is_set() and time.monotonic() < deadline:
            model(x)
            calls[0] += 1
            stop.wait(pause)

    t = threading.Thread(target=drive)
    t.start()
    try:
        yield calls
    finally:
        stop.set()
        t.join(10)


def test_live_agent_protobuf_matches_its_text_scrape(make_monitor) -> None:
    """A protobuf scrape of a live agent carries the same families, counts and classic buckets as its text
    scrape, plus native buckets whose counts add up; a text scrape is byte-identical to prometheus_client's."""
    # count_flops off: a FLOP count that ends between the two scrapes would add the efficiency families to the second
    mon = make_monitor(port=0, sample_rate=1.0, warmup_calls=2, count_flops=False).start()
    model = mon.wrap(BusyWait(0.0002), name="busy")
    for _ in range(300):
        model(torch.zeros(1))
    assert mon.flush()
    status, headers, body = http(mon.url + "/metrics", headers={"Accept": PROMETHEUS_NATIVE_ACCEPT})
    assert status == 200 and headers["content-type"] == promproto.CONTENT_TYPE
    fams = {f["name"]: f for f in protowire.families(body)}
    # a text scrape, no Accept: prometheus_client's own text exposition of the same registry, unchanged
    status, headers, text = http(mon.url + "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
    # (the agent's own CPU, lag and process figures move between two renders; everything else is equal)
    def steady_lines(b: bytes) -> list[bytes]:
        return [ln for ln in b.splitlines() if not ln.startswith((b"process_", b"perfmon_agent_", b"perfmon_resolver"))]

    assert steady_lines(text) == steady_lines(generate_latest(mon.registry))
    assert promtool_check(text).returncode == 0, promtool_check(text).stdout
    for metric in mon.registry.collect():
        name = metric.name + ("_total" if metric.type == "counter" else "_info" if metric.type == "info" else "")
        assert (name in fams) == bool(metric.samples), name
    calls = fams["perfmon_forward_calls_total"]["metric"][0]
    assert calls["counter"]["value"] == 300 and protowire.labels(calls) == {"model": "busy", "stage": ""}
    hist = {protowire.labels(m)["phase"]: m["histogram"] for m in fams["perfmon_forward_duration_seconds"]["metric"]}
    steady = hist["steady"]
    assert steady["sample_count"] == 298 and hist["cold"]["sample_count"] == 2
    assert steady["schema"] == native.SCHEMA and steady["zero_threshold"] == native.ZERO_THRESHOLD
    assert sum(protowire.native_counts(steady).values()) + steady.get("zero_count", 0) == 298
    # classic buckets too (without +Inf, which is sample_count): the bounds of the default grid
    assert [b["upper_bound"] for b in steady["bucket"]] == list(perfmon.DEFAULT_BUCKETS)
    assert steady["bucket"][-1]["cumulative_count"] <= 298
    # each native bucket's range contains values the classic buckets agree with: the total sum matches
    text_sum = mon.registry.get_sample_value("perfmon_forward_duration_seconds_sum",
                                             {"model": "busy", "device": "cpu", "phase": "steady", "stage": ""})
    assert math.isclose(steady["sample_sum"], text_sum)


def _spin(seconds: float) -> None:
    """Busy-wait ``seconds`` (a bounded loop on the monotonic clock): a token that takes CPU time to make."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _tokens(n: int, first: float = 0.002, gap: float = 0.0005) -> Iterator[int]:
    _spin(first)
    for i in range(n):
        yield i
        if i < n - 1:
            _spin(gap)


def test_ttft_and_itl_carry_native_buckets_in_protobuf_and_the_other_generation_histograms_do_not(
        make_monitor) -> None:
    """TTFT and ITL (the generation latency signals) get native buckets whose counts add up to the classic
    ones; duration and token counts stay classic (coarse on purpose)."""
    mon = make_monitor(port=0).start()
    for _ in range(5):
        for _tok in mon.stream(_tokens(4), name="chat", prompt_tokens=3):
            pass
    with mon.generation(name="chat") as g:  # a chunk of 3 tokens after the first: 3 ITL observations
        g.token()
        g.token(3)
    assert mon.flush()
    status, _, body = http(mon.url + "/metrics", headers={"Accept": PROMETHEUS_NATIVE_ACCEPT})
    assert status == 200
    fams = {f["name"]: f for f in protowire.families(body)}
    ttft = fams["perfmon_time_to_first_token_seconds"]["metric"][0]["histogram"]
    itl = fams["perfmon_inter_token_latency_seconds"]["metric"][0]["histogram"]
    assert ttft["sample_count"] == 6 and itl["sample_count"] == 5 * 3 + 3
    for h in (ttft, itl):
        assert h["schema"] == native.SCHEMA
        assert sum(protowire.native_counts(h).values()) + h.get("zero_count", 0) == h["sample_count"]
    for name in ("perfmon_generation_duration_seconds", "perfmon_generation_output_tokens"):
        h = fams[name]["metric"][0]["histogram"]
        assert h["sample_count"] == 6 and not protowire.native_counts(h) and "schema" not in h, name


def test_exemplars_ride_on_classic_buckets_in_protobuf() -> None:
    """A bucket's exemplar is encoded in the protobuf Bucket (labels, value, timestamp)."""
    fam = promproto.NativeHistogramFamily("h_seconds", "h", labels=["model"])
    ex = Exemplar({"trace_id": "ab" * 16, "span_id": "cd" * 8}, 0.002, 1700000000.25)
    fam.add_metric(["m"], [("0.001", 0.0), ("0.01", 1.0, ex), ("+Inf", 1.0)], 0.002)
    fam.add_native(["m"], native.NativeSnapshot(3, native.ZERO_THRESHOLD, 0, {-71: 1}))
    h = protowire.families(promproto.encode_families([fam]))[0]["metric"][0]["histogram"]
    assert len(h["bucket"]) == 2 and "exemplar" not in h["bucket"][0]
    got = h["bucket"][1]["exemplar"]
    assert protowire.labels(got) == {"trace_id": "ab" * 16, "span_id": "cd" * 8}
    assert got["value"] == 0.002 and got["timestamp"] == {"seconds": 1700000000, "nanos": 250_000_000}
    assert protowire.native_counts(h) == {-71: 1} and h["sample_count"] == 1


@pytest.mark.prometheus
def test_real_prometheus_reads_native_histograms_within_schema_resolution(make_monitor, tmp_path: Path) -> None:
    """Prometheus 2.42 with native histograms scrapes protobuf; its native p50 matches /stats within one bucket."""
    mon = make_monitor(port=0, sample_rate=0.25).start()
    model = mon.wrap(BusyWait(0.002), name="busy")
    stop = threading.Event()

    def chat() -> None:  # generation requests: a 2 ms first token, then 0.5 ms gaps (bounded: 120 s)
        deadline = time.monotonic() + 120
        while not stop.is_set() and time.monotonic() < deadline:
            for _tok in mon.stream(_tokens(4), name="chat"):
                pass
            stop.wait(0.005)

    streams = threading.Thread(target=chat)
    streams.start()
    try:
        with _driven(model) as calls, running_prometheus(tmp_path, [mon.url.removeprefix("http://")],
                                                         features=("native-histograms",)) as prom:
            _check_native_prometheus(mon, prom, calls)
    finally:
        stop.set()
        streams.join(10)


def _check_native_prometheus(mon: perfmon.Monitor, prom: Any, calls: list[int]) -> None:
    """Forward latency and TTFT medians from Prometheus' native series agree with /stats; no classic buckets."""
    def median(q: str) -> Callable[[], float | None]:
        def read() -> float | None:
            result = prom.query(q)
            v = float(result[0]["value"][1]) if result else math.nan
            return v if not math.isnan(v) else None
        return read

    # Within one bucket of schema 3 (adjacent bounds 2**(1/8) apart): both lie in the same or neighbouring
    # buckets, whatever the interpolation inside it.
    width = 2.0 ** (2.0**-native.SCHEMA)
    got = wait_until(median('histogram_quantile(0.5, rate(perfmon_forward_duration_seconds'
                            '{model="busy",phase="steady"}[1m]))'),
                     timeout=40, what="a native latency median in Prometheus")
    exact = mon.stats()["models"]["busy"]["latency"]["steady"]["duration"]["p50_seconds"]
    assert 1 / width <= got / exact <= width, (got, exact)
    # TTFT too (generation histograms): native where scraped so, the same agreement with /stats
    got = wait_until(median('histogram_quantile(0.5, rate(perfmon_time_to_first_token_seconds{model="chat"}[1m]))'),
                     timeout=40, what="a native TTFT median in Prometheus")
    exact = mon.stats()["generation"]["chat"]["time_to_first_token"]["p50_seconds"]
    assert 1 / width <= got / exact <= width, (got, exact)
    assert prom.query('perfmon_time_to_first_token_seconds_bucket{model="chat"}') == []
    # It is a native histogram: one series, no classic _bucket series (Prometheus 2.42 keeps one form)
    series = prom.query('perfmon_forward_duration_seconds{model="busy",phase="steady"}')
    assert series and "histogram" in series[0], series
    assert prom.query('perfmon_forward_duration_seconds_bucket{model="busy"}') == []
    # and every other family came through protobuf too: the exact call count
    wait_until(lambda: float(prom.query('perfmon_forward_calls_total{model="busy"}')[0]["value"][1]) > 0,
               timeout=20, what="the call counter")
    assert calls[0] > 0 and prom.query('up{job="perfmon"}')[0]["value"][1] == "1"
