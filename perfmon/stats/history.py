"""Short time series for the status page, kept in bounded rings.

Recorded only while someone is looking: every read of ``/stats`` keeps recording on for
``active_seconds``; with nobody watching, a housekeeping tick costs one comparison. Each point
covers one ``interval_seconds``: call, error and item rates from the exact counters, steady-state
percentiles of the samples resolved in that interval, and the device telemetry of that moment.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from .windows import quantile

__all__ = ["History"]


class History:
    def __init__(self, *, interval_seconds: float = 2.0, points: int = 150, active_seconds: float = 60.0,
                 wake: Callable[[], None] | None = None) -> None:
        #: Called when someone starts looking (``touch`` after a spell with nobody): the resolver, perhaps dozing.
        self.wake = wake
        self.interval_ns = int(interval_seconds * 1e9)
        self.active_ns = int(active_seconds * 1e9)
        self._active_until = 0
        self._next_ns = 0
        self._last: dict[str, tuple[int, int, int, int]] = {}  # model -> (t_ns, calls, errors, items)
        self._models: dict[str, collections.deque[dict[str, Any]]] = {}
        self._devices: collections.deque[dict[str, Any]] = collections.deque(maxlen=points)
        self._points = points
        self._lock = threading.Lock()

    def reset_after_fork(self) -> None:
        self._lock = threading.Lock()
        self._last, self._models = {}, {}
        self._devices.clear()
        self._active_until = self._next_ns = 0

    def touch(self, now_ns: int) -> None:
        """Someone is looking: record for the next ``active_seconds``."""
        idle = now_ns >= self._active_until
        self._active_until = now_ns + self.active_ns
        if idle and self.wake is not None:
            self.wake()

    def due(self, now_ns: int) -> bool:
        return now_ns < self._active_until and now_ns >= self._next_ns

    def due_ns(self, now_ns: int) -> int | None:
        """perf_counter_ns of the next point while someone looks (None: nobody)."""
        return max(self._next_ns, now_ns) if now_ns < self._active_until else None

    def record(self, now_ns: int, models: Iterable[tuple[str, int, int, int | None]],
               steady: Callable[[str, int], list[float]], devices: dict[str, Any]) -> None:
        """One point: ``models`` as (name, calls, errors, items); ``steady(name, since_ns)`` gives durations."""
        self._next_ns = now_ns + self.interval_ns
        wall = time.time()
        with self._lock:
            for name, calls, errors, items in models:
                prev = self._last.get(name)
                self._last[name] = (now_ns, calls, errors, items or 0)
                if prev is None:
                    continue
                dt = (now_ns - prev[0]) / 1e9
                if dt <= 0:
                    continue
                durations = sorted(steady(name, prev[0]))
                point = {"t": wall, "calls_per_second": (calls - prev[1]) / dt,
                         "errors_per_second": (errors - prev[2]) / dt,
                         "items_per_second": ((items or 0) - prev[3]) / dt if items is not None else None,
                         "samples": len(durations)}
                for q in (0.5, 0.95, 0.99):
                    point[f"p{round(q * 100)}_seconds"] = quantile(durations, q) if durations else None
                ring = self._models.get(name)
                if ring is None:
                    ring = self._models[name] = collections.deque(maxlen=self._points)
                ring.append(point)
            self._devices.append({"t": wall, **devices})

    def series(self) -> dict[str, Any]:
        with self._lock:
            return {"interval_seconds": self.interval_ns / 1e9,
                    "models": {m: list(r) for m, r in self._models.items()},
                    "devices": list(self._devices)}
