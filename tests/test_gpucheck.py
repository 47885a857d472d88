"""The real-GPU check's logic on CPU: no-GPU exit, report building, the runner, and checks on the fake GPU."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks import gpucheck
from benchmarks.gpucheck import Check, build_report, run_checks
from perfmon.testing import FakeCuda, FakeGpu, GpuWork


class FakeRig:
    """A ``gpucheck.Rig`` over ``FakeCuda``: work is fake device milliseconds, a wait is ``gpu.finish()``."""

    real = False
    device = "cuda:0"

    def __init__(self) -> None:
        self.gpu = FakeGpu()
        self.backend = FakeCuda(self.gpu)

    def work(self, ms: float) -> torch.nn.Module:
        return GpuWork(self.gpu, ms)

    def launch_bound(self) -> torch.nn.Module:
        return GpuWork(self.gpu, 0.001)  # next to nothing on the device: the host sets the pace

    def input(self) -> Any:
        return torch.zeros(1)

    def synchronize(self) -> None:
        self.gpu.finish()

    def stream(self, index: int) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()  # FakeGpu's current stream is per device, not per thread

    def capture_graph(self, model: torch.nn.Module, x: Any) -> bool:
        stream = self.gpu.current[0]
        stream.capturing = True
        try:
            model(x)
        finally:
            stream.capturing = False
        return True


ENV = {"device": "NVIDIA H100 80GB HBM3", "driver": "550.54", "cuda": "12.4", "torch": "2.13.0",
       "perfmon": "0.0.0"}


def test_without_cuda_main_exits_with_the_no_gpu_status_and_writes_nothing(tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Without CUDA, main returns EXIT_NO_GPU (3), says it needs a GPU and creates no report directory."""
    out = tmp_path / "report"
    assert gpucheck.main(["--out", str(out), "--quick"], cuda_available=lambda: False) == gpucheck.EXIT_NO_GPU == 3
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not out.exists()


def test_main_writes_markdown_and_json_and_exits_by_verdict(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """With CUDA (faked), main writes both report files and returns 0 when all pass, 1 when one fails."""
    seams: dict[str, Any] = {"rig": FakeRig, "env": lambda: dict(ENV), "cuda_available": lambda: True}
    checks = (("no_sync", gpucheck.check_no_sync), ("overhead", gpucheck.check_overhead))
    assert gpucheck.main(["--out", str(tmp_path / "a")], checks=checks, **seams) == gpucheck.EXIT_OK
    data = json.loads((tmp_path / "a" / "gpucheck.json").read_text())
    assert [(c["name"], c["verdict"]) for c in data["checks"]] == [("no_sync", "pass"), ("overhead", "skip")]
    assert data["env"]["device"] == ENV["device"] and data["env"]["quick"] is False
    assert "| no_sync | pass |" in (tmp_path / "a" / "gpucheck.md").read_text()
    failing = (("bad", lambda rig, quick=False: Check("bad", "fail", "no")),)
    assert gpucheck.main(["--out", str(tmp_path / "b"), "--quick"], checks=failing, **seams) == gpucheck.EXIT_FAILED
    assert "FAIL bad" in capsys.readouterr().err


def test_build_report_gives_table_verdicts_and_json_with_units() -> None:
    """build_report renders one table row per check, an overall fail if any failed, and figures with units."""
    checks = [
        Check("timing_truth", "pass", "device time matches", {"1ms.error": (1.5, "µs")}, seconds=2.0),
        Check("nvml", "fail", "perfmon_nvml_up is 0 | oops", {"nvml_up": (0.0, "")}),
        Check("generation", "skip", "transformers is not installed"),
    ]
    md, data = build_report(checks, ENV)
    assert "| timing_truth | pass | device time matches |" in md
    assert "| nvml | fail | perfmon_nvml_up is 0 \\| oops |" in md
    assert "| generation | skip | transformers is not installed |" in md
    assert "**Overall: fail** — 1 passed, 1 failed, 1 skipped." in md
    assert "| 1ms.error | 1.5 | µs |" in md
    assert "- device: NVIDIA H100 80GB HBM3" in md
    assert data["verdict"] == "fail" and data["counts"] == {"pass": 1, "fail": 1, "skip": 1}
    assert data["env"]["driver"] == "550.54"
    first = data["checks"][0]
    assert first["figures"] == {"1ms.error": {"value": 1.5, "unit": "µs"}} and first["seconds"] == 2.0
    assert json.loads(json.dumps(data)) == data  # JSON-ready as is


def test_runner_turns_an_exception_into_a_fail_and_runs_the_rest() -> None:
    """A check that raises is reported as fail with the exception; the checks after it still run."""
    ran: list[str] = []

    def boom(rig: Any, *, quick: bool = False) -> Check:
        ran.append("boom")
        raise ValueError("driver went away\nsecond line")

    def fine(rig: Any, *, quick: bool = False) -> Check:
        ran.append("fine")
        return Check("fine", "pass", "ok", {"n": (1, "")})

    lines: list[str] = []
    results = run_checks([("boom", boom), ("fine", fine)], FakeRig(), progress=lines.append)
    assert ran == ["boom", "fine"]
    assert [(c.name, c.verdict) for c in results] == [("boom", "fail"), ("fine", "pass")]
    assert results[0].summary == "raised ValueError: driver went away"
    assert all(c.seconds >= 0 for c in results) and len(lines) == 2 and lines[0].startswith("FAIL boom")


def test_timing_no_sync_and_pool_checks_pass_on_the_fake_gpu() -> None:
    """On FakeCuda the timing, host-vs-device, no-sync, event-pool and graph-capture checks pass with exact figures."""
    rig = FakeRig()
    timing = gpucheck.check_timing_truth(rig, quick=True)
    assert timing.verdict == "pass", timing.summary
    assert timing.figures["20ms.perfmon_mean"] == pytest.approx((20_000.0, "µs"))
    assert timing.figures["1ms.relative_error"][0] == pytest.approx(0.0, abs=1e-9)
    split = gpucheck.check_host_vs_device(rig, quick=True)
    assert split.verdict == "pass", split.summary
    assert split.figures["device_bound.device_mean"] == pytest.approx((20_000.0, "µs"))
    no_sync = gpucheck.check_no_sync(rig)
    assert no_sync.verdict == "pass", no_sync.summary
    assert no_sync.figures["perfmon_device"][0] == pytest.approx(100.0)
    pool = gpucheck.check_event_pool(rig, quick=True)
    assert pool.verdict == "pass", pool.summary
    assert pool.figures["pairs_in_flight_after"] == (0, "")
    graph = gpucheck.check_graph_capture(rig)
    assert graph.verdict == "pass" and graph.figures["dropped_graph_capture"][0] >= 1
    default = gpucheck.check_event_pool_default(rig, quick=True)
    assert default.verdict == "pass", default.summary
    assert default.figures["1%.calls"][0] == default.figures["100%.calls"][0] == 800
    assert default.figures["100%.timed"][0] + default.figures["100%.dropped"][0] == 800


def test_timing_check_fails_when_perfmon_time_disagrees_with_the_reference() -> None:
    """A backend whose events report double the device time makes timing_truth fail, naming the size."""
    rig = FakeRig()
    real_new = rig.backend.new_event
    made = 0

    def doubling_event() -> Any:
        # perfmon's pool is built first, so the first events are perfmon's: double what they report.
        nonlocal made
        made += 1
        ev = real_new()
        if made <= 2 * 256:
            elapsed = ev.elapsed_time
            ev.elapsed_time = lambda end: 2 * elapsed(end)  # type: ignore[method-assign]
        return ev

    rig.backend.new_event = doubling_event  # type: ignore[method-assign]
    result = gpucheck.check_timing_truth(rig, quick=True)
    assert result.verdict == "fail" and "0.05 ms off by" in result.summary


def test_checks_that_need_torch_cuda_skip_on_a_fake_rig() -> None:
    """The checks that need torch.cuda itself (overhead, agent cost, allocator, NVML, capture, roofline, occupancy,
    compile, generation) say skip rather than fail off a real GPU."""
    rig = FakeRig()
    for fn in (gpucheck.check_overhead, gpucheck.check_agent_cost, gpucheck.check_allocator, gpucheck.check_nvml,
               gpucheck.check_capture, gpucheck.check_roofline, gpucheck.check_occupancy, gpucheck.check_compile,
               gpucheck.check_generation):
        assert fn(rig).verdict == "skip"


def test_live_efficiency_reads_a_counted_model_on_the_fake_rig() -> None:
    """The roofline check's live-MFU reader, on the fake rig: it waits for the model's signature to be counted and
    returns the figures (FLOPs per call from the shapes; MFU against the configured peak)."""
    from benchmarks.gpucheck.captures import live_efficiency
    from benchmarks.gpucheck.common import quiet_monitor

    mon = quiet_monitor(FakeRig(), sample_rate=1.0, warmup_calls=0, peak_flops=1e12, peak_bandwidth=1e11)
    try:
        model = mon.wrap(torch.nn.Linear(64, 32), name="lin")
        for _ in range(4):
            model(torch.randn(16, 64))
        eff = live_efficiency(mon, "lin", timeout_seconds=30.0)
    finally:
        mon.stop()
    assert eff is not None and eff["flops_per_call"] == 2 * 16 * 64 * 32
    assert eff["mfu_ratio"] == pytest.approx(eff["flops_per_second"] / 1e12)


def _host_blocks(rng: Any, n: int, slowdown: float) -> tuple[list[float], list[float]]:
    """Paired blocks of a wandering host (each round's pace drifts ±10%, each block ±2% of its own, one in eight a
    stall of up to +30%), the second variant ``slowdown`` times the first at the same moment."""
    base, other = [], []
    for _ in range(n):
        pace = 1e-3 * rng.uniform(0.9, 1.1)
        for out, f in ((base, 1.0), (other, slowdown)):
            stall = rng.uniform(0, 0.3) if rng.random() < 0.125 else 0.0
            out.append(pace * f * rng.gauss(1.0, 0.02) * (1 + stall))
    return base, other


def test_the_quiet_block_bounds_pass_no_change_and_catch_a_real_slowdown() -> None:
    """The agent_cost check's direct-timing guard: over 120 paired slots of a host as noisy as the lent GPUs, no
    change keeps the 95% lower bound at or below x1.005 (the guard passes), a x1.03 slowdown puts it above (the
    guard fails) nine times in ten, and the interval holds the true ratio. (On such a host a ±2% 90% interval: the
    guard catches a gross miss of the modelled bound, which judges the x1.005 itself.)"""
    import random

    from benchmarks.common import quiet_ratio_bounds

    rng = random.Random(7)
    passed_null = caught = held = 0
    for seed in range(20):
        base, same = _host_blocks(rng, 120, 1.0)
        low, high = quiet_ratio_bounds(same, base, draws=400, seed=seed)
        passed_null += low <= 1.005
        held += low <= 1.0 <= high
        base, slow = _host_blocks(rng, 120, 1.03)
        caught += quiet_ratio_bounds(slow, base, draws=400, seed=seed)[0] > 1.005
    assert passed_null >= 18, passed_null  # a 5% one-sided false alarm at most, with room
    assert held >= 15, held  # a 90% interval
    assert caught >= 18, caught
    assert quiet_ratio_bounds([1.0] * 6, [1.0] * 6) == (1.0, 1.0)  # a --quick run's six blocks: an interval still
    with pytest.raises(ValueError, match="at least 2"):
        quiet_ratio_bounds([1.0], [1.0])
