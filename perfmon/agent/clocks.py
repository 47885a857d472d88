"""Clocks: the only module that touches ``torch.cuda.Event``.

CPU calls are timed with ``time.perf_counter_ns`` on the request thread. CUDA calls are timed with
a pair of timing events recorded on the model device's current stream around the call; the
request thread never waits for them. A resolver thread later asks ``query()`` and, once the end
event is done, reads ``elapsed_time`` — milliseconds, converted to seconds here and nowhere else.

The CUDA side is a seam (``CudaBackend``) so it can be exercised without a GPU: see
``perfmon.testing.FakeCuda``, which reproduces the semantics PyTorch implements (query() of a never
recorded event is True; elapsed_time raises until both events are recorded and completed).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "CudaBackend", "EventPair", "EventPool", "EventPools", "NoCuda", "TimingEvent", "TorchCuda", "elapsed_seconds",
]


@runtime_checkable
class TimingEvent(Protocol):
    """What perfmon uses of ``torch.cuda.Event(enable_timing=True)``."""

    def record(self, stream: Any = None) -> None: ...

    def query(self) -> bool: ...

    def elapsed_time(self, end_event: Any) -> float:
        """Milliseconds from this event to ``end_event``; raises unless both completed."""
        ...


class CudaBackend(Protocol):
    """The narrow seam between perfmon and the CUDA runtime."""

    def available(self) -> bool:
        """True when CUDA work can be timed with events in this process."""
        ...

    def new_event(self) -> TimingEvent:
        """A timing-enabled event (created lazily on the device of the stream it is first recorded on)."""
        ...

    def current_stream(self, device_index: int) -> Any:
        """The stream the model's kernels go to on this device right now."""
        ...

    def is_capturing(self, device_index: int) -> bool:
        """True while that stream is being captured into a CUDA graph (timing events are illegal)."""
        ...

    def own_stream(self, device_index: int) -> contextlib.AbstractContextManager[Any]:
        """A context in which the calling thread's current stream on that device is one of perfmon's own (one per
        device, made on first use): for work perfmon runs off the request thread that might reach the device
        anyway, so that it never queues behind or ahead of the user's kernels on their stream."""
        ...


class TorchCuda:
    """The real backend over ``torch.cuda``."""

    def __init__(self) -> None:
        import torch

        self._cuda = torch.cuda
        self._own: dict[int, Any] = {}
        self._own_lock = threading.Lock()

    def available(self) -> bool:
        return bool(self._cuda.is_available())

    def new_event(self) -> TimingEvent:
        return self._cuda.Event(enable_timing=True)  # type: ignore[no-any-return,no-untyped-call]

    def current_stream(self, device_index: int) -> Any:
        return self._cuda.current_stream(device_index)

    def is_capturing(self, device_index: int) -> bool:
        # is_current_stream_capturing() looks at the current device; a graph is captured on the
        # device the caller made current, which is the model's device in practice.
        return bool(self._cuda.is_current_stream_capturing())

    def own_stream(self, device_index: int) -> contextlib.AbstractContextManager[Any]:
        with self._own_lock:
            stream = self._own.get(device_index)
            if stream is None:
                stream = self._own[device_index] = self._cuda.Stream(device=device_index)  # type: ignore[no-untyped-call]
        return self._cuda.stream(stream)


class NoCuda:
    """The backend for a process without CUDA: nothing is ever timed with events."""

    def available(self) -> bool:
        return False

    def new_event(self) -> TimingEvent:
        raise RuntimeError("CUDA is not available")

    def current_stream(self, device_index: int) -> Any:
        raise RuntimeError("CUDA is not available")

    def is_capturing(self, device_index: int) -> bool:
        return False

    def own_stream(self, device_index: int) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()


class EventPair:
    """A start/end pair of timing events owned by one device's pool."""

    __slots__ = ("device_index", "end", "start")

    def __init__(self, start: TimingEvent, end: TimingEvent, device_index: int) -> None:
        self.start = start
        self.end = end
        self.device_index = device_index


class EventPool:
    """Preallocated event pairs for one device.

    ``acquire`` is called on the request thread: a list pop, atomic under the GIL, no lock, and
    ``None`` when every pair is in flight (the caller drops the sample). Creating events costs
    a CUDA API call each, so they are made up front, never per request.
    """

    def __init__(self, backend: CudaBackend, device_index: int, size: int) -> None:
        self.device_index = device_index
        self.size = size
        self._free = [EventPair(backend.new_event(), backend.new_event(), device_index) for _ in range(size)]

    def acquire(self) -> EventPair | None:
        try:
            return self._free.pop()
        except IndexError:
            return None

    def release(self, pair: EventPair) -> None:
        self._free.append(pair)

    @property
    def free(self) -> int:
        return len(self._free)


class EventPools:
    """One pool per CUDA device index, made on first use (the first cold call on that device)."""

    def __init__(self, backend: CudaBackend, size: int) -> None:
        self.backend = backend
        self.size = size
        self._pools: dict[int, EventPool] = {}
        self._lock = threading.Lock()

    def get(self, device_index: int) -> EventPool:
        pool = self._pools.get(device_index)
        if pool is None:
            with self._lock:
                pool = self._pools.get(device_index)
                if pool is None:
                    pool = self._pools[device_index] = EventPool(self.backend, device_index, self.size)
        return pool

    def release(self, pair: EventPair) -> None:
        self.get(pair.device_index).release(pair)

    def in_flight(self) -> int:
        return sum(p.size - p.free for p in list(self._pools.values()))


def elapsed_seconds(pair: EventPair) -> float:
    """Device seconds between a completed pair's events: the one place milliseconds become seconds.

    Call only after ``pair.end.query()`` returned True (the start event precedes it on the same
    stream). Raises RuntimeError or ValueError (the class has varied across PyTorch versions) if
    the driver still refuses.
    """
    return pair.start.elapsed_time(pair.end) / 1000.0
