"""A short soak in the suite: many calls at 100% sampling with scrapes and captures, nothing lost or leaked."""

from __future__ import annotations

import os
import threading
import urllib.request

import torch

from .conftest import value, wait_capture


def test_short_soak_loses_nothing_and_stays_bounded(make_monitor, tmp_path) -> None:
    """100k calls with scrapes and repeated captures: counts exact, threads, files and trace store bounded."""
    mon = make_monitor(port=0, sample_rate=1.0, trace_dir=str(tmp_path), trace_max_files=2,
                       manual_captures_per_hour=1000).start()
    model = mon.wrap(torch.nn.Linear(4, 4), name="m")
    x = torch.randn(1, 4)
    for _ in range(1000):
        model(x)
    mon.flush()
    threads0, fds0 = threading.active_count(), len(os.listdir("/proc/self/fd"))
    stop = threading.Event()

    def scraper() -> None:
        while not stop.is_set():
            urllib.request.urlopen(mon.url + "/metrics", timeout=10).read()
            stop.wait(0.05)

    t = threading.Thread(target=scraper)
    t.start()
    made = 1000
    try:
        for _round in range(5):
            cap = mon.capture("m", steps=2)
            for _ in range(20_000):
                model(x)
            made += 20_000
            wait_capture(mon, cap["id"])
    finally:
        stop.set()
        t.join(10)
    mon.flush()
    st = mon.stats()["models"]["m"]
    timed = sum(st["latency"].get(p, {}).get("duration", {}).get("count", 0) for p in ("cold", "steady"))
    assert value(mon, "perfmon_forward_calls_total", model="m") == made
    # every timed call is in a histogram or counted as dropped (10 calls ran under the profiler, untimed)
    hist = sum(value(mon, "perfmon_forward_duration_seconds_count", model="m", device="cpu", phase=p) or 0
               for p in ("cold", "steady"))
    assert hist + sum(st["dropped"].values()) == st["sampled"] and st["sampled"] == made - 10
    assert timed <= mon.config.stats_max_samples * 2
    assert threading.active_count() <= threads0 + 2  # an exporter thread may still be winding down
    assert len(os.listdir("/proc/self/fd")) <= fds0 + 4
    assert len([p for p in tmp_path.iterdir() if p.name.endswith(".pt.trace.json.gz")]) <= 2
