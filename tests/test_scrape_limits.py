"""Scrapes at the documented limits (max_models models and as many generation names) within Prometheus'
10 s scrape timeout on the default CPU budget, and the expositions that make them cheap, byte for byte."""

from __future__ import annotations

import gzip
import http.client
import itertools
import math
import threading
import time
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Info
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as client_openmetrics
from prometheus_client.samples import Exemplar

from perfmon.metrics import promproto
from perfmon.metrics.exposition import generate_openmetrics, generate_text
from perfmon.metrics.family import HistogramRow, HistogramRows
from perfmon.metrics.native import NativeBuckets

from .conftest import wait_until

#: What Prometheus 2.x sends by default: OpenMetrics first (the dearer text format to render).
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                     "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
#: Prometheus' default scrape timeout and a common scrape interval (seconds).
SCRAPE_TIMEOUT = 10.0
INTERVAL = 15.0


def _scrape(port: int) -> tuple[float, int]:
    """One scrape as Prometheus makes it: (seconds it took, sample lines); raises past SCRAPE_TIMEOUT."""
    t0 = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=SCRAPE_TIMEOUT)
    try:
        conn.request("GET", "/metrics", headers={"Accept": PROMETHEUS_ACCEPT, "Accept-Encoding": "gzip"})
        resp = conn.getresponse()
        body = gzip.decompress(resp.read())
        assert resp.status == 200
    finally:
        conn.close()
    return time.monotonic() - t0, sum(1 for ln in body.split(b"\n") if ln and not ln.startswith(b"#"))


def test_two_scrapers_at_the_documented_limits_are_answered_within_the_scrape_timeout(make_monitor) -> None:
    """64 models and 64 generation names with traffic (~18,700 series), the default http_cpu_budget, two
    scrapers 1 s apart every 15 s (an HA pair whose offsets are close: neither can share the other's render):
    every scrape is answered within Prometheus' 10 s timeout. (Before: one render cost ~100-300 ms, the
    budget refills 10 ms a second, and the second scraper waited 10-25 s.)"""
    mon = make_monitor(port=0).start()
    assert mon.config.http_cpu_budget == 0.01
    n = mon.config.max_models
    models = [mon.wrap(torch.nn.Linear(4, 4), name=f"model_{i:02d}") for i in range(n)]
    stop = threading.Event()

    def traffic() -> None:
        x = torch.randn(2, 4)
        for i in itertools.islice(itertools.cycle(range(n)), 1_000_000):  # bounded, besides the stop event
            if stop.is_set():
                return
            models[i](x)
            with mon.generation(f"gen_{i:02d}", prompt_tokens=8) as g:
                g.token()  # TTFT
                g.token(1 + i % 3)  # and an inter-token gap
            stop.wait(0.002)

    feeder = threading.Thread(target=traffic)
    feeder.start()
    port = int(mon.url.rsplit(":", 1)[1])
    took: list[tuple[str, float, int]] = []
    errors: list[BaseException] = []
    try:
        # every model steady and every name with requests: all series exist before the first scrape
        wait_until(lambda: mon.flush() and all(mon.registry.get_sample_value(
            "perfmon_forward_duration_seconds_count", {"model": f"model_{i:02d}", "device": "cpu",
                                                       "phase": "steady", "stage": ""}) for i in range(n)),
                   timeout=60, what="steady samples of every model")
        start = time.monotonic()

        def scraper(name: str, offset: float) -> None:
            for k in range(2):
                stop.wait(max(0.0, start + offset + k * INTERVAL - time.monotonic()))
                try:
                    seconds, lines = _scrape(port)
                except BaseException as exc:  # a timeout included: reported below
                    errors.append(exc)
                    return
                took.append((name, seconds, lines))

        scrapers = [threading.Thread(target=scraper, args=(name, offset)) for name, offset in (("a", 0.0), ("b", 1.0))]
        for s in scrapers:
            s.start()
        for s in scrapers:
            s.join(INTERVAL + 2 * SCRAPE_TIMEOUT + 10)
    finally:
        stop.set()
        feeder.join(10)
    # what a failure needs to be read: the server's CPU and pauses, and the collections meanwhile
    seen = {"http_cpu_seconds": mon.cpu.totals()["http"], "paused_seconds": mon.registry.get_sample_value(
        "perfmon_agent_http_paused_seconds_total"), "gc": (mon.stats()["gc"] or {}).get("generations")}
    assert not errors, (errors, took, seen)
    assert len(took) == 4 and all(lines > 17_000 for _, _, lines in took), (took, seen)
    assert max(seconds for _, seconds, _ in took) < SCRAPE_TIMEOUT, (took, seen)


# -- the expositions, against prometheus_client's -------------------------------------------------------

#: Label values an exposition must escape or keep as they are: quotes, backslashes, newlines, braces (the
#: templates' own syntax), percent signs, other line separators, spaces, non-ASCII.
ODD = ['plain', 'q"uote', "back\\slash", "new\nline", "{br}ace{}", "per%cent s", "sep\u2028\x1c\x85", "ünï cødé", ""]


def _row(labels: tuple[str, ...], bounds: tuple[float, ...], counts: list[int], total: float,
         exemplars: list[Exemplar | None] | None = None, native: bool = False) -> HistogramRow:
    les = tuple(repr(float(b)) for b in bounds) + ("+Inf",)
    snap = None
    if native:
        nb = NativeBuckets()
        for b in bounds:
            nb.observe(b, 3)
        snap = nb.snapshot()
    return HistogramRow(labels, bounds, les, counts, total, exemplars, snap, {})


def _client_family(fam: HistogramRows) -> promproto.NativeHistogramFamily:
    """The same family built the prometheus_client way (add_metric), natives attached."""
    out = promproto.NativeHistogramFamily(fam.name, fam.documentation, labels=list(fam.labelnames))
    for row in fam.rows:
        total = 0
        buckets: list[Any] = []
        for i, (le, n) in enumerate(zip(row.les, row.counts)):
            total += n
            ex = row.exemplars[i] if row.exemplars is not None else None
            buckets.append((le, float(total)) if ex is None else (le, float(total), ex))
        out.add_metric(list(row.labels), buckets, row.sum)
        if row.native is not None:
            out.add_native(row.labels, row.native)
    return out


def _families() -> list[HistogramRows]:
    bounds = (0.001, 0.01, 0.1, 1.0)
    ex = Exemplar({"trace_id": "0af7651916cd43dd8448eb211c80319c", "span_id": 'b"7\\ad\n'}, 0.05, 1700000000.25)
    latency = HistogramRows("lat_seconds", 'Help with "quotes", \\ and\nnewline.', labels=["model", "phase"])
    for i, value in enumerate(ODD):
        latency.add_row(_row((value, ODD[-1 - i]), bounds, [i, 0, 2 * i, 1, 3], 0.5 * i + 0.25,
                             [None, None, ex, None, Exemplar({"a": "b"}, 2.0)] if i % 2 else None, native=i % 3 == 0))
    big = HistogramRows("big", "Counts past a million (Go's exponent form) and odd sums.", labels=["model"])
    big.add_row(_row(("m",), bounds, [999_999, 1, 1_234_567, 10**17 + 1, 0], 1e300))
    big.add_row(_row(("n",), bounds, [0, 0, 0, 0, 0], 0.0))
    big.add_row(_row(("o",), bounds, [1, 0, 0, 0, 1], math.inf))
    negative = HistogramRows("neg", "Negative buckets: no count or sum.", labels=["model"])
    negative.add_row(_row(("m",), (-1.0, 0.0, 1.0), [1, 2, 3, 4], -3.0))
    empty = HistogramRows("empty", "No rows at all.", labels=["model"])
    return [latency, big, negative, empty]


class _Registry:
    """perfmon's families between prometheus_client's own (``client``'s), as a scrape sees them."""

    def __init__(self, client: CollectorRegistry, perfmon_families: list[Any]) -> None:
        self.client = client
        self.perfmon = perfmon_families

    def collect(self) -> list[Any]:
        client = list(self.client.collect())
        return [client[0], *self.perfmon[:2], client[1], *self.perfmon[2:], client[2]]


def _client_registry() -> CollectorRegistry:
    """A counter (with its _created), a gauge and an info, of prometheus_client's own making."""
    client = CollectorRegistry()
    Counter("calls", "Calls.", ["model"], registry=client).labels(model='a"b').inc(3)
    Gauge("depth", "Depth.", registry=client).set(-0.5)
    Info("build", "Build.", registry=client).info({"version": "1\n2"})
    return client


def test_text_and_openmetrics_are_byte_for_byte_what_prometheus_client_writes() -> None:
    """Rows with odd label values, exemplars, counts past 1e6, negative buckets and an empty family, between
    ordinary families: generate_text and generate_openmetrics equal prometheus_client's encoders of the same
    families built with add_metric; twice (the second from the kept templates)."""
    families = _families()
    client = _client_registry()
    ours = _Registry(client, families)
    theirs = _Registry(client, [_client_family(f) for f in families])
    for _ in range(2):
        assert generate_text(ours) == generate_latest(theirs)  # type: ignore[arg-type]
        assert generate_openmetrics(ours) == client_openmetrics(theirs)


def test_protobuf_from_rows_equals_protobuf_from_samples() -> None:
    """encode_family of a HistogramRows family (from its rows) writes the bytes it writes for the same family
    built with add_metric (from samples), native buckets and exemplars included."""
    for fam in _families():
        assert promproto.encode_family(fam) == promproto.encode_family(_client_family(fam)), fam.name


def test_rows_make_the_samples_add_metric_makes() -> None:
    """Anything that reads ``samples`` (get_sample_value, another encoder) sees what HistogramMetricFamily
    would have held."""
    for fam in _families():
        plain = HistogramMetricFamily(fam.name, fam.documentation, labels=list(fam.labelnames))
        for s in _client_family(fam).samples:
            plain.samples.append(s)
        assert fam.samples == plain.samples and fam.samples is fam.samples


#: Families whose values move between two renders of an idle agent (its own CPU, the process's).
#: Families that move on their own between two renders: the agent's threads run meanwhile (its CPU, its wakes: the
#: resolver's idle tick can fall between them).
_LIVE = ("process_", "perfmon_agent_cpu_seconds_total", "perfmon_agent_wakeups_total", "perfmon_resolver_lag_seconds")


@pytest.mark.parametrize("ours, theirs", [(generate_text, generate_latest), (generate_openmetrics, client_openmetrics)],
                         ids=["text", "openmetrics"])
def test_a_monitors_scrape_is_what_prometheus_client_writes(make_monitor, ours: Any, theirs: Any) -> None:
    """A monitor with forward, batch-size and generation histograms (and its scrape-time families) renders
    the same lines through perfmon's encoders as through prometheus_client's."""
    mon = make_monitor(sample_rate=1.0).start()
    models = []  # held: a dropped module is freed, and its FLOPs are then never counted ("the module is gone")
    for name in ("a", 'b"{x}'):
        model = mon.wrap(torch.nn.Linear(4, 4), name=name)
        models.append(model)
        for _ in range(6):
            model(torch.randn(3, 4))
        with mon.generation(f"gen {name}", prompt_tokens=5) as g:
            g.token(3)
    assert mon.flush()
    # Each model's signature counted (its own thread) before the two renders: the efficiency families then hold still.
    wait_until(lambda: all(mon.stats()["models"][n]["efficiency"].get("flops_per_call") for n in ("a", 'b"{x}')),
               what="the models' FLOP counts")

    def stable(body: bytes) -> list[bytes]:
        """The lines, without those of the live families (``# HELP name``, ``# TYPE name``, ``name{...} v``)."""
        def name(line: bytes) -> str:
            words = line.split(b" ")
            return (words[2] if line.startswith(b"# ") and len(words) > 2 else words[0]).decode()
        return [ln for ln in body.split(b"\n") if not name(ln).startswith(_LIVE)]

    assert len(stable(ours(mon.registry))) > 500
    assert stable(ours(mon.registry)) == stable(theirs(mon.registry))
