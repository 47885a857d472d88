"""Fakes and helpers for testing code that uses perfmon — and perfmon itself — without a GPU.

The fake GPU (``FakeCuda`` over ``FakeGpu``, with PyTorch's event semantics; ``GpuWork`` and ``GpuKernels``,
models that queue work on it; ``FakeProfiler``, their calls as a CUDA capture's trace) lives in
``perfmon/fakecuda.py`` and is exported here; so are fakes of NVML and torch's allocator, ``BusyWait`` and
helpers that read histograms and event pools, and ``DrivenPoller``, the NVML poller's schedule on a clock
driven by hand.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import torch

from .fakecuda import FakeCall, FakeCuda, FakeEvent, FakeGpu, FakeProfiler, FakeStream, GpuKernels, GpuWork, spin
from .telemetry.nvml import NvmlPoller
from .telemetry.nvml import errors as _nvml_errors

__all__ = [
    "BusyWait",
    "DrivenPoller",
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


class BusyWait(torch.nn.Module):
    """A module that spins for ``seconds`` of wall time (a known CPU duration), then returns its input."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: Any) -> Any:
        spin(self.seconds)
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


class DrivenPoller:
    """An ``NvmlPoller`` over a ``FakeNvml`` on a clock driven by hand, run the way its thread runs it, with readers
    calling ``snapshot()`` at given times: which polls a pattern of reads brings, and how old each read's reading is.

    The thread sleeps as long as ``tick()`` says and is woken by a read that brings the next poll forward; a tick
    when no poll is due only plans again, so ticking after every read polls exactly when the thread would. The
    first tick (the start's poll) happens at construction, at ``start`` seconds.
    """

    def __init__(self, *, interval_seconds: float = 5.0, nvml: FakeNvml | None = None, start: float = 0.0) -> None:
        self.nvml = nvml if nvml is not None else FakeNvml()
        #: the clock's reading, seconds
        self.t = start
        self.poller = NvmlPoller(self.nvml, interval_seconds=interval_seconds, clock=lambda: self.t)
        #: the clock's reading at each poll
        self.polls: list[float] = []
        #: (the clock's reading at each read, seconds since the poll before it)
        self.ages: list[tuple[float, float]] = []
        self._wake = self.t + self._tick()

    def _tick(self) -> float:
        before = self.nvml.calls.get("nvmlDeviceGetCount", 0)
        wait = self.poller.tick()
        if self.nvml.calls.get("nvmlDeviceGetCount", 0) > before:
            self.polls.append(self.t)
        return wait

    def run(self, seconds: float, reads: Iterable[float] = ()) -> None:
        """Run for ``seconds``, with a read at each offset in ``reads`` (seconds from now)."""
        end = self.t + seconds
        pending = sorted(self.t + r for r in reads)
        while min([self._wake, *pending[:1]]) <= end:
            self.t = min([self._wake, *pending[:1]])
            if pending and pending[0] == self.t:
                pending.pop(0)
                self.poller.snapshot()
                self.ages.append((self.t, self.t - self.polls[-1]))
            self._wake = self.t + self._tick()
        self.t = end

    def polls_between(self, a: float, b: float) -> int:
        """Polls at ``a`` <= t < ``b`` (clock readings)."""
        return sum(a <= t < b for t in self.polls)


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
