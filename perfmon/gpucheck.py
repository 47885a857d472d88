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
from .agent.clocks import CudaBackend, TorchCuda
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


def check_event_pool_default(rig: Rig, *, quick: bool = False) -> Check:
    """The default pool (256 pairs) at 1% and at 100% sampling under 8 threads: what fraction of samples drops.

    Pass: every call counted and every sample either timed or counted dropped; nothing left in flight.
    A figure, not a gate: the drop fraction at 100% (the pool is sized for production's 1-5%).
    """
    threads, streams, per_thread = 8, 3, (100 if quick else 500)
    figures: dict[str, Figure] = {}
    bad: list[str] = []
    for rate in (0.01, 1.0):
        mon = _monitor(rig, sample_rate=rate, warmup_calls=0)
        try:
            model = mon.wrap(rig.work(0.05), name="pool", device=rig.device)
            x = rig.input()

            def run(i: int, model: Any = model, x: Any = x) -> None:
                with rig.stream(i % streams):
                    for _ in range(per_thread):
                        model(x)

            pool = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(threads)]
            t0 = time.perf_counter()
            for t in pool:
                t.start()
            for t in pool:
                t.join(timeout=120)
            wall = time.perf_counter() - t0
            rig.synchronize()
            mon.flush(timeout=10)
            calls = _total(mon, "perfmon_forward_calls_total", model="pool")
            timed = _device_seconds(mon, "pool")[1]
            dropped = _total(mon, "perfmon_samples_dropped_total", model="pool")
            in_flight = mon._hub.pools.in_flight()
        finally:
            mon.stop()
        tag = f"{rate:.0%}"
        figures[f"{tag}.calls"] = (calls, "")
        figures[f"{tag}.timed"] = (timed, "")
        figures[f"{tag}.dropped"] = (dropped, "")
        figures[f"{tag}.calls_per_second"] = (calls / wall if wall else None, "1/s")
        if calls != threads * per_thread or in_flight:
            bad.append(f"{tag}: {calls:g} calls counted of {threads * per_thread}, {in_flight} pairs in flight")
    drop = figures["100%.dropped"][0]
    frac = drop / (drop + figures["100%.timed"][0]) if drop else 0.0  # type: ignore[operator]
    figures["100%.drop_fraction"] = (frac, "1")
    return Check("event_pool_default", "fail" if bad else "pass",
                 "; ".join(bad) or (f"1%: {figures['1%.timed'][0]:g} timed, {figures['1%.dropped'][0]:g} dropped; "
                                    f"100%: {frac:.0%} of samples dropped at "
                                    f"{_fmt(figures['100%.calls_per_second'][0])} calls/s"), figures)


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

    One module, so memory placement cannot differ between variants: each block of ``n`` calls runs it
    bare, or wrapped by the 1% or the 100% monitor (``wrap``/``unwrap`` between blocks), synchronized per
    block, in a shuffled order every round. The figure is the median over rounds of each round's ratio
    to that round's bare block, so drifting clocks cancel. Pass: ≤ 1.03 at 1%, ≤ 1.10 at 100%.
    """
    if not rig.real:
        return Check("overhead", "skip", "needs a real GPU")
    import random

    dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    layer = torch.nn.TransformerEncoderLayer(d_model=512, nhead=8, dim_feedforward=2048, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False).to("cuda", dtype).eval()
    x = torch.randn(8, 128, 512, device="cuda", dtype=dtype)
    monitors = {f"{rate:.0%}": _monitor(rig, sample_rate=rate, warmup_calls=3) for rate in (0.01, 1.0)}
    rounds, n = (8, 20) if quick else (60, 40)
    # "bare again" is the same bare module in its own slot: its ratio to "bare" is the noise floor.
    times: dict[str, list[float]] = {"bare": [], "bare again": [], **{k: [] for k in monitors}}
    order = list(times)
    shuffle = random.Random(0).shuffle

    def block(key: str) -> float:
        wrapped = monitors[key].wrap(model, name=f"enc_{key}", device="cuda:0") if key in monitors else model
        try:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                wrapped(x)
            torch.cuda.synchronize()
            return (time.perf_counter() - t0) / n
        finally:
            if key in monitors:
                monitors[key].unwrap(wrapped)

    try:
        with torch.inference_mode():
            for key in order:  # warm-up: cuBLAS handles, kernels selected, each monitor's cold calls
                block(key)
            for _ in range(rounds):
                shuffle(order)
                for key in order:
                    times[key].append(block(key))
    finally:
        for mon in monitors.values():
            mon.stop()
    others = [k for k in times if k != "bare"]
    ratio = {k: statistics.median(t / b for t, b in zip(times[k], times["bare"], strict=True)) for k in others}
    bare = statistics.median(times["bare"])
    added = {k: statistics.median(t - b for t, b in zip(times[k], times["bare"], strict=True)) for k in others}
    r1, r100 = ratio["1%"], ratio["100%"]
    figures: dict[str, Figure] = {"bare_per_call": (bare * 1e3, "ms"), "ratio_1pct": (r1, "1"),
                                  "ratio_100pct": (r100, "1"), "added_1pct": (added["1%"] * 1e6, "µs"),
                                  "added_100pct": (added["100%"] * 1e6, "µs"),
                                  "ratio_bare_again": (ratio["bare again"], "1"),
                                  "added_bare_again": (added["bare again"] * 1e6, "µs"), "rounds": (rounds, ""),
                                  "calls_per_block": (n, ""), "dtype": (str(dtype).removeprefix("torch."), "")}
    ok = r1 <= 1.03 and r100 <= 1.10
    return Check("overhead", "pass" if ok else "fail",
                 f"{bare * 1e3:.2f} ms/call bare; x{r1:.3f} ({added['1%'] * 1e6:+.1f} µs) at 1%, "
                 f"x{r100:.3f} ({added['100%'] * 1e6:+.1f} µs) at 100%; bare vs bare x{ratio['bare again']:.3f} "
                 f"({added['bare again'] * 1e6:+.1f} µs, the noise floor)", figures)


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
        bad += _process_share(mon, poller, figures)
    finally:
        mon.stop()
    if up != 1:
        return Check("nvml", "fail", f"perfmon_nvml_up is {up:g}", figures)
    if bad:
        return Check("nvml", "fail", "; ".join(bad), figures)
    tail = "agrees with nvidia-smi" if smi_uuid else "nvidia-smi not installed: not compared"
    share = figures.get("process_visible", (None, ""))[0]
    tail += ("; this process's memory and SM share read" if share == "yes" else
             "; this process is not in NVML's process list (PID namespace): its share is absent, as documented")
    return Check("nvml", "pass", f"perfmon_nvml_up 1; {tail}", figures)


def _smi_apps() -> dict[int, float] | None:
    """``nvidia-smi --query-compute-apps``: MiB used per PID, or None without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    apps: dict[int, float] = {}
    for line in out.splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip().isdigit() and mib.strip().replace(".", "", 1).isdigit():
            apps[int(pid)] = float(mib)
    return apps


def _process_share(mon: Monitor, poller: Any, figures: dict[str, Figure]) -> list[str]:
    """Hold 1 GiB and keep the SMs busy for about a second; compare this process's series with nvidia-smi.

    NVML reports host PIDs: in a container with its own PID namespace neither nvidia-smi nor perfmon finds
    this process, and perfmon leaves the series absent rather than guessing (not a failure).
    """
    import os

    bad: list[str] = []
    block = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    t_end = time.monotonic() + 1.5
    while time.monotonic() < t_end:  # about 1.5 s of matmuls, so NVML has utilization samples of ours
        for _ in range(20):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()
    if poller is not None:
        poller.poll()
    apps = _smi_apps()
    mem = _total(mon, "perfmon_gpu_process_memory_used_bytes", gpu="0")
    present = any(s.name == "perfmon_gpu_process_memory_used_bytes" for f in mon.registry.collect()
                  for s in f.samples)
    util = _total(mon, "perfmon_gpu_process_utilization_ratio", gpu="0")
    gpu_util = _total(mon, "perfmon_gpu_utilization_ratio", gpu="0")
    smi_mib = None if apps is None else apps.get(os.getpid())
    figures["process_visible"] = ("yes" if present else "no", "")
    figures["process_memory_perfmon"] = (mem if present else None, "bytes")
    figures["process_memory_smi"] = (None if smi_mib is None else smi_mib * 2**20, "bytes")
    figures["process_memory_torch_reserved"] = (float(torch.cuda.memory_reserved(0)), "bytes")
    figures["process_sm_utilization"] = (util, "ratio")
    figures["gpu_utilization"] = (gpu_util, "ratio")
    figures["smi_compute_apps"] = (None if apps is None else len(apps), "")
    if smi_mib is not None and not present:
        bad.append(f"nvidia-smi lists this process ({smi_mib:g} MiB) but perfmon has no process series")
    if smi_mib is not None and present and not math.isclose(mem, smi_mib * 2**20, rel_tol=0.02, abs_tol=2**21):
        bad.append(f"process memory {mem / 2**20:.0f} MiB vs nvidia-smi {smi_mib:g} MiB")
    if present and mem < 2**30:
        bad.append(f"process memory {mem / 2**20:.0f} MiB while holding 1 GiB")
    del block, a
    return bad


_KERNEL = re.compile(rb'"cat"\s*:\s*"kernel"')


def _capture_calls(mon: Monitor, name: str, call: Callable[[], Any], *, steps: int) -> dict[str, Any] | None:
    """A manual capture of ``steps`` calls of model ``name``, made by ``call`` on this thread; its metadata."""
    cap = mon.capture(name, steps=steps, max_seconds=10.0)
    deadline = time.monotonic() + 90
    meta: dict[str, Any] | None = None
    while time.monotonic() < deadline:
        for _ in range(steps):  # back to back: the capture records the model's next calls on this thread
            call()
        meta = mon.profile(cap["id"])
        if meta is not None and meta.get("outcome"):
            return meta
        time.sleep(0.01)  # the export runs in a child process: poll, bounded by the deadline
    return meta


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
            meta = _capture_calls(mon, "mlp", lambda: model(x), steps=3)
            outcome = None if meta is None else meta.get("outcome")
            trace = mon.traces.read_trace(meta["id"]) if meta is not None and outcome == "ok" else None
        finally:
            mon.stop()
    kernels = len(_KERNEL.findall(gzip.decompress(trace[1]))) if trace else 0
    figures: dict[str, Figure] = {"kernel_events": (kernels, ""), "trace_bytes_gz": (len(trace[1]) if trace else 0,
                                                                                      "bytes")}
    try:
        import hta  # type: ignore[import-not-found]  # noqa: F401  # Holistic Trace Analysis, optional
        hta_note = "; HTA installed but not exercised"
    except ImportError:
        hta_note = "; Holistic Trace Analysis not installed: not loaded there"
    ok = outcome == "ok" and kernels > 0
    return Check("capture", "pass" if ok else "fail",
                 f"capture outcome {outcome!r}; {kernels} CUDA kernel events in the trace{hta_note}", figures)


def check_roofline(rig: Rig, *, quick: bool = False) -> Check:
    """A capture of back-to-back large bf16 matmuls: the matmul's verdict and the capture's MFU.

    Pass: the matmul op is ``compute-bound``, the capture has a peak from perfmon's table (named in the
    figures), and its MFU agrees within 25% with one computed here from event-timed device time (the
    capture's window also holds host gaps, so it may read lower, never above 1).
    """
    if not rig.real:
        return Check("roofline", "skip", "needs a real GPU")
    n = 4096 if quick else 8192
    with tempfile.TemporaryDirectory(prefix="perfmon-gpucheck-") as tmp:
        mon = _monitor(rig, trace_dir=tmp, sample_rate=1.0, warmup_calls=0)
        try:
            class MatMuls(torch.nn.Module):
                def __init__(self) -> None:
                    super().__init__()
                    self.w = torch.nn.Parameter(torch.randn(n, n, device="cuda", dtype=torch.bfloat16) / n ** 0.5,
                                                requires_grad=False)

                def forward(self, x: torch.Tensor) -> torch.Tensor:
                    for _ in range(4):
                        x = x @ self.w
                    return x

            model = mon.wrap(MatMuls(), name="matmul")
            x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
            ref = min(_ref_ms(rig, lambda: model(x)) for _ in range(5))  # warm (cuBLAS heuristics) and timed
            meta = _capture_calls(mon, "matmul", lambda: model(x), steps=5)
            rig.synchronize()
        finally:
            mon.stop()
    summary = (meta or {}).get("summary") or []
    compute = (meta or {}).get("compute") or {}
    mm = next((r for r in summary if r.get("name") in ("aten::mm", "aten::matmul", "aten::addmm")), None)
    flops_per_call = 4 * 2 * n ** 3
    peak = compute.get("peak_flops_per_second")
    events_mfu = flops_per_call / (ref / 1e3) / peak if peak else None
    capture_mfu = compute.get("mfu_ratio")
    figures: dict[str, Figure] = {
        "n": (n, ""), "matmul_bound": (None if mm is None else mm.get("bound"), ""),
        "matmul_achieved": (None if mm is None else mm.get("achieved_flops_per_second"), "FLOP/s"),
        "events_achieved": (flops_per_call / (ref / 1e3), "FLOP/s"), "peak": (peak, "FLOP/s"),
        "peak_source": (compute.get("peak_source"), ""), "mfu_capture": (capture_mfu, "1"),
        "mfu_events": (events_mfu, "1"), "outcome": ((meta or {}).get("outcome"), ""),
    }
    op_rate = None if mm is None else mm.get("achieved_flops_per_second")
    # The op's own rate (its kernels' time) must match event timing; the window MFU also counts the
    # profiler's start and stop and any host gap, so it may only read lower.
    ok = (mm is not None and mm.get("bound") == "compute-bound" and peak is not None and capture_mfu is not None
          and events_mfu is not None and op_rate is not None
          and math.isclose(op_rate, flops_per_call / (ref / 1e3), rel_tol=0.15)
          and 0 < capture_mfu <= min(events_mfu, 1.0) * 1.05)
    if mm is None:
        return Check("roofline", "fail", f"no matmul row in the capture's summary (outcome "
                                         f"{(meta or {}).get('outcome')!r})", figures)
    return Check("roofline", "pass" if ok else "fail",
                 f"{n}^3 bf16 matmul {mm.get('bound')} at {_fmt(op_rate and op_rate / 1e12)} TFLOP/s in the "
                 f"capture, {_fmt(flops_per_call / (ref / 1e3) / 1e12)} by events; window MFU {_fmt(capture_mfu)}, "
                 f"{_fmt(events_mfu)} by events, against {compute.get('peak_source')} peak "
                 f"{_fmt(peak and peak / 1e12)} TFLOP/s", figures)


def check_compile(rig: Rig, *, quick: bool = False) -> Check:
    """``torch.compile`` (inductor) of a wrapped CUDA model: every call counted, device-timed, no graph break.

    Pass: calls == made, timed samples == calls at 100% sampling, and Dynamo counted no graph break.
    """
    if not rig.real:
        return Check("compile", "skip", "needs a real GPU")
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    mon = _monitor(rig, sample_rate=1.0, warmup_calls=0)
    calls = 20 if quick else 100
    try:
        mlp = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512)).cuda()
        model = mon.wrap(mlp, name="compiled")
        compiled: Any = torch.compile(model)
        x = torch.randn(64, 512, device="cuda")
        t0 = time.perf_counter()
        with torch.inference_mode():
            same = torch.allclose(compiled(x), mlp(x), atol=1e-3, rtol=1e-3)
            compile_s = time.perf_counter() - t0
            for _ in range(calls - 1):
                compiled(x)
        rig.synchronize()
        mon.flush(timeout=10)
        got = _total(mon, "perfmon_forward_calls_total", model="compiled")
        timed = _device_seconds(mon, "compiled")[1]
        steady_sum = _total(mon, "perfmon_forward_duration_seconds_sum", model="compiled", phase="steady")
        steady_n = _total(mon, "perfmon_forward_duration_seconds_count", model="compiled", phase="steady")
        cold_n = _total(mon, "perfmon_forward_duration_seconds_count", model="compiled", phase="cold")
        breaks = sum(counters["graph_break"].values())
    finally:
        mon.stop()
        torch._dynamo.reset()
    want = calls + 1  # wrap() swaps the class in place: the eager reference call ``mlp(x)`` counts too
    figures: dict[str, Figure] = {"calls": (got, ""), "timed": (timed, ""), "graph_breaks": (breaks, ""),
                                  "first_call_with_compile": (compile_s, "s"),
                                  "cold_calls": (cold_n, ""),
                                  "steady_device_mean": (steady_sum / steady_n * 1e6 if steady_n else None, "µs")}
    ok = same and got == want and timed == want and breaks == 0
    return Check("compile", "pass" if ok else "fail",
                 f"{got:g}/{want} calls counted, {timed:g} device-timed, {breaks} graph break(s); output "
                 f"{'matches' if same else 'DIFFERS from'} eager", figures)


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
        itl_sum = _total(mon, "perfmon_inter_token_latency_seconds_sum", model="gpt2")
        dev_decode = _total(mon, "perfmon_forward_duration_seconds_sum", model="gpt2", stage="decode")
    finally:
        mon.stop()
    figures: dict[str, Figure] = {
        "prefill_calls": (prefill, ""), "decode_calls": (decode, ""), "ttft_count": (ttft, ""),
        "itl_count": (itl, ""), "ttft_mean_host": (ttft_sum / ttft * 1e3 if ttft else None, "ms"),
        "prefill_mean_device": (dev_prefill / prefill * 1e3 if prefill else None, "ms"),
        "itl_mean_host": (itl_sum / itl * 1e3 if itl else None, "ms"),
        "decode_mean_device": (dev_decode / decode * 1e3 if decode else None, "ms"),
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
    ("event_pool_default", check_event_pool_default),
    ("graph_capture", check_graph_capture),
    ("allocator", check_allocator),
    ("nvml", check_nvml),
    ("capture", check_capture),
    ("roofline", check_roofline),
    ("compile", check_compile),
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
