"""The fault matrix: each failure is counted, the request succeeds or fails with its own error, nothing grows."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from prometheus_client import generate_latest

import perfmon
from perfmon.captures.detector import Detector, RegressionPolicy
from perfmon.faults import InternalErrors

from .conftest import value, wait_capture, wait_until


def _wait_outcome(mon, cap_id: str, timeout: float = 30.0) -> dict:
    return wait_capture(mon, cap_id, timeout=timeout)


class Sometimes(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise ValueError("bad input")
        return x * 2


def test_model_raising_mid_capture_is_counted_and_the_capture_completes(make_monitor) -> None:
    """A call that raises inside a capture re-raises to the caller, is counted, and still counts as a step."""
    mon = make_monitor()
    model = mon.wrap(Sometimes(), name="m")
    cap = mon.capture("m", steps=3)
    model(torch.ones(1))
    model.fail = True
    with pytest.raises(ValueError, match="bad input"):
        model(torch.ones(1))
    model.fail = False
    assert torch.equal(model(torch.ones(1)), torch.full((1,), 2.0))
    meta = _wait_outcome(mon, cap["id"])
    assert meta["outcome"] == "ok" and meta["steps_recorded"] == 3
    assert value(mon, "perfmon_forward_errors_total", model="m", exception="ValueError") == 1


def test_housekeeping_fault_keeps_the_resolver_alive(make_monitor) -> None:
    """If the resolver's housekeeping raises every tick, it is counted and samples still resolve."""
    mon = make_monitor(sample_rate=1.0, resolve_interval_seconds=0.01)

    def broken_tick(now_ns: int) -> None:
        raise RuntimeError("housekeeping bug")

    mon.resolver.on_tick = broken_tick
    mon.start()
    model = mon.wrap(torch.nn.Linear(2, 2), name="m")
    model(torch.ones(1, 2))
    wait_until(lambda: value(mon, "perfmon_forward_duration_seconds_count", model="m", device="cpu", phase="cold"),
               timeout=5, what="the sample resolved")
    assert value(mon, "perfmon_forward_duration_seconds_count", model="m", device="cpu", phase="cold") == 1
    assert value(mon, "perfmon_internal_errors_total", stage="housekeeping") >= 1
    assert mon.health()[0]


def test_unusable_trace_dir_refuses_the_capture_cleanly(make_monitor, tmp_path: Path) -> None:
    """A trace directory that cannot be created: the capture is refused with the reason; calls are untouched."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    mon = make_monitor(trace_dir=str(blocker / "traces"))
    model = mon.wrap(torch.nn.Linear(2, 2), name="m")
    with pytest.raises(perfmon.ConfigError, match="not a directory"):
        mon.capture("m", steps=1)
    out = model(torch.ones(1, 2))
    assert out.shape == (1, 2)
    assert mon.captures.state == "idle"
    assert mon.profiles() == []  # nothing could be stored, nothing is listed
    model(torch.ones(1, 2))  # and the agent goes on
    assert value(mon, "perfmon_forward_calls_total", model="m") == 2


def test_metrics_scraped_while_stop_runs(make_monitor) -> None:
    """Scrapes racing stop(): stop returns within its bound; collect never raises; HTTP errors are clean refusals."""
    mon = make_monitor(port=0, sample_rate=1.0).start()
    model = mon.wrap(torch.nn.Linear(2, 2), name="m")
    for _ in range(20):
        model(torch.ones(1, 2))
    url = mon.url
    errors: list[BaseException] = []
    stop = threading.Event()
    rounds = [0]

    def scrape() -> None:
        while not stop.is_set():
            rounds[0] += 1
            try:
                generate_latest(mon.registry)
            except BaseException as exc:  # any exception from collect is a bug
                errors.append(exc)
            try:
                urllib.request.urlopen(url + "/metrics", timeout=2).read()
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass

    threads = [threading.Thread(target=scrape) for _ in range(4)]
    for t in threads:
        t.start()
    wait_until(lambda: rounds[0] >= 8, what="scrapes under way")
    t0 = time.monotonic()
    mon.stop()
    took = time.monotonic() - t0
    after = rounds[0]
    wait_until(lambda: rounds[0] >= after + 8, what="scrapes after stop()")
    stop.set()
    for t in threads:
        t.join(10)
    assert not errors and took < mon.config.stop_timeout_seconds + 3
    assert value(mon, "perfmon_forward_calls_total", model="m") == 20


def test_clock_jumps_do_not_crash_or_fire_the_detector() -> None:
    """Timestamps that jump backwards and far forwards neither raise nor fire."""
    det = Detector(RegressionPolicy(window_seconds=1, min_samples=5, baseline_windows=2), seed=1)
    s = 1_000_000_000
    t = 100 * s
    fired = []
    for i in range(500):
        t += s // 50
        if i in (100, 300):
            t -= 30 * s  # the clock steps back
        if i == 400:
            t += 3600 * s  # and far forward
        fired += det.add("m", 0.01, t)
        fired += det.tick(t)
    assert fired == []


def test_fault_bookkeeping_is_bounded() -> None:
    """Ten thousand faults of distinct kinds: counts stay exact, the log queue and the logged set stay bounded."""
    faults = InternalErrors()
    for i in range(10_000):
        faults.report("stage", type(f"E{i}", (Exception,), {})())

    class Sink:
        lines = 0

        def error(self, *args, **kw) -> None:
            Sink.lines += 1

    faults.log_new(Sink())
    assert dict(faults.counts()) == {"stage": 10_000}
    assert len(faults._notes) == 0 and Sink.lines <= 64 and len(faults._logged) <= 1024


def test_nvml_poller_survives_an_unexpected_exception(make_monitor) -> None:
    """An exception that is not an NVMLError inside a poll is counted; the poller keeps running and recovers."""
    from perfmon.testing import FakeNvml

    nvml = FakeNvml()
    mon = make_monitor(nvml=nvml, nvml_interval_seconds=0.02).start()
    real = nvml.nvmlDeviceGetCount
    nvml.nvmlDeviceGetCount = lambda: (_ for _ in ()).throw(ZeroDivisionError("odd"))  # type: ignore[method-assign]
    mon.nvml_poller.poll = lambda: 1 / 0  # type: ignore[method-assign]
    wait_until(lambda: value(mon, "perfmon_nvml_errors_total", call="poll"), timeout=5, what="a counted poll fault")
    assert value(mon, "perfmon_nvml_errors_total", call="poll") >= 1 and mon.nvml_poller.alive
    nvml.nvmlDeviceGetCount = real  # type: ignore[method-assign]


def test_interpreter_exit_without_stop_is_prompt(tmp_path: Path) -> None:
    """A process that starts a monitor and exits without stop() exits promptly and cleanly (atexit stops it)."""
    import subprocess
    import sys

    script = ("import perfmon, torch, sys\n"
              "m = perfmon.Monitor(port=0, log_level='error', prepare_profiler=False, trace_dir=sys.argv[1]).start()\n"
              "f = m.wrap(torch.nn.Linear(2, 2), name='m')\n"
              "[f(torch.ones(1, 2)) for _ in range(100)]\n"
              "print(m.url, flush=True)\n")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("http://127.0.0.1:") and "Traceback" not in proc.stderr
    assert time.monotonic() - t0 < 30
