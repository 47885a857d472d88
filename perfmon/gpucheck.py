"""One-go real-GPU check: ``python -m perfmon.gpucheck --out DIR [--quick]`` (or ``make gpu-check``).

perfmon's CUDA promises (device time from events without a sync, host vs device split, the event pool,
graph capture skipped, allocator and NVML telemetry, captures with kernels, generation) are unit-tested
on fakes. A GPU machine is lent rarely, for minutes, so this module measures them in one run and writes
``DIR/gpucheck.md`` (a table with one verdict line per check, then the figures) and ``DIR/gpucheck.json``
(the same, every figure with its unit, plus the device, driver, CUDA, torch and perfmon versions).

Exit status: 0 every check passed or was skipped; 1 a check failed; 2 bad arguments (argparse);
3 no CUDA device (nothing is written).

Each check is a function ``(Rig) -> Check``; the runner catches its exceptions, so a failing check never
stops the others. The device work goes through a ``Rig`` (a ``CudaBackend`` plus a way to queue known
device work and to wait for the device), so the checks' logic also runs on CPU against
``perfmon.testing.FakeCuda`` (tests/test_gpucheck.py). Only the stdlib, torch, prometheus_client,
pynvml and perfmon are used; perfmon itself needs structlog (see README, "Real GPU check").

This is a measuring harness, not the agent: it calls ``torch.cuda.synchronize()`` to close its own
reference event pairs and to wait for known work, always outside the monitored calls, which are what
it checks for never syncing. Its progress and report go to the terminal with ``print`` (a command's
output, as in cli.py), not through perfmon's logs.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import gzip
import json
import math
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
from prometheus_client import CollectorRegistry

from ._version import __version__
from .clocks import CudaBackend, TorchCuda
from .monitor import Monitor

__all__ = [
    "CHECKS", "EXIT_FAILED", "EXIT_NO_GPU", "EXIT_OK", "Check", "Rig", "TorchRig", "build_report", "main",
    "run_checks",
]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_NO_GPU = 3

Verdict = Literal["pass", "fail", "skip"]
Figure = tuple[Any, str]  # (value, unit); unit "" for a count, "1" for a ratio

#: torch.cuda through ``Any``: ``_sleep``, ``Event`` and ``Stream`` carry no annotations (mypy strict).
_cuda: Any = torch.cuda


@dataclass(frozen=True)
class Check:
    """One check's outcome: a verdict, a one-line summary and its figures as ``name -> (value, unit)``."""

    name: str
    verdict: Verdict
    summary: str
    figures: dict[str, Figure] = field(default_factory=dict)
    seconds: float = 0.0  # wall time the check took (filled in by the runner)


class Rig(Protocol):
    """What the checks need of a device: perfmon's backend plus known device work and a device wait."""

    backend: CudaBackend
    #: perfmon's device label for the work (``cuda:0``).
    device: str
    #: True on a real GPU; checks that need torch's CUDA runtime itself skip otherwise.
    real: bool

    def work(self, ms: float) -> torch.nn.Module:
        """A module whose forward queues about ``ms`` milliseconds of device work and returns at once."""
        ...

    def launch_bound(self) -> torch.nn.Module:
        """A module whose forward launches many tiny kernels: the host, not the device, sets its pace."""
        ...

    def input(self) -> Any:
        """An input for the modules above."""
        ...

    def synchronize(self) -> None:
        """Wait until the device has finished everything queued (test code, never perfmon's path)."""
        ...

    def stream(self, index: int) -> contextlib.AbstractContextManager[Any]:
        """A context in which the calling thread's work goes to side stream ``index``."""
        ...

    def capture_graph(self, model: torch.nn.Module, x: Any) -> bool:
        """Capture ``model(x)`` into a CUDA graph and replay it; True when the replay matched eager."""
        ...


class _Sleeper(torch.nn.Module):
    """Queues one ``torch.cuda._sleep`` kernel of ``cycles`` GPU clock cycles."""

    def __init__(self, cycles: int) -> None:
        super().__init__()
        self.cycles = cycles

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _cuda._sleep(self.cycles)
        return x


class _Launches(torch.nn.Module):
    """``n`` tiny element-wise kernels on a small tensor: each costs the host a launch (~5 µs), the device less."""

    def __init__(self, n: int = 200) -> None:
        super().__init__()
        self.n = n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.n):
            x = x + 1
        return x


class TorchRig:
    """The real rig over ``torch.cuda`` on device 0; ``_sleep`` cycles are calibrated against events."""

    real = True

    def __init__(self) -> None:
        self.backend: CudaBackend = TorchCuda()
        self.device = "cuda:0"
        torch.cuda.set_device(0)
        self._x = torch.zeros(16, device="cuda")
        self._streams: dict[int, Any] = {}
        self.cycles_per_ms = self._calibrate()

    def _calibrate(self) -> float:
        """GPU clock cycles of ``_sleep`` per millisecond, measured on a ~10 ms kernel (after a warm-up)."""
        cycles = 10_000_000
        _cuda._sleep(cycles)
        start, end = _cuda.Event(enable_timing=True), _cuda.Event(enable_timing=True)
        start.record()
        _cuda._sleep(cycles)
        end.record()
        torch.cuda.synchronize()
        return float(cycles / max(start.elapsed_time(end), 1e-3))

    def work(self, ms: float) -> torch.nn.Module:
        return _Sleeper(max(1, int(ms * self.cycles_per_ms)))

    def launch_bound(self) -> torch.nn.Module:
        return _Launches()

    def input(self) -> Any:
        return self._x

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def stream(self, index: int) -> contextlib.AbstractContextManager[Any]:
        s = self._streams.get(index)
        if s is None:
            s = self._streams[index] = _cuda.Stream()
        return torch.cuda.stream(s)

    def capture_graph(self, model: torch.nn.Module, x: Any) -> bool:
        side = _cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on a side stream, as torch's graph docs require
            for _ in range(3):
                model(x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = model(x)
        graph.replay()
        torch.cuda.synchronize()
        return bool(torch.allclose(y, model(x)))


# -- helpers ----------------------------------------------------------------------------------------


def _monitor(rig: Rig, trace_dir: str | None = None, **settings: Any) -> Monitor:
    """A quiet monitor on the rig's backend: no HTTP, no regression detector, NVML off unless asked."""
    settings.setdefault("port", None)
    settings.setdefault("log_format", "json")
    settings.setdefault("log_level", "error")
    settings.setdefault("nvml", False)
    settings.setdefault("prepare_profiler", False)
    settings.setdefault("trace_dir", trace_dir or tempfile.mkdtemp(prefix="perfmon-gpucheck-"))
    with warnings.catch_warnings():
        # sample_rate=1.0 warns that production uses 1-5%; here timing every call is the point.
        warnings.simplefilter("ignore")
        return Monitor(registry=CollectorRegistry(), cuda=rig.backend, regression=None, **settings)


def _total(mon: Monitor, sample: str, **labels: str) -> float:
    """Sum of every sample named ``sample`` whose labels include ``labels`` (over phases, stages...)."""
    out = 0.0
    for family in mon.registry.collect():
        for s in family.samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                out += s.value
    return out


def _device_seconds(mon: Monitor, model: str) -> tuple[float, float]:
    """(sum of device seconds, count) of a model's forward histogram over every phase."""
    return (_total(mon, "perfmon_forward_duration_seconds_sum", model=model),
            _total(mon, "perfmon_forward_duration_seconds_count", model=model))


def _host_seconds(mon: Monitor, model: str) -> tuple[float, float]:
    """(sum of host seconds, count) of a model's host-time histogram over every phase."""
    return (_total(mon, "perfmon_forward_host_duration_seconds_sum", model=model),
            _total(mon, "perfmon_forward_host_duration_seconds_count", model=model))


def _ref_ms(rig: Rig, call: Callable[[], Any]) -> float:
    """Device milliseconds of ``call`` by a reference event pair around it, after a device wait."""
    stream = rig.backend.current_stream(0)
    start, end = rig.backend.new_event(), rig.backend.new_event()
    start.record(stream)
    call()
    end.record(stream)
    rig.synchronize()
    return start.elapsed_time(end)


# -- checks -----------------------------------------------------------------------------------------

TIMING_SIZES_MS = (0.05, 1.0, 20.0)


def check_timing_truth(rig: Rig, *, quick: bool = False) -> Check:
    """perfmon's device time vs a reference event pair, per kernel size (~50 µs, ~1 ms, ~20 ms).

    Pass: each size's mean error is within 10% or 10 µs. The device is kept busy while the events are
    queued, so the two pairs differ only by what runs between them on the stream (nothing, here).
    """
    reps = 5 if quick else 20
    figures: dict[str, Figure] = {}
    worst = 0.0
    bad: list[str] = []
    for ms in TIMING_SIZES_MS:
        mon = _monitor(rig, sample_rate=1.0, warmup_calls=0)
        try:
            name = f"sleep_{ms:g}ms"
            model = mon.wrap(rig.work(ms), name=name, device=rig.device)
            filler = rig.work(5.0)
            x = rig.input()
            model(x)  # the first call of a signature is cold: keep it out of the comparison
            rig.synchronize()
            mon.flush(timeout=10)
            before, n0 = _device_seconds(mon, name)
            call = functools.partial(model, x)
            truth_ms = 0.0
            for _ in range(reps):
                # A 5 ms kernel queued first keeps the device busy while the host enqueues the reference
                # and perfmon's events: they then run back to back, so host launch gaps (µs, which would
                # swamp a 50 µs kernel) fall outside both pairs.
                filler(x)
                truth_ms += _ref_ms(rig, call)
            if not mon.flush(timeout=10):
                raise RuntimeError("perfmon did not resolve its samples within 10 s")
            after, n1 = _device_seconds(mon, name)
            got_ms = (after - before) * 1e3
            if n1 - n0 != reps:
                bad.append(f"{ms:g} ms: {n1 - n0:g} of {reps} calls timed")
            err_ms = abs(got_ms - truth_ms) / reps
            rel = err_ms / max(truth_ms / reps, 1e-9)
            label = f"{ms:g}ms"
            figures[f"{label}.reference_mean"] = (truth_ms / reps * 1e3, "µs")
            figures[f"{label}.perfmon_mean"] = (got_ms / reps * 1e3, "µs")
            figures[f"{label}.error"] = (err_ms * 1e3, "µs")
            figures[f"{label}.relative_error"] = (rel, "1")
            if rel > 0.10 and err_ms > 0.010:
                bad.append(f"{ms:g} ms off by {rel:.1%}")
            worst = max(worst, rel)
        finally:
            mon.stop()
    if bad:
        return Check("timing_truth", "fail", "; ".join(bad), figures)
    return Check("timing_truth", "pass",
                 f"device time matches a reference event pair at 50 µs/1 ms/20 ms (worst {worst:.1%})", figures)


def check_host_vs_device(rig: Rig, *, quick: bool = False) -> Check:
    """Host vs device time: a launch-bound call (host ≥ device) and a device-bound one (host ≪ device).

    Pass: the launch-bound call's device time is at most 1.5 times its host time plus 50 µs, and the 20 ms
    kernel's host time is under a fifth of its device time.
    """
    reps = 5 if quick else 20
    mon = _monitor(rig, sample_rate=1.0, warmup_calls=1)
    try:
        launch = mon.wrap(rig.launch_bound(), name="launch_bound", device=rig.device)
        sleep = mon.wrap(rig.work(20.0), name="device_bound", device=rig.device)
        x = rig.input()
        for _ in range(reps + 1):
            launch(x)
            sleep(x)
            rig.synchronize()
        if not mon.flush(timeout=10):
            raise RuntimeError("perfmon did not resolve its samples within 10 s")
        lh, ln = _host_seconds(mon, "launch_bound")
        ld, _ = _device_seconds(mon, "launch_bound")
        sh, sn = _host_seconds(mon, "device_bound")
        sd, _ = _device_seconds(mon, "device_bound")
    finally:
        mon.stop()
    if not (ln and sn):
        return Check("host_vs_device", "fail", "no samples recorded")
    figures: dict[str, Figure] = {
        "launch_bound.host_mean": (lh / ln * 1e6, "µs"), "launch_bound.device_mean": (ld / ln * 1e6, "µs"),
        "device_bound.host_mean": (sh / sn * 1e6, "µs"), "device_bound.device_mean": (sd / sn * 1e6, "µs"),
    }
    ok = ld <= 1.5 * lh + 50e-6 * ln and sh < sd / 5
    summary = (f"launch-bound host {lh / ln * 1e6:.0f} µs vs device {ld / ln * 1e6:.0f} µs; "
               f"20 ms kernel host {sh / sn * 1e6:.0f} µs vs device {sd / sn * 1e3:.1f} ms")
    return Check("host_vs_device", "pass" if ok else "fail", summary, figures)


def check_no_sync(rig: Rig, *, quick: bool = False) -> Check:
    """A call queuing ~100 ms of device work returns to the caller in far less at 100% sampling.

    Pass: host return time under a fifth of the reference device time, and perfmon's device time
    within 10% of it.
    """
    mon = _monitor(rig, sample_rate=1.0, warmup_calls=1)
    try:
        model = mon.wrap(rig.work(100.0), name="no_sync", device=rig.device)
        x = rig.input()
        model(x)  # cold
        rig.synchronize()
        mon.flush(timeout=10)
        before, _ = _device_seconds(mon, "no_sync")
        host: list[float] = []

        def call() -> None:
            t0 = time.perf_counter()
            model(x)
            host.append(time.perf_counter() - t0)

        truth = _ref_ms(rig, call) / 1e3
        if not mon.flush(timeout=10):
            raise RuntimeError("perfmon did not resolve its samples within 10 s")
        device = _device_seconds(mon, "no_sync")[0] - before
    finally:
        mon.stop()
    figures: dict[str, Figure] = {"host_return": (host[0] * 1e3, "ms"), "reference_device": (truth * 1e3, "ms"),
                                  "perfmon_device": (device * 1e3, "ms")}
    ok = host[0] < truth / 5 and math.isclose(device, truth, rel_tol=0.10)
    return Check("no_sync", "pass" if ok else "fail",
                 f"returned in {host[0] * 1e3:.2f} ms for {truth * 1e3:.1f} ms of device work "
                 f"(perfmon: {device * 1e3:.1f} ms)", figures)


def check_event_pool(rig: Rig, *, quick: bool = False) -> Check:
    """Many threads on several streams through a small event pool: drops counted, every pair returned.

    Pass: every call counted, timed + dropped(pool_exhausted) == calls, and the pool is full again.
    """
    threads, streams, per_thread = 8, 3, (50 if quick else 200)
    mon = _monitor(rig, sample_rate=1.0, warmup_calls=0, event_pool_size=16)
    errors: list[BaseException] = []
    try:
        model = mon.wrap(rig.work(0.05), name="pool", device=rig.device)
        x = rig.input()
        go = threading.Barrier(threads)

        def run(i: int) -> None:
            try:
                go.wait(timeout=30)
                with rig.stream(i % streams):
                    for _ in range(per_thread):
                        model(x)
            except BaseException as exc:  # reported below; a thread must not die silently
                errors.append(exc)

        pool = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join(timeout=120)
        rig.synchronize()
        resolved = mon.flush(timeout=10)
        calls = _total(mon, "perfmon_forward_calls_total", model="pool")
        timed = _device_seconds(mon, "pool")[1]
        dropped = _total(mon, "perfmon_samples_dropped_total", model="pool", reason="pool_exhausted")
        # The pools are internal; "in flight" after the drain is the leak this check looks for.
        in_flight = mon._hub.pools.in_flight()
    finally:
        mon.stop()
    want = threads * per_thread
    figures: dict[str, Figure] = {"calls": (calls, ""), "timed": (timed, ""), "dropped_pool_exhausted": (dropped, ""),
                                  "pairs_in_flight_after": (in_flight, ""), "threads": (threads, ""),
                                  "streams": (streams, "")}
    ok = not errors and resolved and calls == want and timed + dropped == want and in_flight == 0
    summary = (f"{want} calls from {threads} threads on {streams} streams: {timed:g} timed, {dropped:g} dropped, "
               f"{in_flight} pairs still in flight" + (f"; {errors[0]!r}" if errors else ""))
    return Check("event_pool", "pass" if ok else "fail", summary, figures)


def check_graph_capture(rig: Rig, *, quick: bool = False) -> Check:
    """Capturing a CUDA graph through a wrapped model works; its sample is dropped as graph_capture."""
    mon = _monitor(rig, sample_rate=1.0, warmup_calls=0)
    try:
        if rig.real:
            base: torch.nn.Module = torch.nn.Linear(16, 16).cuda()
            x: Any = torch.randn(4, 16, device="cuda")
        else:
            base, x = rig.work(0.1), rig.input()
        model = mon.wrap(base, name="graph", device=rig.device)
        same = rig.capture_graph(model, x)
        dropped = _total(mon, "perfmon_samples_dropped_total", model="graph", reason="graph_capture")
    finally:
        mon.stop()
    ok = same and dropped >= 1
    return Check("graph_capture", "pass" if ok else "fail",
                 f"graph replay {'matches' if same else 'DIFFERS from'} eager; {dropped:g} sample(s) dropped "
                 "as graph_capture", {"dropped_graph_capture": (dropped, "")})


def check_overhead(rig: Rig, *, quick: bool = False) -> Check:
    """perfmon's cost on a small half-precision Transformer forward at 1% and 100% sampling.

    Bare and wrapped copies run interleaved (round-robin, ``n`` calls each, synchronized per block); the
    figure is the median block time's ratio to bare. Pass: ≤ 1.03 at 1%, ≤ 1.10 at 100%.
    """
    if not rig.real:
        return Check("overhead", "skip", "needs a real GPU")
    dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    layer = torch.nn.TransformerEncoderLayer(d_model=512, nhead=8, dim_feedforward=2048, batch_first=True)
    bare = torch.nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False).to("cuda", dtype).eval()
    x = torch.randn(8, 128, 512, device="cuda", dtype=dtype)
    monitors = {rate: _monitor(rig, sample_rate=rate, warmup_calls=3) for rate in (0.01, 1.0)}
    try:
        variants: dict[str, torch.nn.Module] = {"bare": bare}
        for rate, mon in monitors.items():
            variants[f"{rate:.0%}"] = mon.wrap(copy.deepcopy(bare), name=f"enc_{rate:g}", device="cuda:0")
        rounds, n = (5, 20) if quick else (15, 50)
        times: dict[str, list[float]] = {k: [] for k in variants}
        with torch.inference_mode():
            for m in variants.values():  # warm-up: cuBLAS handles, kernels selected
                for _ in range(5):
                    m(x)
            torch.cuda.synchronize()
            for _ in range(rounds):
                for key, m in variants.items():
                    t0 = time.perf_counter()
                    for _ in range(n):
                        m(x)
                    torch.cuda.synchronize()
                    times[key].append((time.perf_counter() - t0) / n)
    finally:
        for mon in monitors.values():
            mon.stop()
    med = {k: statistics.median(v) for k, v in times.items()}
    r1, r100 = med["1%"] / med["bare"], med["100%"] / med["bare"]
    figures: dict[str, Figure] = {"bare_per_call": (med["bare"] * 1e3, "ms"), "ratio_1pct": (r1, "1"),
                                  "ratio_100pct": (r100, "1"), "dtype": (str(dtype).removeprefix("torch."), "")}
    ok = r1 <= 1.03 and r100 <= 1.10
    return Check("overhead", "pass" if ok else "fail",
                 f"{med['bare'] * 1e3:.2f} ms/call bare; x{r1:.3f} at 1%, x{r100:.3f} at 100%", figures)


def check_allocator(rig: Rig, *, quick: bool = False) -> Check:
    """perfmon's allocator gauges vs ``torch.cuda.memory_stats()`` after allocating 256 MiB.

    Pass: allocated and reserved bytes equal torch's to within 1 MiB (nothing else allocates between).
    """
    if not rig.real:
        return Check("allocator", "skip", "needs a real GPU")
    mon = _monitor(rig)
    try:
        block = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
        got_alloc = _total(mon, "perfmon_torch_memory_allocated_bytes", device="cuda:0")
        got_res = _total(mon, "perfmon_torch_memory_reserved_bytes", device="cuda:0")
        stats = torch.cuda.memory_stats(0)
        del block
    finally:
        mon.stop()
    want_alloc, want_res = stats["allocated_bytes.all.current"], stats["reserved_bytes.all.current"]
    figures: dict[str, Figure] = {"perfmon_allocated": (got_alloc, "bytes"), "torch_allocated": (want_alloc, "bytes"),
                                  "perfmon_reserved": (got_res, "bytes"), "torch_reserved": (want_res, "bytes")}
    ok = abs(got_alloc - want_alloc) <= 2**20 and abs(got_res - want_res) <= 2**20 and got_alloc >= 256 * 2**20
    return Check("allocator", "pass" if ok else "fail",
                 f"allocated {got_alloc / 2**20:.0f} MiB (torch {want_alloc / 2**20:.0f}), "
                 f"reserved {got_res / 2**20:.0f} MiB (torch {want_res / 2**20:.0f})", figures)


def _smi(field_: str) -> list[str] | None:
    """``nvidia-smi --query-gpu=FIELD`` per GPU, or None without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", f"--query-gpu={field_}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    return [line.strip() for line in out.splitlines() if line.strip()]


def check_nvml(rig: Rig, *, quick: bool = False) -> Check:
    """``perfmon_nvml_up`` is 1; total memory and power limit per GPU agree with ``nvidia-smi``.

    Pass: up, and (where nvidia-smi exists) each GPU's total memory within 1% and power limit within 1 W.
    """
    if not rig.real:
        return Check("nvml", "skip", "needs a real GPU")
    mon = _monitor(rig, nvml=True)
    figures: dict[str, Figure] = {}
    bad: list[str] = []
    try:
        poller = mon._nvml  # one poll now rather than waiting for the poller's interval
        if poller is not None:
            poller.poll()
        up = _total(mon, "perfmon_nvml_up")
        smi_uuid, smi_mem, smi_power = _smi("uuid"), _smi("memory.total"), _smi("power.limit")
        figures["nvml_up"] = (up, "")
        if smi_uuid and smi_mem:
            for i, (uuid, mib) in enumerate(zip(smi_uuid, smi_mem, strict=False)):
                got = _total(mon, "perfmon_gpu_memory_total_bytes", gpu=str(i), UUID=uuid)
                figures[f"gpu{i}.memory_total_perfmon"] = (got, "bytes")
                figures[f"gpu{i}.memory_total_smi"] = (float(mib) * 2**20, "bytes")
                if not math.isclose(got, float(mib) * 2**20, rel_tol=0.01):
                    bad.append(f"GPU {i} memory {got:g} B vs nvidia-smi {mib} MiB")
                if smi_power and i < len(smi_power) and smi_power[i].replace(".", "", 1).isdigit():
                    watts = _total(mon, "perfmon_gpu_power_limit_watts", gpu=str(i))
                    figures[f"gpu{i}.power_limit_perfmon"] = (watts, "W")
                    figures[f"gpu{i}.power_limit_smi"] = (float(smi_power[i]), "W")
                    if abs(watts - float(smi_power[i])) > 1.0:
                        bad.append(f"GPU {i} power limit {watts:g} W vs nvidia-smi {smi_power[i]} W")
    finally:
        mon.stop()
    if up != 1:
        return Check("nvml", "fail", f"perfmon_nvml_up is {up:g}", figures)
    if bad:
        return Check("nvml", "fail", "; ".join(bad), figures)
    tail = "agrees with nvidia-smi" if smi_uuid else "nvidia-smi not installed: not compared"
    return Check("nvml", "pass", f"perfmon_nvml_up 1; {tail}", figures)


_KERNEL = re.compile(rb'"cat"\s*:\s*"kernel"')


def check_capture(rig: Rig, *, quick: bool = False) -> Check:
    """A manual capture of a CUDA model: outcome ok and the stored trace holds CUDA kernel events."""
    if not rig.real:
        return Check("capture", "skip", "needs a real GPU")
    with tempfile.TemporaryDirectory(prefix="perfmon-gpucheck-") as tmp:
        mon = _monitor(rig, trace_dir=tmp)
        try:
            mlp = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
            model = mon.wrap(mlp.cuda(), name="mlp")
            x = torch.randn(32, 256, device="cuda")
            model(x)
            cap = mon.capture("mlp", steps=3, max_seconds=10.0)
            deadline = time.monotonic() + 60
            meta: dict[str, Any] | None = None
            while time.monotonic() < deadline:
                model(x)  # the capture records the model's next calls on this thread
                meta = mon.profile(cap["id"])
                if meta is not None and meta.get("outcome"):
                    break
                time.sleep(0.01)  # the export runs in a child process: poll, bounded by the deadline
            outcome = None if meta is None else meta.get("outcome")
            trace = mon.traces.read_trace(cap["id"]) if outcome == "ok" else None
        finally:
            mon.stop()
    kernels = len(_KERNEL.findall(gzip.decompress(trace[1]))) if trace else 0
    figures: dict[str, Figure] = {"kernel_events": (kernels, ""), "trace_bytes_gz": (len(trace[1]) if trace else 0,
                                                                                      "bytes")}
    ok = outcome == "ok" and kernels > 0
    return Check("capture", "pass" if ok else "fail",
                 f"capture outcome {outcome!r}; {kernels} CUDA kernel events in the trace", figures)


def check_generation(rig: Rig, *, quick: bool = False) -> Check:
    """A tiny random GPT-2's ``generate()`` on the GPU: prefill/decode forwards and TTFT/ITL counts.

    Pass: per generate of ``new`` tokens for ``batch`` sequences, 1 prefill and new-1 decode forwards,
    ``batch`` TTFT and ``batch * (new - 1)`` ITL observations.
    """
    if not rig.real:
        return Check("generation", "skip", "needs a real GPU")
    try:
        import transformers
    except ImportError:
        return Check("generation", "skip", "transformers is not installed")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=101, n_positions=64,
                                  bos_token_id=100, eos_token_id=100, pad_token_id=100)
    mon = _monitor(rig, sample_rate=1.0)
    batch, prompt, new, runs = 2, 5, 6, 3
    try:
        gpt2: Any = transformers.GPT2LMHeadModel(cfg)
        model = mon.wrap(gpt2.eval().cuda(), name="gpt2")
        ids = torch.randint(0, 100, (batch, prompt), device="cuda")
        with torch.inference_mode():
            for _ in range(runs):
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                               do_sample=False)
        torch.cuda.synchronize()
        mon.flush(timeout=10)
        prefill = _total(mon, "perfmon_forward_calls_total", model="gpt2", stage="prefill")
        decode = _total(mon, "perfmon_forward_calls_total", model="gpt2", stage="decode")
        ttft = _total(mon, "perfmon_time_to_first_token_seconds_count", model="gpt2")
        itl = _total(mon, "perfmon_inter_token_latency_seconds_count", model="gpt2")
        ttft_sum = _total(mon, "perfmon_time_to_first_token_seconds_sum", model="gpt2")
        dev_prefill = _total(mon, "perfmon_forward_duration_seconds_sum", model="gpt2", stage="prefill")
    finally:
        mon.stop()
    figures: dict[str, Figure] = {
        "prefill_calls": (prefill, ""), "decode_calls": (decode, ""), "ttft_count": (ttft, ""),
        "itl_count": (itl, ""), "ttft_mean_host": (ttft_sum / ttft * 1e3 if ttft else None, "ms"),
        "prefill_mean_device": (dev_prefill / prefill * 1e3 if prefill else None, "ms"),
    }
    want = (runs, runs * (new - 1), runs * batch, runs * batch * (new - 1))
    ok = (prefill, decode, ttft, itl) == want
    return Check("generation", "pass" if ok else "fail",
                 f"prefill {prefill:g}/{want[0]}, decode {decode:g}/{want[1]}, TTFT {ttft:g}/{want[2]}, "
                 f"ITL {itl:g}/{want[3]}", figures)


CheckFn = Callable[..., Check]

#: Every check, timing first; each takes ``(rig, quick=...)``.
CHECKS: tuple[tuple[str, CheckFn], ...] = (
    ("timing_truth", check_timing_truth),
    ("host_vs_device", check_host_vs_device),
    ("no_sync", check_no_sync),
    ("overhead", check_overhead),
    ("event_pool", check_event_pool),
    ("graph_capture", check_graph_capture),
    ("allocator", check_allocator),
    ("nvml", check_nvml),
    ("capture", check_capture),
    ("generation", check_generation),
)


def run_checks(checks: Sequence[tuple[str, CheckFn]], rig: Rig, *, quick: bool = False,
               progress: Callable[[str], None] | None = None) -> list[Check]:
    """Run each check; an exception becomes that check's ``fail`` (never stops the others)."""
    out: list[Check] = []
    for name, fn in checks:
        t0 = time.perf_counter()
        try:
            result = fn(rig, quick=quick)
        except Exception as exc:
            result = Check(name, "fail", f"raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                           [:300])
        result = Check(result.name, result.verdict, result.summary, result.figures,
                       seconds=time.perf_counter() - t0)
        out.append(result)
        if progress is not None:
            progress(f"{result.verdict.upper():4} {name} ({result.seconds:.1f} s): {result.summary}")
    return out


# -- report -----------------------------------------------------------------------------------------


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "—" if value is None else str(value)


def _cell(text: str) -> str:
    """Markdown table cell text: pipes escaped, one line."""
    return text.replace("|", "\\|").replace("\n", " ")


def build_report(checks: Sequence[Check], env: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """(Markdown, JSON-ready dict) for ``checks`` run on ``env`` (device, driver, versions). Pure."""
    counts = {v: sum(c.verdict == v for c in checks) for v in ("pass", "fail", "skip")}
    overall = "fail" if counts["fail"] else "pass"
    data: dict[str, Any] = {
        "env": dict(env),
        "verdict": overall,
        "counts": counts,
        "checks": [{"name": c.name, "verdict": c.verdict, "summary": c.summary, "seconds": c.seconds,
                    "figures": {k: {"value": v, "unit": u} for k, (v, u) in c.figures.items()}} for c in checks],
    }
    lines = ["# perfmon real-GPU check", ""]
    lines += [f"- {k}: {_cell(str(v))}" for k, v in env.items()]
    lines += ["", f"**Overall: {overall}** — {counts['pass']} passed, {counts['fail']} failed, "
              f"{counts['skip']} skipped.", "", "| check | verdict | summary |", "| --- | --- | --- |"]
    lines += [f"| {c.name} | {c.verdict} | {_cell(c.summary)} |" for c in checks]
    lines += ["", "## Figures", ""]
    for c in checks:
        if not c.figures:
            continue
        lines += [f"### {c.name}", "", "| figure | value | unit |", "| --- | --- | --- |"]
        lines += [f"| {k} | {_fmt(v)} | {u} |" for k, (v, u) in c.figures.items()]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n", data


def environment() -> dict[str, Any]:
    """Device name, driver, CUDA and library versions (what each figure was taken on)."""
    env: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "driver": None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "perfmon": __version__,
        "python": platform.python_version(),
        "taken_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    with contextlib.suppress(Exception):
        import pynvml

        pynvml.nvmlInit()
        try:
            driver = pynvml.nvmlSystemGetDriverVersion()
            env["driver"] = driver.decode() if isinstance(driver, bytes) else str(driver)
        finally:
            pynvml.nvmlShutdown()
    return env


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the checks and write the report; returns the exit status (module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m perfmon.gpucheck", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for gpucheck.md and gpucheck.json")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (about a minute)")
    parser.add_argument("--only", default="", help="comma-separated check names (default: all)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("perfmon.gpucheck needs a CUDA GPU (torch.cuda.is_available() is False); nothing was run",
              file=sys.stderr)
        return EXIT_NO_GPU
    wanted = {n.strip() for n in args.only.split(",") if n.strip()}
    unknown = wanted - {n for n, _ in CHECKS}
    if unknown:
        parser.error(f"unknown checks: {sorted(unknown)}")
    checks = [(n, f) for n, f in CHECKS if not wanted or n in wanted]
    results = run_checks(checks, TorchRig(), quick=args.quick, progress=_say)
    markdown, data = build_report(results, {**environment(), "quick": args.quick})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpucheck.md").write_text(markdown, encoding="utf-8")
    (out / "gpucheck.json").write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(markdown)
    return EXIT_FAILED if data["verdict"] == "fail" else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
