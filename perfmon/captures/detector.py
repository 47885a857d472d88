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
and a percentile is judged only in windows that can resolve it (p99 from 100 samples, p95 from 20); a
tail percentile regresses only when at least ``TAIL_SAMPLES`` (5) samples lie beyond its limit.
"""

from __future__ import annotations

import bisect
import math
import random
import statistics
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from ..stats.windows import quantile
from .regression_policy import QUANTILE_LEVELS, RegressionPolicy
from .sizes import MAX_SIZE_CLASS, class_label, size_class

__all__ = ["MAX_SIZE_CLASS", "QUANTILE_LEVELS", "Detector", "Regression", "RegressionPolicy", "WindowStats",
           "class_label", "size_class"]

_RESERVOIR = 20_000  # samples kept per window; beyond it, uniform reservoir sampling
#: A window waiting for min_samples closes anyway after this many window_seconds (as too small).
MAX_WINDOW_FACTOR = 6
#: Windows in a row without a single call that end an active regression: a model dropped (a new version) or left
#: without traffic is not regressed, and its alert should resolve. A few calls do not end it (too few to judge).
IDLE_WINDOWS_TO_END = 3
#: Size classes kept per series (the least recently seen goes beyond it): bounded memory and labels.
MAX_CLASSES = 16
#: Healthy latencies kept per size class; its reference is their median (s).
REF_SAMPLES = 512
#: A tail percentile (p90, p95, p99) regresses only when at least this many of the window's samples lie beyond
#: its limit: from a few hundred samples a p99 is the second or third slowest call, and two calls stalled from
#: outside the model (a preempted thread) are not a tail that moved.
TAIL_SAMPLES = 5
#: Ratios of healthy windows pooled per dominant size class: its tail percentiles' baseline is theirs.
TAIL_POOL = 2048


@dataclass(frozen=True)
class WindowStats:
    """A closed window: when it ended (ns on the detector's clock), its sample count and percentiles (s).

    ``ratios`` are the percentiles of each judged sample's latency over its size class's reference
    (None while no class had one); ``expected`` the percentiles the window would have had at the
    baseline, for its own traffic mix (seconds; None while learning); ``classes`` per size class label:
    ``{"samples": n, "ratio_p50": r | None}``; ``dominant`` the class most of its samples fell in (the
    mix its tail percentiles are judged against; ``Detector``).
    """

    end_ns: int
    count: int
    seconds: dict[str, float]
    ratios: dict[str, float] | None = None
    expected: dict[str, float] | None = None
    classes: dict[str, dict[str, Any]] = field(default_factory=dict)
    dominant: int = 0
    #: When the window began (ns on the detector's clock; 0: not recorded, a learning window replayed).
    start_ns: int = 0


@dataclass(frozen=True)
class Regression:
    """Why the detector fired: the windows that regressed and the baseline they were compared with."""

    model: str
    windows: tuple[WindowStats, ...]
    baseline_seconds: dict[str, float]
    ratio: float
    exceeded: tuple[str, ...]
    #: Size class labels that regressed (their median ratio over the threshold), worst first; when only the
    #: pooled percentiles did, the class with the largest median ratio.
    size_classes: tuple[str, ...] = ()

    @property
    def span_ns(self) -> tuple[int, int]:
        """(start, end) of the regressed windows, ns on the detector's clock (perf_counter_ns)."""
        return self.windows[0].start_ns, self.windows[-1].end_ns

    def as_dict(self) -> dict[str, Any]:
        last = self.windows[-1]
        return {
            "model": self.model,
            "ratio_threshold": self.ratio,
            "exceeded": list(self.exceeded),
            "size_classes": list(self.size_classes),
            "baseline_seconds": self.baseline_seconds,
            "window_seconds": last.seconds,
            "window_samples": last.count,
            "observed_ratio": {q: last.seconds[q] / self.baseline_seconds[q]
                               for q in self.exceeded if self.baseline_seconds.get(q)},
            "classes": last.classes,
            "consecutive_windows": len(self.windows),
        }


@dataclass
class _Class:
    """One size class of one series: its reference (recent healthy latencies, s) and when it was last seen."""

    ref: deque[float] = field(default_factory=lambda: deque(maxlen=REF_SAMPLES))
    median: float | None = None
    last_ns: int = 0


@dataclass
class _Tail:
    """Healthy windows of one dominant size class: how many, and their latest ratios (pooled)."""

    windows: int = 0
    ratios: deque[float] = field(default_factory=lambda: deque(maxlen=TAIL_POOL))


@dataclass
class _Track:
    start_ns: int
    values: list[float] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    seen: int = 0
    classes: dict[int, _Class] = field(default_factory=dict)
    #: The learning windows' samples (values, classes, end_ns, seen), until the baseline is learned.
    learning: list[tuple[list[float], list[int], int, int]] = field(default_factory=list)
    healthy: deque[WindowStats] = field(default_factory=deque)
    #: By dominant size class, its healthy windows' ratios (the tail percentiles' baseline, mix by mix).
    tails: dict[int, _Tail] = field(default_factory=dict)
    #: The ratios of the window ``_stats`` judged last (what ``_learn`` pools when that window is healthy).
    last_ratios: list[float] = field(default_factory=list)
    streak: list[WindowStats] = field(default_factory=list)
    active: bool = False
    active_classes: tuple[str, ...] = ()
    idle: int = 0  # windows closed in a row without a single call (IDLE_WINDOWS_TO_END)
    regressions: int = 0
    last: WindowStats | None = None
    #: The last window's mix: judged samples per size class (what its baseline is computed for).
    last_mix: dict[int, int] = field(default_factory=dict)


class Detector:
    """Rolling windows and baselines for every series; feed with ``add``, drive with ``tick``.

    Like with like: each sample is judged against the recent healthy latency of its own size class
    (``size_class`` of the call's work), as a ratio, and the window's ratio percentiles against their
    learned baseline. A shift of traffic between classes moves raw percentiles but not the median ratio.

    It does move the tail of the ratios: what stalls a call from outside the model (a preempted thread,
    a page fault, a collection) adds about the same time to a short call as to a long one, and the
    longer the calls the larger the share of them it hits. So the tail percentiles (all but p50) are
    judged against healthy windows of the same dominant size class only, and not at all until that
    class has ``baseline_windows`` of them. Measured with the issue's scenario (batches 4-8 to 128-256
    at the same cost per item, a 3-layer 256-wide MLP on a shared 2-core host): before, p99 fired on
    the shift alone in 4 of 8 runs (p99 ratio 3.8-10 with p50's at 1.1); BENCHMARKS.md has the after.
    """

    def __init__(self, policy: RegressionPolicy, *, seed: int | None = None) -> None:
        self.policy = policy
        self.window_ns = int(policy.window_seconds * 1e9)
        self.max_window_ns = self.window_ns * MAX_WINDOW_FACTOR
        #: Samples a class needs in its reference before its calls are judged, and in a window before
        #: the class is judged on its own (too few and one slow call would name it).
        self.class_ready = max(min(5, policy.min_samples), policy.min_samples // 2)
        self._tracks: dict[str, _Track] = {}
        self._random = random.Random(seed)
        #: Windows closed so far (any series): what ``views`` shows changes only when it moves, or a series is new.
        self.windows_closed = 0

    def reset_after_fork(self) -> None:
        self._tracks = {}

    def add(self, model: str, seconds: float, t_ns: int, size: int | None = None) -> list[Regression]:
        """One steady-state sample of ``model`` (a series key) that ended at ``t_ns`` and did ``size`` work
        (items or elements; None when unknown); returns what closing windows fired."""
        track = self._tracks.get(model)
        if track is None:
            track = self._tracks[model] = _Track(start_ns=t_ns)
        fired = self._advance(model, track, t_ns)
        track.seen += 1
        cls = size_class(size)
        if len(track.values) < _RESERVOIR:
            track.values.append(seconds)
            track.sizes.append(cls)
        else:  # keep a uniform sample of the window: the percentiles stay unbiased
            j = int(self._random.random() * track.seen)
            if j < _RESERVOIR:
                track.values[j] = seconds
                track.sizes[j] = cls
        return fired

    def tick(self, now_ns: int) -> list[Regression]:
        """Close every window that ended by ``now_ns``; returns the regressions that became active."""
        fired: list[Regression] = []
        for model, track in list(self._tracks.items()):
            fired += self._advance(model, track, now_ns)
        return fired

    def due_ns(self) -> int | None:
        """perf_counter_ns when ``tick`` next closes a window (None: no series yet): a window holding
        ``min_samples`` ends ``window_seconds`` after it began, one with fewer at ``MAX_WINDOW_FACTOR`` windows
        (more samples come through ``add``, and the resolver's pass that adds them asks again)."""
        soonest = None
        full, longest, enough = self.window_ns, self.max_window_ns, self.policy.min_samples
        for track in list(self._tracks.values()):
            end = track.start_ns + (full if track.seen >= enough else longest)
            if soonest is None or end < soonest:
                soonest = end
        return soonest

    def _advance(self, model: str, track: _Track, now_ns: int) -> list[Regression]:
        age = now_ns - track.start_ns
        if age < self.window_ns:
            return []
        # A window lasts at least window_seconds and, at low traffic, until it holds min_samples
        # (at most MAX_WINDOW_FACTOR windows): a quiet model still gets judged, on longer windows.
        if track.seen < self.policy.min_samples and age < self.max_window_ns:
            return []
        result = self._close(model, track, now_ns)
        self.windows_closed += 1
        track.start_ns = now_ns
        return [] if result is None else [result]

    def _close(self, model: str, track: _Track, end_ns: int) -> Regression | None:
        values, sizes, seen = track.values, track.sizes, track.seen
        track.values, track.sizes, track.seen = [], [], 0
        p = self.policy
        track.idle = track.idle + 1 if seen == 0 else 0
        if track.idle >= IDLE_WINDOWS_TO_END:
            track.active, track.active_classes = False, ()
        if seen < p.min_samples:
            track.streak.clear()
            return None
        baseline = self._ratio_baseline(track)
        if baseline is None:
            self._learn_window(track, values, sizes, end_ns, seen)
            return None
        stats = replace(self._stats(track, values, sizes, end_ns, seen), start_ns=track.start_ns)
        track.last = stats
        judged_n = sum(c["samples"] for c in stats.classes.values() if c["ratio_p50"] is not None)
        # A percentile is only judged when the window can resolve it: p99 needs 100 samples (below that
        # it is just the maximum, and one slow call would look like a regression).
        judged = [q for q in p.quantiles if judged_n >= max(p.min_samples, _min_count(QUANTILE_LEVELS[q]))]
        if stats.ratios is None or not judged:
            # Mostly classes never seen: nothing to compare with yet. They learn; the streak breaks.
            self._feed(track, values, sizes, end_ns, only_new=True)
            track.streak.clear()
            return None
        assert stats.ratios is not None
        tails, pooled = self._tail_baseline(track, stats.dominant)
        judged = [q for q in judged if q == "p50" or q in tails]
        exceeded = tuple(q for q in judged if stats.ratios[q] > (baseline if q == "p50" else tails)[q] * p.ratio
                         and (q == "p50" or self._tail_moved(track, values, sizes, tails[q] * p.ratio, pooled)))
        limit = baseline["p50"] * p.ratio
        slow = sorted(((c["ratio_p50"], label) for label, c in stats.classes.items()
                       if c["ratio_p50"] is not None and c["samples"] >= self.class_ready and c["ratio_p50"] > limit),
                      reverse=True)
        if not exceeded and not slow:
            track.streak.clear()
            track.active, track.active_classes = False, ()
            self._feed(track, values, sizes, end_ns, only_new=True)
            self._learn(track, stats)
            return None
        track.streak.append(stats)
        if len(track.streak) >= p.consecutive and not track.active:
            named = tuple(label for _, label in slow) or _worst_class(stats)
            if set(stats.classes) == {class_label(0)}:
                named = ()  # one class, sizes unknown: nothing to name
            track.active, track.active_classes = True, named
            track.regressions += 1
            return Regression(model, tuple(track.streak[-p.consecutive:]), stats.expected or {}, p.ratio,
                              exceeded or ("p50",), named)
        return None

    @staticmethod
    def _tail_moved(track: _Track, values: list[float], sizes: list[int], limit: float, pooled: list[float]) -> bool:
        """Whether the calls beyond a tail percentile's ``limit`` (a ratio) are more than its healthy windows
        had: at least ``TAIL_SAMPLES``, and at least twice, plus three standard deviations, the count the
        pooled healthy ratios predict for this many calls. A p99 is set by the two or three slowest calls of
        a few hundred; when stalls from outside the model hit about 1% of calls, a window with five of them
        is chance (measured: p99 fired once a minute on such traffic without this rule)."""
        judged = beyond = 0
        for v, c in zip(values, sizes, strict=True):
            k = track.classes.get(c)
            if k is not None and k.median is not None and k.median > 0:
                judged += 1
                beyond += v > limit * k.median
        share = (len(pooled) - bisect.bisect_right(pooled, limit)) / len(pooled) if pooled else 0.0
        expected = share * judged
        return beyond >= max(TAIL_SAMPLES, 2 * expected + 3 * math.sqrt(expected))

    def _stats(self, track: _Track, values: list[float], sizes: list[int], end_ns: int, seen: int) -> WindowStats:
        """Raw percentiles; ratio percentiles over the samples whose class has a reference; per class counts."""
        names = _names(self.policy)
        raw = sorted(values)
        seconds = {q: quantile(raw, QUANTILE_LEVELS[q]) for q in names}
        ratios: list[float] = []
        per: dict[int, list[float]] = {}
        counts: dict[int, int] = {}
        for c in set(sizes):
            if (known := track.classes.get(c)) is not None:
                known.last_ns = end_ns  # seen: not the class to evict
        for v, c in zip(values, sizes, strict=True):
            counts[c] = counts.get(c, 0) + 1
            k = track.classes.get(c)
            if k is None or k.median is None or k.median <= 0:
                continue
            r = v / k.median
            ratios.append(r)
            per.setdefault(c, []).append(r)
        classes = {class_label(c): {"samples": n, "ratio_p50": (statistics.median(per[c]) if c in per else None)}
                   for c, n in sorted(counts.items())}
        dominant = max(counts, key=lambda c: (counts[c], c)) if counts else 0
        if not ratios:
            return WindowStats(end_ns, seen, seconds, None, None, classes, dominant)
        ratios.sort()
        track.last_ratios = ratios
        rq = {q: quantile(ratios, QUANTILE_LEVELS[q]) for q in names}
        track.last_mix = {c: len(rs) for c, rs in per.items()}
        return WindowStats(end_ns, seen, seconds, rq, self._expected(track), classes, dominant)

    def _expected(self, track: _Track) -> dict[str, float] | None:
        """What the last window's percentiles would be at the baseline, for its own mix (s): each percentile
        of its samples' class references times the baseline ratio percentile. None while learning."""
        base = self._ratio_baseline(track)
        medians = sorted((k.median, track.last_mix[c]) for c, k in track.classes.items()
                         if k.median is not None and c in track.last_mix)
        if base is None or not medians:
            return None
        refs = [m for m, n in medians for _ in range(n)]  # sorted: at most 16 distinct values
        return {q: quantile(refs, QUANTILE_LEVELS[q]) * base[q] for q in _names(self.policy)}

    def _learn_window(self, track: _Track, values: list[float], sizes: list[int], end_ns: int, seen: int) -> None:
        """A learning window (every one is healthy). When ``baseline_windows`` are in, each class's reference
        is the median of all their samples of that class, and each window's ratio percentiles against those
        references make the ratio baseline: the references never include a window judged against them, so a
        slow stretch inside the learning period moves the baseline once, as a plain median would."""
        track.learning.append((values, sizes, end_ns, seen))
        track.last = self._stats(track, values, sizes, end_ns, seen)
        if len(track.learning) < self.policy.baseline_windows:
            return
        learning, track.learning = track.learning, []
        for v, c, t, _ in learning:
            self._feed(track, v, c, t, only_new=False)
        for k in track.classes.values():  # the whole learning period, however its samples fell into windows
            if k.median is None and k.ref:
                k.median = statistics.median(k.ref)
        for v, c, t, n in learning:
            stats = self._stats(track, v, c, t, n)
            if stats.ratios is not None:
                self._learn(track, stats)
        track.last = self._stats(track, values, sizes, end_ns, seen)

    def _feed(self, track: _Track, values: list[float], sizes: list[int], now_ns: int, *, only_new: bool) -> None:
        """Healthy samples into their classes' references (``only_new``: classes without a reference only;
        a class's reference is fixed once it has one, and drift is followed by the ratio baseline)."""
        touched: set[int] = set()
        for v, c in zip(values, sizes, strict=True):
            k = track.classes.get(c)
            if k is None:
                if len(track.classes) >= MAX_CLASSES:  # bounded: the class seen longest ago goes
                    del track.classes[min(track.classes, key=lambda x: track.classes[x].last_ns)]
                k = track.classes[c] = _Class()
            elif only_new and k.median is not None:
                continue
            k.ref.append(v)
            k.last_ns = now_ns
            touched.add(c)
        for c in touched:
            k = track.classes[c]
            if len(k.ref) >= self.class_ready:
                k.median = statistics.median(k.ref)

    def _learn(self, track: _Track, stats: WindowStats) -> None:
        n = self.policy.baseline_windows
        track.healthy.append(stats)
        while len(track.healthy) > n:
            track.healthy.popleft()
        tail = track.tails.pop(stats.dominant, None) or _Tail()
        tail.windows += 1
        tail.ratios.extend(track.last_ratios)
        track.tails[stats.dominant] = tail  # re-inserted: the dict's order is least recently healthy first
        while len(track.tails) > MAX_CLASSES:
            del track.tails[next(iter(track.tails))]

    def _tail_baseline(self, track: _Track, dominant: int) -> tuple[dict[str, float], list[float]]:
        """The tail percentiles' baseline for windows of this dominant class: the percentiles of the ratios
        pooled from its recent healthy windows (a p99 over 600 calls, not the median of three p99s each set
        by two calls), and those ratios sorted; empty until it has ``baseline_windows`` of them."""
        tail = track.tails.get(dominant)
        if tail is None or tail.windows < self.policy.baseline_windows:
            return {}, []
        pooled = sorted(tail.ratios)
        return {q: quantile(pooled, QUANTILE_LEVELS[q]) for q in _names(self.policy) if q != "p50"}, pooled

    def _ratio_baseline(self, track: _Track) -> dict[str, float] | None:
        """The learned baseline of the ratio percentiles, or None while still learning."""
        if len(track.healthy) < self.policy.baseline_windows:
            return None
        return {q: statistics.median(w.ratios[q] for w in track.healthy if w.ratios is not None)
                for q in _names(self.policy)}

    def baseline(self, model: str) -> dict[str, float] | None:
        """The baseline percentiles (s) for the last judged window's traffic mix, or None while learning."""
        track = self._tracks.get(model)
        return None if track is None else self._expected(track)

    def healthy_classes(self, model: str) -> dict[str, dict[str, Any]] | None:
        """The size classes of ``model``'s (a series key) last healthy window, or None (what a regression's mix is
        compared with)."""
        track = self._tracks.get(model)
        return track.healthy[-1].classes if track is not None and track.healthy else None

    def views(self) -> Iterator[tuple[str, WindowStats | None, dict[str, float] | None, bool, int]]:
        """(model, last window, baseline, active, regressions) for every series seen."""
        for model, track in list(self._tracks.items()):
            yield model, track.last, self.baseline(model), track.active, track.regressions

    def classes(self, model: str) -> dict[str, bool]:
        """Size classes of a series with a reference, by label: True for those an active regression named."""
        track = self._tracks.get(model)
        if track is None:
            return {}
        named = set(track.active_classes) if track.active else set()
        return {class_label(c): class_label(c) in named for c, k in sorted(track.classes.items())
                if k.median is not None}


def _worst_class(stats: WindowStats) -> tuple[str, ...]:
    """The class with the largest median ratio (with at least 3 samples), when no class crossed on its own."""
    ranked = sorted(((c["ratio_p50"], label) for label, c in stats.classes.items()
                     if c["ratio_p50"] is not None and c["samples"] >= 3), reverse=True)
    return (ranked[0][1],) if ranked else ()


def _min_count(level: float) -> int:
    """Samples a window needs for its ``level`` quantile to be more than its maximum."""
    return math.ceil(1.0 / (1.0 - level) - 1e-9)


def _names(policy: RegressionPolicy) -> tuple[str, ...]:
    """Percentiles to compute: the triggering ones plus p50 and p99 for display."""
    return tuple(dict.fromkeys(("p50", "p99", *policy.quantiles)))
