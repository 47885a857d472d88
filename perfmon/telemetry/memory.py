"""torch's CUDA caching-allocator statistics, and the allocator snapshot written on OOM.

Read at scrape time from ``torch.cuda.memory_stats(device)``: host-side counters, cheap, no sync.
Only devices this process has used appear (a CPU-only process exports no torch memory series at all,
not zeros). Peaks are since process start: perfmon never calls ``reset_peak_memory_stats()``, which
belongs to the user.

Fragmentation is ``inactive_split_bytes / reserved_bytes``: memory held in cached blocks that were
split and are now partly free. Such bytes can only serve requests that fit the split pieces, so a
rising ratio with flat allocated bytes means the allocator is fragmenting (``expandable_segments``
or ``max_split_size_mb`` help), while a rising reserved with flat allocated is plain caching, not a leak.
"""

from __future__ import annotations

import os
import pickle
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ..store.files import worker_name, write_private

__all__ = ["DeviceMemory", "MemorySource", "OomSnapshotter", "TorchMemory", "read_memory"]


class MemorySource(Protocol):
    """The seam between perfmon and ``torch.cuda``'s allocator."""

    def devices(self) -> Sequence[int]:
        """torch indices of the CUDA devices this process has allocated on."""
        ...

    def stats(self, device: int) -> Mapping[str, Any]:
        """``torch.cuda.memory_stats(device)``."""
        ...

    def uuid(self, device: int) -> str:
        """The device's UUID (to join torch's index with NVML's through CUDA_VISIBLE_DEVICES)."""
        ...

    def snapshot(self) -> Any:
        """``torch.cuda.memory._snapshot()``."""
        ...


class TorchMemory:
    """The real source."""

    def __init__(self) -> None:
        import torch

        self._cuda = torch.cuda
        self._uuids: dict[int, str] = {}

    def devices(self) -> Sequence[int]:
        cuda = self._cuda
        if not cuda.is_available() or not cuda.is_initialized():
            return ()
        out = []
        for i in range(cuda.device_count()):
            # A device never allocated on has an all-zero peak; skip it rather than export zeros.
            if cuda.memory_stats(i).get("reserved_bytes.all.peak", 0) > 0:
                out.append(i)
        return out

    def stats(self, device: int) -> Mapping[str, Any]:
        return self._cuda.memory_stats(device)  # type: ignore[no-any-return]

    def uuid(self, device: int) -> str:
        if device not in self._uuids:
            self._uuids[device] = str(self._cuda.get_device_properties(device).uuid)
        return self._uuids[device]

    def snapshot(self) -> Any:
        return self._cuda.memory._snapshot()


@dataclass(frozen=True)
class DeviceMemory:
    """One device's allocator figures, bytes unless named otherwise."""

    device: int
    uuid: str
    allocated_bytes: float
    reserved_bytes: float
    peak_allocated_bytes: float
    peak_reserved_bytes: float
    fragmentation_ratio: float
    alloc_retries: float
    ooms: float


def read_memory(source: MemorySource) -> list[DeviceMemory]:
    """Read every used device; raises what the source raises (the collector fails soft)."""
    out = []
    for d in source.devices():
        s = source.stats(d)
        reserved = float(s.get("reserved_bytes.all.current", 0))
        inactive = float(s.get("inactive_split_bytes.all.current", 0))
        out.append(DeviceMemory(
            device=d,
            uuid=source.uuid(d),
            allocated_bytes=float(s.get("allocated_bytes.all.current", 0)),
            reserved_bytes=reserved,
            peak_allocated_bytes=float(s.get("allocated_bytes.all.peak", 0)),
            peak_reserved_bytes=float(s.get("reserved_bytes.all.peak", 0)),
            fragmentation_ratio=inactive / reserved if reserved > 0 else 0.0,
            alloc_retries=float(s.get("num_alloc_retries", 0)),
            ooms=float(s.get("num_ooms", 0)),
        ))
    return out


class OomSnapshotter:
    """On a CUDA OOM, write one allocator snapshot to the trace directory, at most one per cooldown.

    Called on the request thread that saw the OOM (the allocator state is only meaningful right then);
    the snapshot is taken there, the file is written by a short-lived background thread, atomically
    (temp file, fsync, rename) with mode 0600 in a 0700 directory, through ``traces.write_private``: a
    symlinked, foreign or group/other-writable directory is refused (``on_error``) as for captures.
    """

    def __init__(self, source: MemorySource, directory: str | os.PathLike[str], cooldown_seconds: float,
                 *, on_written: Any = None, on_error: Any = None) -> None:
        self.source = source
        self.directory = Path(directory)
        self.cooldown_ns = int(cooldown_seconds * 1e9)
        self._last_ns: int | None = None
        self._lock = threading.Lock()
        self._on_written = on_written
        self._on_error = on_error
        self.written: list[Path] = []
        self._writer: threading.Thread | None = None

    def __call__(self, exc: BaseException) -> bool:
        """Snapshot now unless in cooldown or a write is in flight; True if one was taken."""
        now = time.monotonic_ns()
        with self._lock:
            if self._last_ns is not None and now - self._last_ns < self.cooldown_ns:
                return False
            if self._writer is not None and self._writer.is_alive():
                return False
            self._last_ns = now
        data = self.source.snapshot()
        name = f"{worker_name()}.{time.time_ns()}.oom_snapshot.pickle"
        self._writer = threading.Thread(target=self._write, args=(name, data), name="perfmon-oom-writer",
                                        daemon=True)
        self._writer.start()
        return True

    def _write(self, name: str, data: Any) -> None:
        try:
            path = write_private(self.directory, name, pickle.dumps(data, protocol=pickle.HIGHEST_PROTOCOL))
            self.written.append(path)
            if self._on_written is not None:
                self._on_written(path)
        except Exception as exc:
            if self._on_error is not None:
                self._on_error(exc)

    def join(self, timeout: float) -> None:
        writer = self._writer
        if writer is not None:
            writer.join(timeout)
