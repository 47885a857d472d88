"""The fake GPU: a ``CudaBackend`` over a simulated device, fake models that queue work on it, and a fake
profiler that writes their calls as a CUDA capture's trace (``perfmon.testing`` exports them all).

``FakeCuda`` keeps PyTorch's event semantics:

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
import contextlib
import itertools
import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch

__all__ = ["FakeCall", "FakeCuda", "FakeEvent", "FakeGpu", "FakeProfiler", "FakeStream", "GpuKernels", "GpuWork",
           "spin"]


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
            stream = stream if stream is not None else gpu.current_stream(0)
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
    """A simulated GPU with ``devices`` devices sharing one clock in milliseconds.

    ``current`` is each device's current stream for every thread; a thread may make another stream current for
    itself (``using``), as ``torch.cuda.stream`` does: CUDA's current stream is per thread."""

    def __init__(self, devices: int = 1) -> None:
        self.lock = threading.RLock()
        self.now_ms = 0.0
        self.streams = {d: FakeStream(self, d) for d in range(devices)}
        self.current: dict[int, FakeStream] = dict(self.streams)
        self._local = threading.local()
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

    def current_stream(self, device: int = 0) -> FakeStream:
        """The calling thread's current stream on ``device``."""
        mine = getattr(self._local, "streams", None)
        return mine[device] if mine and device in mine else self.current[device]

    @contextlib.contextmanager
    def using(self, stream: FakeStream) -> Iterator[FakeStream]:
        """Make ``stream`` the calling thread's current stream on its device, inside the block."""
        mine = getattr(self._local, "streams", None)
        if mine is None:
            mine = self._local.streams = {}
        before = mine.get(stream.device)
        mine[stream.device] = stream
        try:
            yield stream
        finally:
            if before is None:
                del mine[stream.device]
            else:
                mine[stream.device] = before

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
            s = stream if stream is not None else self.current_stream(device)
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
        self._own: dict[int, FakeStream] = {}

    def available(self) -> bool:
        return True

    def new_event(self) -> FakeEvent:
        with self.gpu.lock:
            self.gpu.events_created += 1
        return FakeEvent(self.gpu)

    def current_stream(self, device_index: int) -> FakeStream:
        return self.gpu.current_stream(device_index)

    def is_capturing(self, device_index: int) -> bool:
        return self.gpu.current_stream(device_index).capturing

    def own_stream(self, device_index: int) -> contextlib.AbstractContextManager[FakeStream]:
        with self.gpu.lock:
            stream = self._own.get(device_index)
            if stream is None:
                stream = self._own[device_index] = self.gpu.stream(device_index, "perfmon")
        return self.gpu.using(stream)


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
        self.gpu = gpu
        self.kernels = kernels
        self.kernel_ms = kernel_ms
        self.launch_ms = launch_ms
        self.sync = sync
        self.device_index = device

    def forward(self, x: Any) -> Any:
        gpu = self.gpu
        t0 = gpu.now_ms
        launched = []
        for _ in range(self.kernels):
            spin(self.launch_ms / 1e3)
            gpu.advance(self.launch_ms)
            launched.append((gpu.now_ms, *gpu.launch(self.kernel_ms, device=self.device_index)))
        if self.sync:
            wait = max(0.0, gpu.current_stream(self.device_index).tail_ms - gpu.now_ms)
            spin(wait / 1e3)
            gpu.advance(wait)
        gpu.record_call(t0, launched)
        return x


class FakeProfiler:
    """A ``profiler_factory`` for captures of fake GPU models: ``Monitor(profiler_factory=FakeProfiler.factory(gpu))``.

    Like torch.profiler, it records every fake forward of the thread while it runs, and the capture marks the
    captured model's calls with its step annotation (``step_scope``, which the recording uses in place of
    torch's ``record_function``). The export writes them as torch.profiler's Chrome trace would hold them: a
    ``perfmon.step`` annotation around each step's calls (1 µs past the host's last stamp: the return), per
    kernel an op and the runtime call that launched it, and the kernel on the device with the runtime call's
    ``correlation``; times on the fake device's clock. A CPU capture is torch's own profiler.
    """

    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu = gpu
        self._first = 0  # the number of the first fake call made while recording
        self._steps: list[tuple[int, int]] = []  # [first, last) call numbers of each step
        self._calls: list[FakeCall] = []

    @classmethod
    def factory(cls, gpu: FakeGpu) -> Callable[[Any, bool], Any]:
        """``(options, cuda) -> profiler``: this fake for a CUDA capture, torch's profiler for a CPU one."""
        from .captures.profiler import torch_profiler

        return lambda options, cuda: cls(gpu) if cuda else torch_profiler(options, cuda)

    def start(self) -> None:
        self._first = self.gpu.calls_made

    @contextlib.contextmanager
    def step_scope(self, name: str) -> Iterator[None]:
        """The step annotation: the fake calls made inside it are one recorded step."""
        first = self.gpu.calls_made
        try:
            yield
        finally:
            self._steps.append((first, self.gpu.calls_made))

    def stop(self) -> None:
        with self.gpu.lock:
            calls, made = list(self.gpu.calls), self.gpu.calls_made
        base = made - len(calls)  # the number of calls[0]
        self._calls = calls[max(0, self._first - base):]
        self._first = max(self._first, base)

    def export_chrome_trace(self, path: str) -> None:
        ids = itertools.count(1)

        def x(cat: str, name: str, ms: float, dur_us: float, **args: int) -> dict[str, Any]:
            return {"ph": "X", "cat": cat, "name": name, "pid": int(cat != "kernel"), "tid": 1,
                    "ts": round(ms * 1e3, 3), "dur": round(dur_us, 3), "args": args}

        events = []
        for first, last in self._steps:
            inside = self._calls[max(0, first - self._first):max(0, last - self._first)]
            if inside:
                t0, t1 = inside[0].host_start_ms, inside[-1].host_end_ms
                events.append(x("user_annotation", "perfmon.step", t0, (t1 - t0) * 1e3 + 1,
                                **{"External id": next(ids)}))
        for call in self._calls:  # every call's launches, in a step or not (as the thread's ops are recorded)
            for launched, start, end in call.kernels:
                op, corr = next(ids), next(ids)
                events += [x("cpu_op", "fake::kernel", launched, 0.5, **{"External id": op}),
                           x("cuda_runtime", "cudaLaunchKernel", launched + 1e-4, 0.3, correlation=corr),
                           x("kernel", "fake_kernel", start, (end - start) * 1e3, correlation=corr,
                             **{"External id": op})]
        with open(path, "w") as f:
            json.dump({"traceEvents": events}, f)


def spin(seconds: float) -> None:
    """Hold the calling thread for ``seconds`` of wall time (a loaded machine can only make it longer)."""
    end = time.perf_counter_ns() + int(seconds * 1e9)
    while time.perf_counter_ns() < end:
        pass
