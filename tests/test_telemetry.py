"""Torch allocator and NVML telemetry, on the fakes of perfmon.testing."""

from __future__ import annotations

import itertools
import os
import pickle
import stat
import threading
from pathlib import Path

import pytest
import torch

from perfmon.telemetry.nvml import STATIC_REFRESH_SECONDS, NvmlPoller
from perfmon.telemetry.pollplan import IDLE_POLL_SECONDS, lead_seconds
from perfmon.testing import DrivenPoller, FakeNvml, FakeTorchMemory

from .conftest import HandClock, promtool_check, value, wait_until

GIB = 2**30


def _families(mon) -> dict[str, list]:
    return {m.name: m.samples for m in mon.registry.collect()}


def test_fake_nvml_readings_exported_with_dcgm_labels_and_base_units(make_monitor) -> None:
    """Two fake GPUs export utilization, memory, temperature, power, energy, clocks and reasons per gpu/UUID."""
    nvml = FakeNvml()
    mon = make_monitor(nvml=nvml).start()
    g0 = {"gpu": "0", "UUID": nvml.gpus[0]["uuid"]}
    g1 = {"gpu": "1", "UUID": nvml.gpus[1]["uuid"]}
    assert value(mon, "perfmon_nvml_up") == 1
    assert value(mon, "perfmon_gpu_utilization_ratio", **g0) == 0.40
    assert value(mon, "perfmon_gpu_memory_utilization_ratio", **g1) == 0.25
    assert value(mon, "perfmon_gpu_memory_used_bytes", **g1) == 11 * GIB
    assert value(mon, "perfmon_gpu_memory_total_bytes", **g0) == 80 * GIB
    assert value(mon, "perfmon_gpu_temperature_celsius", **g1) == 56
    assert value(mon, "perfmon_gpu_power_watts", **g0) == 250.0
    assert value(mon, "perfmon_gpu_power_limit_watts", **g0) == 400.0
    assert value(mon, "perfmon_gpu_energy_joules_total", **g0) == 1_000_000.0
    assert value(mon, "perfmon_gpu_sm_clock_hertz", **g0) == 1410e6
    assert value(mon, "perfmon_gpu_sm_clock_max_hertz", **g0) == 1980e6
    assert value(mon, "perfmon_gpu_clocks_event_reasons", reason="sw_power_cap", **g1) == 1
    assert value(mon, "perfmon_gpu_clocks_event_reasons", reason="sw_power_cap", **g0) == 0
    assert value(mon, "perfmon_gpu_clocks_event_reasons", reason="hw_thermal_slowdown", **g1) == 0
    # this process's share: matched by PID, the other process's usage ignored
    assert value(mon, "perfmon_gpu_process_memory_used_bytes", **g0) == 3 * GIB
    assert value(mon, "perfmon_gpu_process_utilization_ratio", **g1) == 0.31


def test_no_nvml_library_means_up_zero_one_log_line_and_no_thread(make_monitor, capsys) -> None:
    """Without NVML: perfmon_nvml_up 0, no GPU series, one warning, no poller thread, nothing raised."""
    nvml = FakeNvml(library_missing=True)
    mon = make_monitor(nvml=nvml, log_level="warning").start()
    assert value(mon, "perfmon_nvml_up") == 0
    assert "perfmon_gpu_utilization_ratio" not in _families(mon)
    assert not any(t.name == "perfmon-nvml" for t in threading.enumerate())
    assert nvml.calls == {"nvmlInit": 1}
    assert capsys.readouterr().err.count("nvml_unavailable") == 1
    assert value(mon, "perfmon_nvml_errors_total", call="nvmlInit") is None  # absence is not an error


def test_real_pynvml_without_a_driver_degrades_quietly(make_monitor) -> None:
    """On this machine (no GPU) the real pynvml backend leaves perfmon_nvml_up at 0 and serves the rest."""
    mon = make_monitor().start()
    model = mon.wrap(torch.nn.Linear(2, 2), name="m")
    model(torch.ones(1, 2))
    if torch.cuda.is_available():  # pragma: no cover - only on a GPU machine
        pytest.skip("this check is for machines without NVML")
    assert value(mon, "perfmon_nvml_up") == 0
    assert value(mon, "perfmon_forward_calls_total", model="m") == 1


def test_unsupported_field_is_absent_only_where_unsupported(make_monitor) -> None:
    """A NotSupported field is absent for that GPU, asked only once, and other fields still update."""
    nvml = FakeNvml(unsupported={(1, "nvmlDeviceGetTotalEnergyConsumption"), "nvmlDeviceGetProcessUtilization"})
    mon = make_monitor(nvml=nvml, nvml_interval_seconds=3600).start()  # polls driven by the test
    mon.nvml_poller.poll()
    mon.nvml_poller.poll()
    assert value(mon, "perfmon_gpu_energy_joules_total", gpu="0", UUID=nvml.gpus[0]["uuid"]) is not None
    assert value(mon, "perfmon_gpu_energy_joules_total", gpu="1", UUID=nvml.gpus[1]["uuid"]) is None
    assert value(mon, "perfmon_gpu_power_watts", gpu="1", UUID=nvml.gpus[1]["uuid"]) == 260.0
    assert "perfmon_gpu_process_utilization_ratio" not in _families(mon)
    assert nvml.calls["nvmlDeviceGetProcessUtilization"] == 2  # once per GPU, never again
    assert nvml.calls["nvmlDeviceGetTotalEnergyConsumption"] == 3 + 1  # GPU 0 every poll, GPU 1 once
    assert value(mon, "perfmon_nvml_errors_total", call="nvmlDeviceGetTotalEnergyConsumption") is None


def test_failing_calls_are_counted_absent_and_recover(make_monitor) -> None:
    """A call that starts failing mid-run is counted, its series vanish (no stale value), and return on recovery."""
    nvml = FakeNvml()
    mon = make_monitor(nvml=nvml, nvml_interval_seconds=3600).start()  # polls driven by the test
    u0 = {"gpu": "0", "UUID": nvml.gpus[0]["uuid"]}
    assert value(mon, "perfmon_gpu_temperature_celsius", **u0) == 55
    nvml.failing.add("nvmlDeviceGetTemperature")
    mon.nvml_poller.poll()
    assert value(mon, "perfmon_gpu_temperature_celsius", **u0) is None
    assert value(mon, "perfmon_gpu_power_watts", **u0) == 250.0
    assert value(mon, "perfmon_nvml_errors_total", call="nvmlDeviceGetTemperature") == 2
    nvml.failing.clear()
    nvml.gpus[0]["temperature"] = 70
    mon.nvml_poller.poll()
    assert value(mon, "perfmon_gpu_temperature_celsius", **u0) == 70


def test_lost_gpu_series_disappear_and_whole_failure_sets_up_zero_then_recovers() -> None:
    """A lost GPU drops out; when NVML stops answering, up is 0 and the poller re-initialises later."""
    nvml = FakeNvml()
    poller = NvmlPoller(nvml)
    assert poller._init(first=True) and poller.poll()
    nvml.lost.add(1)
    assert poller.poll()
    assert [g.index for g in poller.snapshot().gpus] == [0]
    nvml.failing.add("nvmlDeviceGetCount")
    assert not poller.poll()
    assert poller.snapshot().up is False and poller.snapshot().gpus == []
    nvml.failing.clear()
    nvml.lost.clear()
    assert poller.poll()  # re-initialised NVML and read both GPUs again
    assert nvml.calls["nvmlInit"] == 2 and len(poller.snapshot().gpus) == 2


def test_a_poll_asks_only_what_changes_and_rereads_the_rest_on_its_own_schedule() -> None:
    """Handles and UUIDs are looked up once, the power limit and maximum clock every STATIC_REFRESH_SECONDS; a lost
    GPU is looked up again, and a re-initialised NVML starts over (its handles are new)."""
    nvml, clock = FakeNvml(), HandClock()
    poller = NvmlPoller(nvml, clock=clock)
    assert poller.poll()
    first = dict(nvml.calls)
    for _ in range(3):
        clock.t += 1.0
        assert poller.poll()
    per_poll = {k: (nvml.calls.get(k, 0) - first.get(k, 0)) / 3 for k in nvml.calls}
    for call in ("nvmlDeviceGetHandleByIndex", "nvmlDeviceGetUUID", "nvmlDeviceGetEnforcedPowerLimit",
                 "nvmlDeviceGetMaxClockInfo"):
        assert per_poll[call] == 0, call
    assert per_poll["nvmlDeviceGetCount"] == 1 and per_poll["nvmlDeviceGetPowerUsage"] == 2  # one a GPU
    assert sum(per_poll.values()) == 1 + 2 * 9
    # An operator's new power limit shows once the static fields are due again, not before.
    nvml.gpus[0]["limit_mw"] = 300_000
    clock.t += STATIC_REFRESH_SECONDS - 4.0
    assert poller.poll() and poller.snapshot().gpus[0].values["power_limit_watts"] == 400.0
    clock.t += 4.0
    assert poller.poll() and poller.snapshot().gpus[0].values["power_limit_watts"] == 300.0
    # A failing static read is absent and tried again at the next poll, not kept for a minute.
    nvml.failing.add((1, "nvmlDeviceGetMaxClockInfo"))
    clock.t += STATIC_REFRESH_SECONDS
    assert poller.poll() and "sm_clock_max_hertz" not in poller.snapshot().gpus[1].values
    nvml.failing.clear()
    clock.t += 1.0
    assert poller.poll() and poller.snapshot().gpus[1].values["sm_clock_max_hertz"] == 1980e6
    # A GPU lost with its handle kept drops out, then is looked up again once it answers.
    handles = nvml.calls["nvmlDeviceGetHandleByIndex"]
    nvml.lost.add(1)
    assert poller.poll() and [g.index for g in poller.snapshot().gpus] == [0]
    nvml.gpus[1]["limit_mw"] = 350_000  # reset while it was lost
    nvml.lost.clear()
    assert poller.poll() and [g.index for g in poller.snapshot().gpus] == [0, 1]
    assert nvml.calls["nvmlDeviceGetHandleByIndex"] == handles + 1
    assert poller.snapshot().gpus[1].values["power_limit_watts"] == 350.0  # its static fields read again at once
    # NVML failing as a whole, then re-initialised: every handle is looked up again.
    nvml.failing.add("nvmlDeviceGetCount")
    assert not poller.poll()
    nvml.failing.clear()
    assert poller.poll() and nvml.calls["nvmlDeviceGetHandleByIndex"] == handles + 3


def test_polls_follow_the_readers() -> None:
    """One poll just before each read of a steady reader, one an interval for irregular or fast readers, one a
    minute for nobody; the first read after a quiet spell brings a poll at once."""
    thread = DrivenPoller(interval_seconds=5.0)
    assert thread.polls == [0.0]  # the first poll, at start
    thread.run(300)  # nobody reads
    assert thread.polls == [0.0, 60.0, 120.0, 180.0, 240.0, 300.0]
    # A Prometheus scraping every 15 s: its first read finds the poller idle and brings a poll at once; once
    # its period shows (three reads), one poll a scrape, lead_seconds(15) before it.
    t0 = thread.t
    thread.run(300, reads=[7.0 + 15 * k for k in range(20)])
    assert thread.polls[6] == t0 + 7.0
    settled = [age for t, age in thread.ages if t >= t0 + 60]
    assert len(settled) == 16 and all(age == lead_seconds(15) == 1.5 for age in settled)
    assert thread.polls_between(t0 + 60, t0 + 300) == 16  # against 48 polls at the 5 s interval
    # A reader faster than the interval (a status page every 3 s) beside the scrapes: a poll every 5 s.
    t0 = thread.t
    reads = sorted([7.0 + 15 * k for k in range(20)] + [1.0 + 3 * k for k in range(100)])
    thread.run(300, reads=reads)
    late = [age for t, age in thread.ages if t >= t0 + 30]
    assert max(late) <= 5.0 and thread.polls_between(t0 + 30, t0 + 300) == 270 / 5
    # Two Prometheus servers (an HA pair) scraping every 15 s, 6 s apart: no steady period, a poll every 5 s.
    t0 = thread.t
    thread.run(300, reads=sorted([2.0 + 15 * k for k in range(20)] + [8.0 + 15 * k for k in range(20)]))
    assert max(age for t, age in thread.ages if t > t0 + 30) <= 5.0
    # A reader a little slower than the interval (on a poller of its own): polls stay an interval apart at least.
    slow = DrivenPoller(interval_seconds=5.0)
    slow.run(120, reads=[0.3 + 5.05 * k for k in range(24)])
    gaps = [b - a for a, b in itertools.pairwise(slow.polls)]
    assert len(gaps) >= 20 and min(gaps) >= 5.0
    # The readers stop: with no steady period, polls go on at the interval for a minute, then one a minute.
    t0 = thread.t
    thread.run(600)
    quiet = [t for t in thread.polls if t > t0 + 60]
    assert len(quiet) == 9 and all(b - a == IDLE_POLL_SECONDS for a, b in itertools.pairwise(quiet))
    # A steady but slow reader (every 40 s): still one poll a read, a second before it, and no more.
    t0 = thread.t
    thread.run(400, reads=[40.0 * k for k in range(1, 11)])
    settled = [age for t, age in thread.ages if t > t0 + 120]  # its period shows at its third read
    assert len(settled) == 7 and all(age == lead_seconds(40) for age in settled)
    assert thread.polls_between(t0 + 121, t0 + 400) == 7


def test_poll_plan_edges() -> None:
    """Readers slower than a minute still show their period; a read earlier than its reader's slack gets the reading
    before and brings a poll at once; an interval over a minute is never beaten by the idle cadence; a start whose
    first poll fails backs off from that first try."""
    for period in (90.0, 300.0):
        slow = DrivenPoller(interval_seconds=5.0)
        slow.run(12 * period, reads=[30.0 + period * k for k in range(1, 11)])
        settled = [age for t, age in slow.ages if t > 30.0 + 3 * period]
        assert len(settled) == 7 and all(age == lead_seconds(period) for age in settled), (period, slow.ages)
        assert slow.polls_between(30.0 + 3.5 * period, 30.0 + 10.5 * period) == 7
    # A 15 s reader, one of whose reads comes 2 s early (its poll is made 1.5 s before): that read gets the reading
    # of the period before; the poll follows at once, and the reads after it find fresh ones.
    jumpy = DrivenPoller(interval_seconds=5.0)
    reads = [7.0 + 15 * k for k in range(12)]
    reads[8] -= 2.0
    jumpy.run(200, reads=reads)
    ages = dict(jumpy.ages)
    assert ages[reads[8]] > 5.0 and reads[8] in jumpy.polls
    assert all(ages[t] <= 5.0 for t in reads[9:]) and all(ages[t] == 1.5 for t in reads[4:8])
    # An interval longer than the idle cadence: nobody reading still polls only every interval.
    rare = DrivenPoller(interval_seconds=120.0)
    rare.run(600)
    assert rare.polls == [0.0, 120.0, 240.0, 360.0, 480.0, 600.0]
    # NVML failing from the start: the first retry is the backoff's first step (two intervals), not an interval.
    nvml, clock = FakeNvml(), HandClock()
    nvml.failing.add("nvmlDeviceGetCount")
    poller = NvmlPoller(nvml, interval_seconds=10.0, clock=clock)
    poller.start()
    try:
        assert poller.snapshot().up is False and poller.tick() == 2 * 10.0
    finally:
        poller.stop()


def test_poller_backs_off_while_failing_and_stops_with_the_monitor(make_monitor) -> None:
    """A failing NVML is tried on the backoff, readers or not (on a hand-driven clock), and stop() joins the
    monitor's poller thread."""
    thread = DrivenPoller(interval_seconds=0.02)
    nvml, poller = thread.nvml, thread.poller
    often = [0.005 * k for k in range(1, 200)]  # a reader faster than the interval
    thread.run(0.2, reads=often[:40])
    assert nvml.calls["nvmlDeviceGetCount"] >= 9
    nvml.failing.add("nvmlDeviceGetCount")
    thread.run(0.5, reads=often[:100])  # a window in which an un-backed-off poller would fail ~25 times
    failures = nvml.calls["nvmlDeviceGetCount"]
    thread.run(0.5, reads=often[:100])
    assert nvml.calls["nvmlDeviceGetCount"] - failures <= 3
    assert poller.snapshot().up is False
    # The monitor's poller thread runs the same tick() on the real clock, and stop() joins it. Each scrape (in
    # value()) is a read, and a reader faster than the interval gets a poll an interval.
    nvml = FakeNvml()
    mon = make_monitor(nvml=nvml, nvml_interval_seconds=0.02).start()
    wait_until(lambda: nvml.calls.get("nvmlDeviceGetCount", 0) >= 5, timeout=5, what="five polls",
               between=lambda: value(mon, "perfmon_nvml_up"))
    nvml.failing.add("nvmlDeviceGetCount")
    wait_until(lambda: value(mon, "perfmon_nvml_up") == 0, timeout=5, what="a failed poll")
    mon.stop()
    assert not any(t.name == "perfmon-nvml" for t in threading.enumerate())


def test_torch_memory_metrics_join_nvml_through_uuid_under_scrambled_visible_devices(make_monitor) -> None:
    """With CUDA_VISIBLE_DEVICES=1,0 torch's cuda:0 is NVML's GPU 1: the labels say so via the UUID."""
    nvml = FakeNvml()
    bare = {i: g["uuid"].removeprefix("GPU-") for i, g in enumerate(nvml.gpus)}
    stats = {0: {"allocated_bytes.all.current": 5 * GIB, "reserved_bytes.all.current": 8 * GIB,
                 "allocated_bytes.all.peak": 6 * GIB, "reserved_bytes.all.peak": 9 * GIB,
                 "inactive_split_bytes.all.current": 2 * GIB, "num_alloc_retries": 3, "num_ooms": 1},
             1: {"allocated_bytes.all.current": GIB, "reserved_bytes.all.current": 0,
                 "allocated_bytes.all.peak": GIB, "reserved_bytes.all.peak": GIB}}
    memory = FakeTorchMemory(stats, uuids={0: bare[1], 1: bare[0]})  # scrambled
    mon = make_monitor(nvml=nvml, memory=memory).start()
    d0 = {"device": "cuda:0", "gpu": "1", "UUID": nvml.gpus[1]["uuid"]}
    d1 = {"device": "cuda:1", "gpu": "0", "UUID": nvml.gpus[0]["uuid"]}
    assert value(mon, "perfmon_torch_memory_allocated_bytes", **d0) == 5 * GIB
    assert value(mon, "perfmon_torch_memory_reserved_bytes", **d0) == 8 * GIB
    assert value(mon, "perfmon_torch_memory_peak_allocated_bytes", **d0) == 6 * GIB
    assert value(mon, "perfmon_torch_memory_peak_reserved_bytes", **d0) == 9 * GIB
    assert value(mon, "perfmon_torch_memory_fragmentation_ratio", **d0) == 0.25
    assert value(mon, "perfmon_torch_alloc_retries_total", **d0) == 3
    assert value(mon, "perfmon_torch_ooms_total", **d0) == 1
    assert value(mon, "perfmon_torch_memory_allocated_bytes", **d1) == GIB
    assert value(mon, "perfmon_torch_memory_fragmentation_ratio", **d1) == 0.0  # nothing reserved


def test_cpu_only_process_has_no_torch_memory_series(make_monitor) -> None:
    """Without CUDA there are no torch memory series at all, not zeros."""
    if torch.cuda.is_available():  # pragma: no cover
        pytest.skip("CPU-only check")
    mon = make_monitor(nvml=FakeNvml(library_missing=True)).start()
    assert not any(name.startswith("perfmon_torch_") for name in _families(mon))


def test_failing_memory_source_is_counted_not_raised(make_monitor) -> None:
    """A memory source that raises at scrape time costs its series, counted as an internal error."""
    memory = FakeTorchMemory()
    memory.stats = lambda device: 1 / 0  # type: ignore[method-assign]
    mon = make_monitor(memory=memory, nvml=FakeNvml())
    mon.start()
    fams = _families(mon)
    assert "perfmon_torch_memory_allocated_bytes" not in fams
    assert "perfmon_gpu_power_watts" in fams  # the other source still reports
    assert value(mon, "perfmon_internal_errors_total", stage="memory") >= 1


def test_oom_in_a_forward_writes_one_private_snapshot_per_cooldown(make_monitor, tmp_path: Path) -> None:
    """A CUDA OOM is counted as an error, re-raised, and leaves one 0600 allocator snapshot per cooldown."""
    memory = FakeTorchMemory()
    trace_dir = tmp_path / "traces"
    mon = make_monitor(memory=memory, nvml=FakeNvml(), oom_snapshot=True, trace_dir=str(trace_dir),
                       oom_snapshot_cooldown_seconds=3600)

    class Oom(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    model = mon.wrap(Oom(), name="big")
    for _ in range(3):
        with pytest.raises(torch.cuda.OutOfMemoryError, match="Tried to allocate"):
            model(torch.ones(1))
    mon.oom.join(5)
    files = sorted(trace_dir.iterdir())
    assert len(files) == 1 and files[0].name.endswith(".oom_snapshot.pickle")
    assert memory.snapshots == 1
    assert pickle.loads(files[0].read_bytes())["segments"][0]["total_size"] == 4 * GIB
    assert stat.S_IMODE(files[0].stat().st_mode) == 0o600
    assert stat.S_IMODE(trace_dir.stat().st_mode) == 0o700
    assert value(mon, "perfmon_forward_errors_total", model="big", exception="OutOfMemoryError") == 3
    assert value(mon, "perfmon_oom_snapshots_total") == 1
    assert not [p for p in trace_dir.iterdir() if p.name.startswith(".")]


def test_unwritable_trace_dir_costs_the_snapshot_not_the_request(make_monitor, tmp_path: Path) -> None:
    """If the snapshot cannot be written, the user's OOM still propagates and the failure is counted."""
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    mon = make_monitor(memory=FakeTorchMemory(), nvml=FakeNvml(), oom_snapshot=True,
                       trace_dir=str(blocker / "sub"))

    def oom(x: object) -> None:
        raise torch.cuda.OutOfMemoryError("oom")

    fn = mon.instrument(oom, name="f")
    with pytest.raises(torch.cuda.OutOfMemoryError):
        fn(1)
    mon.oom.join(5)
    assert value(mon, "perfmon_internal_errors_total", stage="oom_snapshot") == 1
    assert value(mon, "perfmon_oom_snapshots_total") == 0


def test_gpu_metrics_pass_promtool(make_monitor) -> None:
    """/metrics with two fake GPUs and torch memory passes `promtool check metrics`."""
    from prometheus_client import generate_latest

    mon = make_monitor(nvml=FakeNvml(), memory=FakeTorchMemory()).start()
    result = promtool_check(generate_latest(mon.registry))
    assert result.returncode == 0, result.stderr.decode() + result.stdout.decode()
    assert os.environ.get("PERFMON_NVML") is None


def test_the_allocator_series_keep_their_gpu_label_when_nvml_fails_later(make_monitor) -> None:
    """NVML failing mid-run turned the allocator series' gpu="0" into gpu="": a new series, so an OOM counted at the
    flip was invisible to increase() (PerfmonTorchOOMs) and the GPU dashboard's panels split. A GPU's NVML index is
    fixed for the process's life: once seen, it stays on the series."""
    nvml = FakeNvml(gpus=1)
    stats = {0: {"allocated_bytes.all.current": GIB, "reserved_bytes.all.current": GIB, "num_ooms": 0}}
    memory = FakeTorchMemory(stats, uuids={0: nvml.gpus[0]["uuid"].removeprefix("GPU-")})
    mon = make_monitor(nvml=nvml, memory=memory, nvml_interval_seconds=0.05).start()
    labels = {"device": "cuda:0", "gpu": "0", "UUID": nvml.gpus[0]["uuid"]}
    assert value(mon, "perfmon_torch_ooms_total", **labels) == 0
    nvml.failing = {"nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex"}
    memory.stats_by_device[0]["num_ooms"] = 1
    wait_until(lambda: value(mon, "perfmon_nvml_up") == 0, what="NVML's failure to be read")
    assert value(mon, "perfmon_torch_ooms_total", **labels) == 1
    assert value(mon, "perfmon_torch_ooms_total", **{**labels, "gpu": ""}) is None
