"""Recent samples per model and phase, for the exact percentiles of ``/stats``.

Written by the resolver thread, read by the HTTP thread; the percentile math happens on read,
never on the request thread. Bounded in time (``window_seconds``) and in count (``max_samples``).
"""

from __future__ import annotations

import collections
import math
import threading
from collections.abc import Sequence
from time import perf_counter_ns
from typing import Any

from ..agent.records import Sample

__all__ = ["QUANTILES", "Windows", "quantile"]

QUANTILES = (0.5, 0.95, 0.99)


def quantile(ordered: Sequence[float], q: float) -> float:
    """The q-quantile of sorted values, linearly interpolated (numpy's default method)."""
    if not ordered:
        return math.nan
    pos = (len(ordered) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(values: Sequence[float]) -> dict[str, Any]:
    """Count, mean, max and the QUANTILES of values in seconds."""
    ordered = sorted(values)
    out: dict[str, Any] = {"count": len(ordered)}
    if ordered:
        out["mean_seconds"] = sum(ordered) / len(ordered)
        out["max_seconds"] = ordered[-1]
        for q in QUANTILES:
            out[f"p{round(q * 100)}_seconds"] = quantile(ordered, q)
    return out


class Windows:
    """Per (model, stage, phase): a ring of (end_ns, duration_seconds, host_seconds, gc_generation)."""

    def __init__(self, window_seconds: float, max_samples: int) -> None:
        self.window_ns = int(window_seconds * 1e9)
        self.max_samples = max_samples
        self._rings: dict[tuple[str, str, str], collections.deque[tuple[int, float, float, int]]] = {}
        self._lock = threading.Lock()

    def reset_after_fork(self) -> None:
        self._rings = {}
        self._lock = threading.Lock()

    def add(self, samples: list[Sample]) -> None:
        """Sink for a pass's resolved samples (one lock a pass)."""
        rings = self._rings
        with self._lock:
            for sample in samples:
                key = (sample.model, sample.stage, sample.phase)
                ring = rings.get(key)
                if ring is None:
                    ring = rings[key] = collections.deque(maxlen=self.max_samples)
                ring.append((sample.end_ns, sample.duration_seconds, sample.host_seconds, sample.gc_generation))

    def since(self, model: str, phase: str, since_ns: int, stage: str = "") -> list[float]:
        """Durations (s) of ``model``'s ``phase`` samples (of one ``stage``) that ended after ``since_ns``."""
        with self._lock:
            ring = self._rings.get((model, stage, phase))
            items = list(ring) if ring is not None else []
        return [d for end, d, _, _ in items if end > since_ns]

    def marks(self, model: str, phase: str, since_ns: int, until_ns: int, stage: str = "") -> list[tuple[float, int]]:
        """(duration seconds, gc_generation) of the samples that ended in ``(since_ns, until_ns]``."""
        with self._lock:
            ring = self._rings.get((model, stage, phase))
            items = list(ring) if ring is not None else []
        return [(d, g) for end, d, _, g in items if since_ns < end <= until_ns]

    def split(self, model: str, phase: str, since_ns: int, until_ns: int,
              stage: str = "") -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
        """(duration, host) seconds of the samples that ended before ``since_ns`` and of those in
        ``(since_ns, until_ns]``: a regression's windows and what the ring kept from before them."""
        with self._lock:
            ring = self._rings.get((model, stage, phase))
            items = list(ring) if ring is not None else []
        before = [(d, h) for end, d, h, _ in items if end <= since_ns]
        return before, [(d, h) for end, d, h, _ in items if since_ns < end <= until_ns]

    def summary(self, model: str, now_ns: int | None = None, stage: str = "") -> dict[str, dict[str, Any]]:
        """Per phase: device (or wall) and host duration summaries over the window (one ``stage``)."""
        cutoff = (perf_counter_ns() if now_ns is None else now_ns) - self.window_ns
        out: dict[str, dict[str, Any]] = {}
        with self._lock:
            rings = {phase: list(ring) for (m, s, phase), ring in self._rings.items() if m == model and s == stage}
        for phase, items in sorted(rings.items()):
            recent = [(d, h) for end, d, h, _ in items if end >= cutoff]
            durations = [d for d, _ in recent]
            hosts = [h for _, h in recent]
            duration = summarize(durations)
            # On CPU host time is the same clock as the duration: sort once (/stats runs within the
            # HTTP server's CPU budget, polled by the status page).
            out[phase] = {"duration": duration,
                          "host_duration": dict(duration) if hosts == durations else summarize(hosts)}
        return out
