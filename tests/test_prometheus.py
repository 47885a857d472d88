"""A real Prometheus scrapes a live agent; the latency it computes matches ground truth."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from perfmon.testing import BusyWait

from .conftest import promtool, wait_until
from .prom import running_prometheus

pytestmark = pytest.mark.prometheus

ROOT = Path(__file__).resolve().parents[1]


def test_prometheus_scrapes_exact_counts_and_true_latency(make_monitor, tmp_path: Path) -> None:
    """Prometheus' histogram_quantile over perfmon's buckets is within 5% of a 2 ms busy-wait's median."""
    mon = make_monitor(port=0, sample_rate=0.25).start()
    model = mon.wrap(BusyWait(0.002), name="busy")
    stop = threading.Event()
    calls = 0

    def drive() -> None:
        nonlocal calls
        x = torch.zeros(1)
        deadline = time.monotonic() + 60
        while not stop.is_set() and time.monotonic() < deadline:
            model(x)
            calls += 1
            stop.wait(0.001)

    t = threading.Thread(target=drive)
    t.start()
    try:
        host_port = mon.url.removeprefix("http://")
        with running_prometheus(tmp_path, [host_port]) as prom:
            q = ('histogram_quantile(0.5, sum by (le) '
                 '(rate(perfmon_forward_duration_seconds_bucket{model="busy",phase="steady"}[10s])))')
            def median() -> float | None:
                result = prom.query(q)
                v = float(result[0]["value"][1]) if result else float("nan")
                return v if v == v else None  # NaN until the rate window has samples

            value = wait_until(median, timeout=40, what="a latency median in Prometheus")
            assert abs(value / 0.002 - 1) < 0.05, value
            stop.set()
            t.join(10)
            # after the last scrape, Prometheus' counter equals the agent's exact count
            def scraped_calls() -> bool:
                got = prom.query('perfmon_forward_calls_total{model="busy"}')
                return bool(got) and float(got[0]["value"][1]) == calls

            wait_until(scraped_calls, timeout=20, what="Prometheus to scrape the final count")
            up = prom.query('up{job="perfmon"}')
            assert up and up[0]["value"][1] == "1"
    finally:
        stop.set()
        t.join(10)


def test_shipped_prometheus_config_is_valid() -> None:
    """deploy/prometheus/prometheus.yml passes `promtool check config`."""
    import subprocess

    result = subprocess.run([promtool(), "check", "config", str(ROOT / "deploy/prometheus/prometheus.yml")],
                            capture_output=True, timeout=60)
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()
