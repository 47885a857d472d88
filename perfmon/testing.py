"""Fakes and helpers for testing code that uses perfmon — and perfmon itself — without a GPU.

``FakeCuda`` is a ``CudaBackend`` over a simulated GPU that keeps PyTorch's event semantics:

* work launched on a stream runs after the work before it on that stream;
* an event recorded on a stream completes when the stream's work before it completes;
* ``query()`` is True for an event never recorded, else False until the GPU reaches it;
* ``elapsed_time`` raises RuntimeError unless both events were recorded ("Both events must be
  recorded ...") and completed ("Both events must be completed ..."), and returns milliseconds;
* an event belongs to the device of the stream it was first recorded on.

The GPU only moves when a test says so (``advance``/``finish``), or while a ``GpuKernels`` forward launches
(the device runs while the host launches), by fixed amounts, so tests are deterministic. ``FakeProfiler``
writes the fake models' calls as the Chrome trace a CUDA capture would hold.
"""

from __future__ import annotations

import collections
import itertools
import json
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import SimpleNamespace
from typing import Any, NamedTuple

import torch

from .telemetry.nvml import errors as _nvml_errors

__all__ = [
    "BusyWait",
    "FakeCall",
    "FakeCuda",
    "FakeEvent",
    "FakeGpu",
    "FakeNvml",
    "FakeProfiler",
    "FakeStream",
    "FakeTorchMemory",
    "GpuKernels",
    "GpuWork",
    "event_pairs_in_flight",
    "histogram_quantile",
]


class FakeStream:
    """A stream on a fake device: a queue whose tail is when its last queued work finishes (ms)."""

    def __init__(self, gpu: FakeGpu, device: int, name: str = "default") -> None:
        self.gpu = gpu
        self.device = device
        self.name = name
        self.tail_ms = 0.0
        self.capturing = False

    def __repr__(self) -> str:
        return f"<FakeStream cuda:{self.device} {self.name}>"


class FakeEvent:
    """Behaves like ``torch.cuda.Event(enable_timing=True)`` on the fake GPU."""

    def __init__(self, gpu: FakeGpu, enable_timing: bool = True) -> None:
        self.gpu = gpu
        self.enable_timing = enable_timing
        self.device: int | None = None  # set lazily at first record, like torch
        self.at_ms: float | None = None
        self.records = 0

    def record(self, stream: FakeStream | None = None) -> None:
        gpu = self.gpu
        with gpu.lock:
            stream = stream if stream is not None else gpu.current[0]
            if self.device is None:
                self.device = stream.device
            elif self.device != stream.device:
                raise RuntimeError(
                    f"Event device {self.device} does not match recording stream's device {stream.device}.")
            if stream.capturing:
                raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
            self.at_ms = max(stream.tail_ms, gpu.now_ms)
            self.records += 1

    def query(self) -> bool:
        with self.gpu.lock:
            return self.at_ms is None or self.gpu.now_ms >= self.at_ms

    def elapsed_time(self, end_event: FakeEvent) -> float:
        with self.gpu.lock:
            if self.at_ms is None or end_event.at_ms is None:
                raise RuntimeError("Both events must be recorded before calculating elapsed time.")
            now = self.gpu.now_ms
            if now < self.at_ms or now < end_event.at_ms:
                raise RuntimeError("Both events must be completed before calculating elapsed time.")
            if not (self.enable_timing and end_event.enable_timing):
                raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
            return end_event.at_ms - self.at_ms


class FakeCall(NamedTuple):
    """One forward of a fake GPU model, on the device's clock (ms): what a profiler would have recorded."""
    host_start_ms: float
    host_end_ms: float
    kernels: tuple[tuple[float, float, float], ...]  # (launched at, started, ended) per kernel


class FakeGpu:
    """A simulated GPU with ``devices`` devices sharing one clock in milliseconds."""

    def __init__(self, devices: int = 1) -> None:
        self.lock = threading.RLock()
        self.now_ms = 0.0
        self.streams = {d: FakeStream(self, d) for d in range(devices)}
        self.current: dict[int, FakeStream] = dict(self.streams)
        self.events_created = 0
        self._extra: list[FakeStream] = []
        #: The fake models' latest forwards (``FakeProfiler`` writes those it recorded as a trace).
        self.calls: collections.deque[FakeCall] = collections.deque(maxlen=4096)
        self.calls_made = 0

    def record_call(self, host_start_ms: float, kernels: Sequence[tuple[float, float, float]]) -> None:
        """Log one forward that began at ``host_start_ms`` and ends now (device clock), with its kernels."""
        with self.lock:
            self.calls.append(FakeCall(host_start_ms, self.now_ms, tuple(kernels)))
            self.calls_made += 1

    def stream(self, device: int = 0, name: str = "side") -> FakeStream:
        """A new stream on ``device``."""
        s = FakeStream(self, device, name)
        with self.lock:
            self._extra.append(s)
        return s

    def launch(self, ms: float, stream: FakeStream | None = None, device: int = 0) -> tuple[float, float]:
        """Queue ``ms`` of work on ``stream`` (default: the device's current stream); returns when it will
        start and end (ms): after the work before it on the stream, and not before now."""
        with self.lock:
            s = stream if stream is not None else self.current[device]
            start = max(s.tail_ms, self.now_ms)
            s.tail_ms = start + ms
            return start, s.tail_ms

    def advance(self, ms: float) -> None:
        """Let the device run for ``ms``."""
        with self.lock:
            self.now_ms += ms

    def finish(self) -> None:
        """Let the device run until every stream is idle."""
        with self.lock:
            tails = [s.tail_ms for s in (*self.streams.values(), *self.current.values(), *self._extra)]
            self.now_ms = max([self.now_ms, *tails])


class FakeCuda:
    """A ``CudaBackend`` over a ``FakeGpu``; inject it as ``Monitor(cuda=FakeCuda())``."""

    def __init__(self, gpu: FakeGpu | None = None, *, devices: int = 1) -> None:
        self.gpu = gpu if gpu is not None else FakeGpu(devices)

    def available(self) -> bool:
        return True

    def new_event(self) -> FakeEvent:
        with self.gpu.lock:
            self.gpu.events_created += 1
        return FakeEvent(self.gpu)

    def current_stream(self, device_index: int) -> FakeStream:
        return self.gpu.current[device_index]

    def is_capturing(self, device_index: int) -> bool:
        return self.gpu.current[device_index].capturing


class GpuWork(torch.nn.Module):
    """A module whose forward queues ``ms`` of fake GPU work on the current stream and returns its input."""

    def __init__(self, gpu: FakeGpu, ms: float, device: int = 0) -> None:
        super().__init__()
        self.gpu = gpu
        self.ms = ms
        self.device_index = device

    def forward(self, x: Any) -> Any:
        gpu = self.gpu
        with gpu.lock:
            now = gpu.now_ms
            gpu.record_call(now, [(now, *gpu.launch(self.ms, device=self.device_index))])
        return x


class GpuKernels(torch.nn.Module):
    """A forward of ``kernels`` fake kernels of ``kernel_ms`` each, the host taking ``launch_ms`` to launch each
    one; with ``sync`` it then waits for the device, as ``.item()`` or ``.cpu()`` do.

    The device runs while the host launches: the fake clock advances ``launch_ms`` per launch (and by a sync's
    wait) while the host spins at least as long in real time, so host time is never below the events' span.
    ``launch_ms > kernel_ms``: the device idles between kernels (launch-bound: host ≈ span, low occupancy); the
    other way round kernels queue back to back and the host returns long before the device is done
    (device-bound); device-bound with ``sync``: host ≈ span as when launch-bound, yet the device is always busy.
    """

    def __init__(self, gpu: FakeGpu, *, kernels: int, kernel_ms: float, launch_ms: float, sync: bool = False,
                 device: int = 0) -> None:
        super().__init__()
        self.gpu, self.kernels, self.kernel_ms, self.launch_ms = gpu, kernels, kernel_ms, launch_ms
        self.sync, self.device_index = sync, device

    def forward(self, x: Any) -> Any:
        gpu = self.gpu
        t0 = gpu.now_ms
        launched = []
        for _ in range(self.kernels):
            _spin(self.launch_ms / 1e3)
            gpu.advance(self.launch_ms)
            launched.append((gpu.now_ms, *gpu.launch(self.kernel_ms, device=self.device_index)))
        if self.sync:
            wait = max(0.0, gpu.current[self.device_index].tail_ms - gpu.now_ms)
            _spin(wait / 1e3)
            gpu.advance(wait)
        gpu.record_call(t0, launched)
        return x


class FakeProfiler:
    """A ``profiler_factory`` for captures of fake GPU models: ``Monitor(profiler_factory=FakeProfiler.factory(gpu))``.

    A CUDA capture writes the fake models' forwards it recorded (``FakeGpu.calls``) as torch.profiler's Chrome
    trace would hold them: a ``perfmon.step`` annotation per call (1 µs longer than the host's part: the return),
    per kernel an op and the runtime call that launched it, and the kernel on the device with the runtime call's
    ``correlation``; times on the fake device's clock. A CPU capture is torch's own profiler.
    """

    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu, self._first = gpu, 0
        self._calls: list[FakeCall] = []

    @classmethod
    def factory(cls, gpu: FakeGpu) -> Callable[[Any, bool], Any]:
        from .captures.profiler import torch_profiler

        return lambda options, cuda: cls(gpu) if cuda else torch_profiler(options, cuda)

    def start(self) -> None:
        self._first = self.gpu.calls_made

    def stop(self) -> None:
        with self.gpu.lock:
            self._calls = list(self.gpu.calls)[max(0, len(self.gpu.calls) - (self.gpu.calls_made - self._first)):]

    def export_chrome_trace(self, path: str) -> None:
        ids = itertools.count(1)

        def x(cat: str, name: str, ms: float, dur_us: float, **args: int) -> dict[str, Any]:
            return {"ph": "X", "cat": cat, "name": name, "pid": int(cat != "kernel"), "tid": 1,
                    "ts": round(ms * 1e3, 3), "dur": round(dur_us, 3), "args": args}

        events = []
        for call in self._calls:
            events.append(x("user_annotation", "perfmon.step", call.host_start_ms,
                            (call.host_end_ms - call.host_start_ms) * 1e3 + 1, **{"External id": next(ids)}))
            for launched, start, end in call.kernels:
                op, corr = next(ids), next(ids)
                events += [x("cpu_op", "fake::kernel", launched, 0.5, **{"External id": op}),
                           x("cuda_runtime", "cudaLaunchKernel", launched + 1e-4, 0.3, correlation=corr),
                           x("kernel", "fake_kernel", start, (end - start) * 1e3, correlation=corr,
                             **{"External id": op})]
        with open(path, "w") as f:
            json.dump({"traceEvents": events}, f)


def _spin(seconds: float) -> None:
    """Hold the calling thread for ``seconds`` of wall time (a loaded machine can only make it longer)."""
    end = time.perf_counter_ns() + int(seconds * 1e9)
    while time.perf_counter_ns() < end:
        pass


class BusyWait(torch.nn.Module):
    """A module that spins for ``seconds`` of wall time (a known CPU duration), then returns its input."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: Any) -> Any:
        _spin(self.seconds)
        return x


def histogram_quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float:
    """Prometheus' ``histogram_quantile`` over cumulative ``(le, count)`` pairs (``le`` may be inf).

    Linear interpolation inside the bucket holding the rank; the lowest bucket starts at 0; a rank
    in the +Inf bucket returns the highest finite bound.
    """
    pairs: Sequence[tuple[float, float]] = sorted(buckets)
    if not pairs or not math.isinf(pairs[-1][0]):
        raise ValueError("buckets must end with the +Inf bucket")
    total = pairs[-1][1]
    if total == 0:
        return math.nan
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for i, (le, count) in enumerate(pairs):
        if count >= rank:
            if math.isinf(le):
                return pairs[i - 1][0] if i > 0 else math.nan
            if i == 0 and le <= 0:
                return le
            return lower_bound + (le - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = le, count
    return math.nan  # pragma: no cover


_pynvml = _nvml_errors()


class FakeNvml:
    """Mimics the ``pynvml`` module: same function names, units and exception classes.

    ``FakeNvml()`` is two GPUs with plausible, non-zero readings and a compute-process list that
    includes this process. Script failures by changing the attributes at any time:

    * ``library_missing=True``: ``nvmlInit`` raises ``NVMLError_LibraryNotFound`` (a machine without a driver);
    * ``unsupported``: names of calls (or ``(gpu, name)`` pairs) that raise ``NVMLError_NotSupported``;
    * ``failing``: names of calls (or ``(gpu, name)`` pairs) that raise ``NVMLError_Unknown``;
    * ``lost``: GPU indices whose handle raises ``NVMLError_GpuIsLost``;
    * ``calls``: how many times each function was called.
    """

    NVMLError = _pynvml.NVMLError
    NVMLError_NotSupported = _pynvml.NVMLError_NotSupported
    NVMLError_LibraryNotFound = _pynvml.NVMLError_LibraryNotFound
    NVMLError_GpuIsLost = _pynvml.NVMLError_GpuIsLost
    NVMLError_Unknown = _pynvml.NVMLError_Unknown
    NVMLError_NotFound = _pynvml.NVMLError_NotFound
    NVML_SUCCESS = _pynvml.NVML_SUCCESS
    NVML_ERROR_NOT_FOUND = _pynvml.NVML_ERROR_NOT_FOUND
    NVML_TEMPERATURE_GPU = _pynvml.NVML_TEMPERATURE_GPU
    NVML_CLOCK_SM = _pynvml.NVML_CLOCK_SM

    def __init__(self, gpus: int = 2, *, pid: int | None = None, library_missing: bool = False,
                 unsupported: Iterable[Any] = (), failing: Iterable[Any] = (), lost: Iterable[int] = ()) -> None:
        self.pid = os.getpid() if pid is None else pid
        self.library_missing = library_missing
        self.unsupported = set(unsupported)
        self.failing = set(failing)
        self.lost = set(lost)
        self.calls: dict[str, int] = {}
        self.initialized = False
        self.gpus = [
            {
                "uuid": f"GPU-{i:08x}-1111-2222-3333-{i:012x}",
                "util": SimpleNamespace(gpu=40 + 10 * i, memory=20 + 5 * i),
                "memory": SimpleNamespace(total=80 * 2**30, used=(10 + i) * 2**30, free=(70 - i) * 2**30),
                "temperature": 55 + i,
                "power_mw": 250_000 + 10_000 * i,
                "limit_mw": 400_000,
                "energy_mj": 1_000_000_000 + i,
                "sm_mhz": 1410,
                "sm_max_mhz": 1980,
                "reasons": 0x4 if i == 1 else 0x0,  # GPU 1 is power capped
                "processes": [SimpleNamespace(pid=self.pid, usedGpuMemory=(3 + i) * 2**30),
                              SimpleNamespace(pid=self.pid + 100_000, usedGpuMemory=2**30)],
                "samples": [SimpleNamespace(pid=self.pid, smUtil=30 + i, memUtil=10, timeStamp=1_000 + i),
                            SimpleNamespace(pid=self.pid + 100_000, smUtil=5, memUtil=1, timeStamp=1_001)],
            }
            for i in range(gpus)
        ]

    def _enter(self, name: str, index: int | None = None) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        if name != "nvmlInit" and not self.initialized:
            raise _pynvml.NVMLError_Uninitialized()
        for key in (name, (index, name)):
            if key in self.unsupported:
                raise _pynvml.NVMLError_NotSupported()
            if key in self.failing:
                raise _pynvml.NVMLError_Unknown()

    def _gpu(self, handle: Any, name: str) -> dict[str, Any]:
        self._enter(name, handle)
        if handle in self.lost:
            raise _pynvml.NVMLError_GpuIsLost()
        gpu: dict[str, Any] = self.gpus[handle]
        return gpu

    def nvmlInit(self) -> None:
        if self.library_missing:
            self.calls["nvmlInit"] = self.calls.get("nvmlInit", 0) + 1
            raise _pynvml.NVMLError_LibraryNotFound()
        self._enter("nvmlInit")
        self.initialized = True

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        self.initialized = False

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        self._enter("nvmlDeviceGetHandleByIndex", index)
        if index in self.lost:
            raise _pynvml.NVMLError_GpuIsLost()
        return index

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return str(self._gpu(handle, "nvmlDeviceGetUUID")["uuid"])

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:
        return self._gpu(handle, "nvmlDeviceGetUtilizationRates")["util"]

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
        return self._gpu(handle, "nvmlDeviceGetMemoryInfo")["memory"]

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:
        return int(self._gpu(handle, "nvmlDeviceGetTemperature")["temperature"])

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        return int(self._gpu(handle, "nvmlDeviceGetPowerUsage")["power_mw"])

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: int) -> int:
        return int(self._gpu(handle, "nvmlDeviceGetEnforcedPowerLimit")["limit_mw"])

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: int) -> int:
        return int(self._gpu(handle, "nvmlDeviceGetTotalEnergyConsumption")["energy_mj"])

    def nvmlDeviceGetClockInfo(self, handle: int, clock: int) -> int:
        return int(self._gpu(handle, "nvmlDeviceGetClockInfo")["sm_mhz"])

    def nvmlDeviceGetMaxClockInfo(self, handle: int, clock: int) -> int:
        return int(self._gpu(handle, "nvmlDeviceGetMaxClockInfo")["sm_max_mhz"])

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: int) -> int:
        return int(self._gpu(handle, "nvmlDeviceGetCurrentClocksEventReasons")["reasons"])

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[Any]:
        return list(self._gpu(handle, "nvmlDeviceGetComputeRunningProcesses")["processes"])

    def nvmlDeviceGetProcessUtilization(self, handle: int, timestamp: int) -> list[Any]:
        samples = [s for s in self._gpu(handle, "nvmlDeviceGetProcessUtilization")["samples"]
                   if s.timeStamp > timestamp]
        if not samples:
            raise _pynvml.NVMLError_NotFound()
        return samples


class FakeTorchMemory:
    """A ``MemorySource`` with scripted ``torch.cuda.memory_stats`` per torch device index.

    ``uuids`` maps torch index -> UUID as torch reports it (no ``GPU-`` prefix), so a test can
    scramble the order against NVML's the way ``CUDA_VISIBLE_DEVICES`` does.
    """

    def __init__(self, stats: Mapping[int, Mapping[str, Any]] | None = None,
                 uuids: Mapping[int, str] | None = None) -> None:
        gib = 2**30
        self.stats_by_device: dict[int, dict[str, Any]] = {
            d: dict(s) for d, s in (stats or {
                0: {"allocated_bytes.all.current": 2 * gib, "reserved_bytes.all.current": 4 * gib,
                    "allocated_bytes.all.peak": 3 * gib, "reserved_bytes.all.peak": 5 * gib,
                    "inactive_split_bytes.all.current": gib, "num_alloc_retries": 2, "num_ooms": 1},
            }).items()
        }
        self.uuids = dict(uuids or {d: f"{d:08x}-1111-2222-3333-{d:012x}" for d in self.stats_by_device})
        self.snapshots = 0

    def devices(self) -> Sequence[int]:
        return sorted(self.stats_by_device)

    def stats(self, device: int) -> Mapping[str, Any]:
        return self.stats_by_device[device]

    def uuid(self, device: int) -> str:
        return self.uuids[device]

    def snapshot(self) -> Any:
        self.snapshots += 1
        return {"segments": [{"device": d, "total_size": s.get("reserved_bytes.all.current", 0)}
                             for d, s in self.stats_by_device.items()], "device_traces": []}


def event_pairs_in_flight(monitor: Any) -> int:
    """CUDA event pairs a monitor has taken from its pools and not yet given back (0 once all resolved).

    A pair leaks when a timed call's events are never resolved or released; with ``FakeCuda`` a test
    can prove that every pair went back, whatever the call did.
    """
    return int(monitor.resolver.hub.pools.in_flight())
