"""NVML telemetry: the only module that imports pynvml.

A daemon poller reads each visible GPU and keeps the latest reading; the exporter renders that reading at
scrape time (a scrape never waits on NVML). The poller polls for its readers (``telemetry/pollplan.py``): one
poll just before each read of a steady reader (a Prometheus), at most one every ``nvml_interval_seconds``
otherwise, and one a minute when nobody reads.

Failure model, per the NVML return codes:

* library or driver missing at start (``NVMLError_LibraryNotFound``, ``DriverNotLoaded``...):
  ``up`` is False, one log line, no thread left spinning;
* a field the GPU does not support (``NVMLError_NotSupported``): that field is absent for that GPU
  and never asked again; other fields still update;
* any other error from a call: counted by call, that field is absent from the reading (no stale
  value is exported), and when a whole poll fails the poller backs off (doubling up to 60 s,
  ``perfmon.backoff``) and re-initialises NVML; ``up`` reflects the last poll.

The backend is injectable (``Monitor(nvml=...)``): anything with pynvml's function names and
exception classes. ``perfmon.testing.FakeNvml`` is one; the real one is the ``pynvml`` module. So is
the clock (``NvmlPoller(clock=...)``, monotonic seconds): tests drive ``tick()`` by hand.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pynvml

from ..selfcost import AgentCpu
from .pollplan import PollThread

__all__ = ["CLOCK_EVENT_REASONS", "STATIC_REFRESH_SECONDS", "GpuReading", "NvmlPoller", "NvmlSnapshot", "errors",
           "normalize_uuid"]

#: The ``reason`` label of ``perfmon_gpu_clocks_event_reasons`` -> NVML's bit (nvmlClocksEventReason*).
CLOCK_EVENT_REASONS: dict[str, int] = {
    "gpu_idle": 0x1,
    "applications_clocks_setting": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80,
    "display_clock_setting": 0x100,
}

#: Seconds between reads of what rarely changes (an operator's ``nvidia-smi -pl`` changes the power limit; the maximum
#: SM clock never does): a poll skips those calls in between.
STATIC_REFRESH_SECONDS = 60.0


#: The calls ``_statics`` makes.
_STATIC_CALLS = ("nvmlDeviceGetEnforcedPowerLimit", "nvmlDeviceGetMaxClockInfo")


class _Lost(Exception):
    """A GPU answered ``NVMLError_GpuIsLost``: it drops out of the reading and is looked up again next poll."""


def errors() -> Any:
    """pynvml's exception classes, for fakes that must raise the real ones."""
    return pynvml


def normalize_uuid(uuid: Any) -> str:
    """NVML's ``GPU-xxxxxxxx-...`` form (torch reports the same UUID without the prefix)."""
    text = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
    return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"


@dataclass
class GpuReading:
    """One GPU's latest values, in base units; a field is absent when unsupported or failing."""

    index: int
    uuid: str
    values: dict[str, float] = field(default_factory=dict)
    clock_event_reasons: dict[str, int] = field(default_factory=dict)


@dataclass
class NvmlSnapshot:
    up: bool
    gpus: list[GpuReading]
    errors: dict[str, int]

    def index_by_uuid(self) -> dict[str, int]:
        return {g.uuid: g.index for g in self.gpus}


class NvmlPoller:
    """Polls NVML on a daemon thread; ``snapshot()`` returns the latest reading.

    The thread runs ``tick()`` whenever it says a poll is due, by ``clock`` (monotonic seconds), and sleeps in
    between. A poll is worth its cost only when someone reads it, so every ``snapshot()`` is a read, and polls
    follow the reads (``PollThread``, ``PollPlan``: one 1.5 s before each scrape of a steady Prometheus, at most
    one every ``interval_seconds``, one a minute when nobody reads). While NVML fails, the next try backs off
    (doubling from two intervals, capped at 60 s) and re-initialises NVML.

    What a poll costs a GIL-bound serving thread is its NVML calls: each is a ctypes call that lets go of the GIL
    and takes it back, and a slow one (a driver ioctl) hands the GIL to the serving thread and has to take it back
    from it (a forced switch, two thread wakes). On a lent H200 host a poll of ~17 calls stalled a loop holding
    the GIL ~2.6 ms. So a poll makes only the calls whose answer changes: each GPU's handle and UUID are kept
    until NVML re-initialises or the GPU is lost, and its power limit and maximum SM clock are read again every
    ``STATIC_REFRESH_SECONDS``; per GPU that leaves 9 reads (11 C calls) and the device count, the poll's
    liveness check.
    """

    def __init__(self, backend: Any = None, *, interval_seconds: float = 5.0, log: Any = None,
                 pid: Callable[[], int] = os.getpid, cpu: AgentCpu | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._cpu = cpu if cpu is not None else AgentCpu()
        self.nvml = backend if backend is not None else pynvml
        self.interval = interval_seconds
        self._log = log
        self._pid = pid
        self._clock = clock
        self._lock = threading.Lock()
        self._timer = PollThread(self._guarded_poll, interval_seconds=interval_seconds, clock=clock,
                                 name="perfmon-nvml", woke=lambda: self._cpu.woke("nvml"))
        self._initialized = False
        self._unsupported: set[tuple[int, str]] = set()
        self._errors: dict[str, int] = {}
        self._last_seen_us: dict[int, int] = {}
        self._devices: dict[int, tuple[Any, str]] = {}  # index -> (handle, UUID), until re-init or lost
        self._static: dict[int, tuple[float, dict[str, float]]] = {}  # index -> (clock() read, values)
        self._logged_down = False
        self._snapshot = NvmlSnapshot(False, [], {})

    def reset_after_fork(self) -> None:
        """In a forked child: NVML handles do not survive fork; re-initialise on the next start."""
        self._lock = threading.Lock()
        self._timer.reset()
        self._initialized = False
        self._errors = {}
        self._last_seen_us = {}
        self._devices = {}
        self._static = {}
        self._snapshot = NvmlSnapshot(False, [], {})

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Initialise NVML and start polling; without NVML, stay down quietly (one log line)."""
        if self._timer.alive:
            return
        if not self._init(first=True):
            return  # no library or driver: nothing will change while the process runs
        polled_at = self._clock()
        self._timer.start(polled_at, self._guarded_poll())

    def stop(self, timeout_seconds: float = 2.0) -> None:
        self._timer.stop(timeout_seconds)
        if self._initialized:
            try:
                self.nvml.nvmlShutdown()
            except Exception:
                pass  # shutting down anyway
            self._initialized = False

    @property
    def alive(self) -> bool:
        return self._timer.alive

    def tick(self) -> float:
        """Poll if one is due by the clock and the reads; returns seconds until the next one is due (the thread
        sleeps that long, or until a read brings the next poll forward)."""
        return self._timer.tick()

    def _guarded_poll(self) -> bool:
        try:
            with self._cpu.measure("nvml"):
                return self.poll()
        except Exception:  # a bug or an odd driver answer must not end telemetry for good
            self._count("poll")
            self._set(NvmlSnapshot(False, [], dict(self._errors)))
            return False

    def _init(self, first: bool = False) -> bool:
        nvml = self.nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            if not first:
                self._count("nvmlInit")  # NVML was up and is failing now; absent at start is not an error
            self._set(NvmlSnapshot(False, [], dict(self._errors)))
            if not self._logged_down and self._log is not None:
                self._logged_down = True
                self._log.warning("nvml_unavailable", error=type(exc).__name__, detail=str(exc),
                                  note="GPU telemetry off; perfmon_nvml_up is 0; everything else works")
            return False
        except Exception as exc:  # e.g. a broken ctypes load
            if not first:
                self._count("nvmlInit")
            if self._log is not None and not self._logged_down:
                self._logged_down = True
                self._log.warning("nvml_unavailable", error=type(exc).__name__, detail=str(exc))
            return False
        self._initialized = True
        self._devices.clear()  # handles do not outlive an nvmlShutdown or a failed NVML
        self._static.clear()
        return True

    # -- one poll -----------------------------------------------------------------------------

    def poll(self) -> bool:
        """Read every GPU once; True if NVML answered (even with some fields missing)."""
        nvml = self.nvml
        if not self._initialized and not self._init():
            return False
        try:
            count = nvml.nvmlDeviceGetCount()
        except Exception:
            self._count("nvmlDeviceGetCount")
            self._initialized = False  # re-init on the next poll
            self._set(NvmlSnapshot(False, [], dict(self._errors)))
            return False
        gpus = []
        for index in range(count):
            reading = self._read_gpu(index)
            if reading is not None:
                gpus.append(reading)
        up = bool(gpus) or count == 0
        self._set(NvmlSnapshot(up, gpus, dict(self._errors)))
        return up

    def _read_gpu(self, index: int) -> GpuReading | None:
        try:
            return self._read_device(index)
        except _Lost:
            self._devices.pop(index, None)
            self._static.pop(index, None)
            self._count("nvmlDeviceGetHandleByIndex")
            return None  # a lost GPU: its series disappear rather than go stale

    def _device(self, index: int) -> tuple[Any, str]:
        """(handle, UUID) of GPU ``index``, looked up once (raises ``_Lost`` when it cannot be)."""
        known = self._devices.get(index)
        if known is not None:
            return known
        nvml = self.nvml
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            known = (handle, normalize_uuid(nvml.nvmlDeviceGetUUID(handle)))
        except Exception as exc:
            raise _Lost from exc
        self._devices[index] = known
        return known

    def _statics(self, index: int, handle: Any) -> dict[str, float]:
        """The power limit and maximum SM clock, read again every ``STATIC_REFRESH_SECONDS``."""
        now = self._clock()
        known = self._static.get(index)
        if known is not None and now - known[0] < STATIC_REFRESH_SECONDS:
            return known[1]
        nvml, v = self.nvml, {}
        limit = self._call(index, "nvmlDeviceGetEnforcedPowerLimit", handle)
        if limit is not None:
            v["power_limit_watts"] = limit / 1000.0
        max_clock = self._call(index, "nvmlDeviceGetMaxClockInfo", handle, nvml.NVML_CLOCK_SM)
        if max_clock is not None:
            v["sm_clock_max_hertz"] = max_clock * 1e6
        if len(v) + sum((index, n) in self._unsupported for n in _STATIC_CALLS) == len(_STATIC_CALLS):
            self._static[index] = (now, v)  # kept only when complete: a failing read is tried again next poll
        return v

    def _read_device(self, index: int) -> GpuReading:
        nvml = self.nvml
        handle, uuid = self._device(index)
        r = GpuReading(index, uuid)
        v = r.values
        util = self._call(index, "nvmlDeviceGetUtilizationRates", handle)
        if util is not None:
            v["utilization_ratio"] = util.gpu / 100.0
            v["memory_utilization_ratio"] = util.memory / 100.0
        mem = self._call(index, "nvmlDeviceGetMemoryInfo", handle)
        if mem is not None:
            v["memory_used_bytes"] = float(mem.used)
            v["memory_total_bytes"] = float(mem.total)
        temp = self._call(index, "nvmlDeviceGetTemperature", handle, nvml.NVML_TEMPERATURE_GPU)
        if temp is not None:
            v["temperature_celsius"] = float(temp)
        power = self._call(index, "nvmlDeviceGetPowerUsage", handle)
        if power is not None:
            v["power_watts"] = power / 1000.0  # milliwatts
        energy = self._call(index, "nvmlDeviceGetTotalEnergyConsumption", handle)
        if energy is not None:
            v["energy_joules"] = energy / 1000.0  # millijoules since the driver loaded
        clock = self._call(index, "nvmlDeviceGetClockInfo", handle, nvml.NVML_CLOCK_SM)
        if clock is not None:
            v["sm_clock_hertz"] = clock * 1e6  # MHz
        v.update(self._statics(index, handle))
        reasons = self._call(index, "nvmlDeviceGetCurrentClocksEventReasons", handle)
        if reasons is not None:
            r.clock_event_reasons = {name: int(bool(reasons & bit)) for name, bit in CLOCK_EVENT_REASONS.items()}
        self._read_process(index, handle, r)
        return r

    def _read_process(self, index: int, handle: Any, r: GpuReading) -> None:
        """This process's share: memory from the compute process list, SM use from utilization samples."""
        pid = self._pid()
        procs = self._call(index, "nvmlDeviceGetComputeRunningProcesses", handle)
        if procs is not None:
            # usedGpuMemory is None when the driver may not report it (e.g. some containers); PIDs are
            # the host's, so a process in its own PID namespace is not found: the series is then absent.
            mine = [p.usedGpuMemory for p in procs if p.pid == pid and p.usedGpuMemory is not None]
            if mine:
                r.values["process_memory_used_bytes"] = float(sum(mine))
        samples = self._process_samples(index, handle)
        if samples is not None:
            mine_s = [s for s in samples if s.pid == pid]
            # No sample of ours since the last poll means none of our kernels ran: 0, not absent.
            latest = max(mine_s, key=lambda s: s.timeStamp).smUtil if mine_s else 0
            r.values["process_utilization_ratio"] = latest / 100.0

    def _process_samples(self, index: int, handle: Any) -> list[Any] | None:
        nvml = self.nvml
        key = (index, "nvmlDeviceGetProcessUtilization")
        if key in self._unsupported:
            return None
        try:
            samples = list(nvml.nvmlDeviceGetProcessUtilization(handle, self._last_seen_us.get(index, 0)))
        except nvml.NVMLError_NotSupported:
            self._unsupported.add(key)
            return None
        except nvml.NVMLError as exc:
            # NOT_FOUND (and pynvml's quirk of raising with SUCCESS) mean "no samples since then".
            if getattr(exc, "value", None) in (nvml.NVML_ERROR_NOT_FOUND, nvml.NVML_SUCCESS):
                return []
            self._count("nvmlDeviceGetProcessUtilization")
            return None
        except Exception:
            self._count("nvmlDeviceGetProcessUtilization")
            return None
        if samples:
            self._last_seen_us[index] = max(s.timeStamp for s in samples)
        return samples

    def _call(self, index: int, name: str, *args: Any) -> Any:
        """One NVML call; None when unsupported (remembered) or failing (counted)."""
        if (index, name) in self._unsupported:
            return None
        nvml = self.nvml
        try:
            return getattr(nvml, name)(*args)
        except nvml.NVMLError_NotSupported:
            self._unsupported.add((index, name))
            return None
        except getattr(nvml, "NVMLError_GpuIsLost", ()) as exc:  # a backend without the class never loses one
            raise _Lost from exc
        except Exception:
            self._count(name)
            return None

    def _count(self, call: str) -> None:
        self._errors[call] = self._errors.get(call, 0) + 1

    def _set(self, snapshot: NvmlSnapshot) -> None:
        with self._lock:
            self._snapshot = snapshot

    def snapshot(self) -> NvmlSnapshot:
        """The latest reading. A call is a read: the poller plans its polls around its readers (class docstring)."""
        self._timer.read()
        with self._lock:
            return self._snapshot
