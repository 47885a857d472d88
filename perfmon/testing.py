"""Fakes and helpers for testing code that uses perfmon — and perfmon itself — without a GPU.

``FakeCuda`` is a ``CudaBackend`` over a simulated GPU that keeps PyTorch's event semantics:

* work launched on a stream runs after the work before it on that stream;
* an event recorded on a stream completes when the stream's work before it completes;
* ``query()`` is True for an event never recorded, else False until the GPU reaches it;
* ``elapsed_time`` raises RuntimeError unless both events were recorded ("Both events must be
  recorded ...") and completed ("Both events must be completed ..."), and returns milliseconds;
* an event belongs to the device of the stream it was first recorded on.

The GPU only moves when a test says so (``advance``/``finish``), so tests are deterministic.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

__all__ = [
    "BusyWait",
    "FakeCuda",
    "FakeEvent",
    "FakeGpu",
    "FakeStream",
    "GpuWork",
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


class FakeGpu:
    """A simulated GPU with ``devices`` devices sharing one clock in milliseconds."""

    def __init__(self, devices: int = 1) -> None:
        self.lock = threading.RLock()
        self.now_ms = 0.0
        self.streams = {d: FakeStream(self, d) for d in range(devices)}
        self.current: dict[int, FakeStream] = dict(self.streams)
        self.events_created = 0
        self._extra: list[FakeStream] = []

    def stream(self, device: int = 0, name: str = "side") -> FakeStream:
        """A new stream on ``device``."""
        s = FakeStream(self, device, name)
        with self.lock:
            self._extra.append(s)
        return s

    def launch(self, ms: float, stream: FakeStream | None = None, device: int = 0) -> None:
        """Queue ``ms`` of work on ``stream`` (default: the device's current stream)."""
        with self.lock:
            s = stream if stream is not None else self.current[device]
            s.tail_ms = max(s.tail_ms, self.now_ms) + ms

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
        self.gpu.launch(self.ms, device=self.device_index)
        return x


class BusyWait(torch.nn.Module):
    """A module that spins for ``seconds`` of wall time (a known CPU duration), then returns its input."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: Any) -> Any:
        end = time.perf_counter_ns() + int(self.seconds * 1e9)
        while time.perf_counter_ns() < end:
            pass
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
