"""Reported latency matches ground truth measured in the same process."""

from __future__ import annotations

import statistics
import time

import torch

from perfmon.testing import BusyWait, histogram_quantile

from .conftest import buckets


def test_two_ms_module_p50_within_five_percent_in_stats_and_histogram(make_monitor) -> None:
    """A ~2 ms busy-wait reports p50 within 5% of the bare median, in /stats and via histogram_quantile."""
    mon = make_monitor(sample_rate=1.0, warmup_calls=3).start()
    bare = BusyWait(0.002)
    model = mon.wrap(BusyWait(0.002), name="busy")
    x = torch.zeros(1)
    bare_ns = []
    for _ in range(150):  # interleaved, so both see the same machine noise
        t0 = time.perf_counter_ns()
        bare(x)
        bare_ns.append(time.perf_counter_ns() - t0)
        model(x)
    assert mon.flush()
    truth = statistics.median(bare_ns) / 1e9
    p50_stats = mon.stats()["models"]["busy"]["latency"]["steady"]["duration"]["p50_seconds"]
    p50_hist = histogram_quantile(0.5, buckets(mon, "busy", "steady"))
    assert abs(p50_stats / truth - 1) < 0.05, (p50_stats, truth)
    assert abs(p50_hist / truth - 1) < 0.05, (p50_hist, truth)


def test_histogram_quantile_helper_matches_prometheus_rules() -> None:
    """The helper interpolates inside the bucket and caps at the highest finite bound like Prometheus."""
    inf = float("inf")
    assert histogram_quantile(0.5, [(1.0, 0), (2.0, 10), (inf, 10)]) == 1.5
    assert histogram_quantile(0.99, [(1.0, 1), (2.0, 1), (inf, 10)]) == 2.0
    assert histogram_quantile(0.25, [(1.0, 10), (inf, 10)]) == 0.25
