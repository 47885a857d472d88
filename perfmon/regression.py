"""Latency regression detection: steady-state window percentiles against a learned baseline.

Pure logic with the clock passed in, so it is tested on synthetic streams without threads. The
resolver feeds it steady-state samples (``add``) and calls ``tick`` with the current time; a tick
that closes a regressed window returns a ``Regression`` for the capture controller.

Per model, time is cut into windows of at least ``window_seconds``; a window with fewer than
``min_samples`` samples is extended (up to ``MAX_WINDOW_FACTOR`` times) until it has them, so a quiet
model is judged on longer windows instead of never. A window with at least ``min_samples`` samples is
evaluated: while the baseline has fewer than ``baseline_windows`` healthy windows it is
learning (every window counts as healthy); after that the baseline is the median of the last
``baseline_windows`` healthy windows' percentiles, and a window whose chosen percentiles exceed
``baseline x ratio`` is regressed. ``consecutive`` regressed windows in a row make the regression
active (one ``Regression`` is returned); the first healthy window ends it. Regressed windows never
enter the baseline, so a slow period cannot teach the detector that slow is normal. A window with
too few samples breaks a streak (consecutive means consecutive) without ending an active regression,
and a percentile is judged only in windows that can resolve it (p99 from 100 samples, p95 from 20).
"""

from __future__ import annotations

import math
import random
import statistics
import warnings
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .exceptions import ConfigError
from .windows import quantile

__all__ = ["QUANTILE_LEVELS", "Detector", "Regression", "RegressionPolicy", "WindowStats"]

#: Percentile names a policy may trigger on -> quantile level.
QUANTILE_LEVELS = {"p50": 0.5, "p90": 0.9, "p95": 0.95, "p99": 0.99}

_RESERVOIR = 20_000  # samples kept per window; beyond it, uniform reservoir sampling
#: A window waiting for min_samples closes anyway after this many window_seconds (as too small).
MAX_WINDOW_FACTOR = 6


@dataclass(frozen=True, kw_only=True)
class RegressionPolicy:
    """When a steady-state latency regression fires an automatic capture. Units in the names."""

    # Defaults sized for default sampling (1% + one call a second): at 200 calls/s a 10 s window holds
    # ~30 samples, and a 2x step is caught within ~30 s (benchmarks/detection.py).
    window_seconds: float = 10.0
    ratio: float = 1.5
    min_samples: int = 20
    consecutive: int = 2
    baseline_windows: int = 6
    cooldown_seconds: float = 600.0
    max_captures_per_hour: int = 4
    #: A window regresses when any of these percentiles exceeds its baseline x ratio.
    quantiles: tuple[str, ...] = ("p50", "p99")
    #: The automatic capture: forward calls and seconds, whichever ends first.
    capture_steps: int = 5
    capture_max_seconds: float = 10.0
    capture_record_shapes: bool = True
    #: Heavy (Python stacks, allocator events): off by default for automatic captures; a warning if on.
    capture_with_stack: bool = False
    capture_profile_memory: bool = False

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ConfigError:
            return ConfigError(f"RegressionPolicy {name}={getattr(self, name)!r}: {why}")

        for name in ("window_seconds", "cooldown_seconds", "capture_max_seconds"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
                raise bad(name, "must be a finite number of seconds > 0")
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)) or not 1.0 < self.ratio < math.inf:
            raise bad("ratio", "must be a number > 1")
        for name in ("min_samples", "consecutive", "baseline_windows", "max_captures_per_hour"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise bad(name, "must be an integer >= 1")
        if isinstance(self.capture_steps, bool) or not isinstance(self.capture_steps, int) \
                or not 1 <= self.capture_steps <= 100:
            raise bad("capture_steps", "must be an integer 1..100")
        if not self.quantiles or any(q not in QUANTILE_LEVELS for q in self.quantiles):
            raise bad("quantiles", f"must be a non-empty subset of {sorted(QUANTILE_LEVELS)}")
        object.__setattr__(self, "quantiles", tuple(self.quantiles))
        for name in ("capture_record_shapes", "capture_with_stack", "capture_profile_memory"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be true or false")
        if self.capture_with_stack or self.capture_profile_memory:
            warnings.warn("RegressionPolicy enables with_stack/profile_memory for automatic captures: they make "
                          "each capture several times heavier on the serving thread", stacklevel=3)


@dataclass(frozen=True)
class WindowStats:
    """A closed window: when it ended (ns on the detector's clock), its sample count and percentiles (s)."""

    end_ns: int
    count: int
    seconds: dict[str, float]


@dataclass(frozen=True)
class Regression:
    """Why the detector fired: the windows that regressed and the baseline they were compared with."""

    model: str
    windows: tuple[WindowStats, ...]
    baseline_seconds: dict[str, float]
    ratio: float
    exceeded: tuple[str, ...]

    def as_dict(self) -> dict[str, Any]:
        last = self.windows[-1]
        return {
            "model": self.model,
            "ratio_threshold": self.ratio,
            "exceeded": list(self.exceeded),
            "baseline_seconds": self.baseline_seconds,
            "window_seconds": last.seconds,
            "window_samples": last.count,
            "observed_ratio": {q: last.seconds[q] / self.baseline_seconds[q]
                               for q in self.exceeded if self.baseline_seconds.get(q)},
            "consecutive_windows": len(self.windows),
        }


@dataclass
class _Track:
    start_ns: int
    values: list[float] = field(default_factory=list)
    seen: int = 0
    healthy: deque[WindowStats] = field(default_factory=deque)
    streak: list[WindowStats] = field(default_factory=list)
    active: bool = False
    regressions: int = 0
    last: WindowStats | None = None


class Detector:
    """Rolling windows and baselines for every model; feed with ``add``, drive with ``tick``."""

    def __init__(self, policy: RegressionPolicy, *, seed: int | None = None) -> None:
        self.policy = policy
        self.window_ns = int(policy.window_seconds * 1e9)
        self.max_window_ns = self.window_ns * MAX_WINDOW_FACTOR
        self._tracks: dict[str, _Track] = {}
        self._random = random.Random(seed)

    def reset_after_fork(self) -> None:
        self._tracks = {}

    def add(self, model: str, seconds: float, t_ns: int) -> list[Regression]:
        """One steady-state sample of ``model`` that ended at ``t_ns``; returns what closing windows fired."""
        track = self._tracks.get(model)
        if track is None:
            track = self._tracks[model] = _Track(start_ns=t_ns)
        fired = self._advance(model, track, t_ns)
        track.seen += 1
        if len(track.values) < _RESERVOIR:
            track.values.append(seconds)
        else:  # keep a uniform sample of the window: the percentiles stay unbiased
            j = int(self._random.random() * track.seen)
            if j < _RESERVOIR:
                track.values[j] = seconds
        return fired

    def tick(self, now_ns: int) -> list[Regression]:
        """Close every window that ended by ``now_ns``; returns the regressions that became active."""
        fired: list[Regression] = []
        for model, track in list(self._tracks.items()):
            fired += self._advance(model, track, now_ns)
        return fired

    def _advance(self, model: str, track: _Track, now_ns: int) -> list[Regression]:
        age = now_ns - track.start_ns
        if age < self.window_ns:
            return []
        # A window lasts at least window_seconds and, at low traffic, until it holds min_samples
        # (at most MAX_WINDOW_FACTOR windows): a quiet model still gets judged, on longer windows.
        if track.seen < self.policy.min_samples and age < self.max_window_ns:
            return []
        result = self._close(model, track, now_ns)
        track.start_ns = now_ns
        return [] if result is None else [result]

    def _close(self, model: str, track: _Track, end_ns: int) -> Regression | None:
        values, seen = track.values, track.seen
        track.values, track.seen = [], 0
        p = self.policy
        if seen < p.min_samples:
            track.streak.clear()
            return None
        ordered = sorted(values)
        stats = WindowStats(end_ns, seen, {q: quantile(ordered, QUANTILE_LEVELS[q]) for q in _names(p)})
        track.last = stats
        baseline = self.baseline(model)
        if baseline is None:
            self._learn(track, stats)
            return None
        # A percentile is only judged when the window can resolve it: p99 needs 100 samples (below that
        # it is just the maximum, and one slow call would look like a regression).
        judged = [q for q in p.quantiles if seen >= _min_count(QUANTILE_LEVELS[q])]
        if not judged:
            track.streak.clear()
            return None
        exceeded = tuple(q for q in judged if stats.seconds[q] > baseline[q] * p.ratio)
        if not exceeded:
            track.streak.clear()
            track.active = False
            self._learn(track, stats)
            return None
        track.streak.append(stats)
        if len(track.streak) >= p.consecutive and not track.active:
            track.active = True
            track.regressions += 1
            return Regression(model, tuple(track.streak[-p.consecutive:]), baseline, p.ratio, exceeded)
        return None

    def _learn(self, track: _Track, stats: WindowStats) -> None:
        track.healthy.append(stats)
        while len(track.healthy) > self.policy.baseline_windows:
            track.healthy.popleft()

    def baseline(self, model: str) -> dict[str, float] | None:
        """The learned baseline percentiles (s), or None while still learning."""
        track = self._tracks.get(model)
        if track is None or len(track.healthy) < self.policy.baseline_windows:
            return None
        return {q: statistics.median(w.seconds[q] for w in track.healthy) for q in _names(self.policy)}

    def views(self) -> Iterator[tuple[str, WindowStats | None, dict[str, float] | None, bool, int]]:
        """(model, last window, baseline, active, regressions) for every model seen."""
        for model, track in list(self._tracks.items()):
            yield model, track.last, self.baseline(model), track.active, track.regressions


def _min_count(level: float) -> int:
    """Samples a window needs for its ``level`` quantile to be more than its maximum."""
    return math.ceil(1.0 / (1.0 - level) - 1e-9)


def _names(policy: RegressionPolicy) -> tuple[str, ...]:
    """Percentiles to compute: the triggering ones plus p50 and p99 for display."""
    return tuple(dict.fromkeys(("p50", "p99", *policy.quantiles)))
