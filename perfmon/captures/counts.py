"""What the metrics collector reads about captures: how many ended how, when, for how long, why some
were never armed, and the top change of each kind's latest comparison with a baseline.

The controller updates these under its lock; the collector reads them through it at each scrape.
"""

from __future__ import annotations

import time

from .compare import headline
from .records import COMPARED_TRIGGERS, SUPPRESS_REASONS, Capture

__all__ = ["CaptureCounts"]


class CaptureCounts:
    """The counts of one capture controller (fresh at construction and in a forked child)."""

    def __init__(self) -> None:
        #: Exposed by the metrics collector.
        self.suppressed = dict.fromkeys(SUPPRESS_REASONS, 0)
        self.finished: dict[tuple[str, str, str], int] = {}
        self.last_finished: dict[tuple[str, str, str], float] = {}  # unix seconds
        self.duration_sum = 0.0  # seconds the profiler windows were open, all captures
        self.duration_count = 0
        #: (model, trigger) -> (op, status, added seconds per call): the top change of the latest ok
        #: capture of that kind, when it was compared with a baseline (exposed by the metrics collector).
        self.comparisons: dict[tuple[str, str], tuple[str, str, float]] = {}

    def ended(self, model: str, trigger: str, outcome: str) -> None:
        """Count one capture of ``model`` that ended with ``outcome`` (or was refused: "failed")."""
        key = (model, trigger, outcome)
        self.finished[key] = self.finished.get(key, 0) + 1
        self.last_finished[key] = time.time()

    def record(self, cap: Capture) -> None:
        """Count a finished capture: its outcome, its window's length, its comparison's top change."""
        self.ended(cap.model, cap.trigger, cap.outcome or "failed")
        if cap.outcome == "ok" and cap.trigger in COMPARED_TRIGGERS:
            # Follows the latest ok capture of this kind (as perfmon_capture_timestamp_seconds{outcome="ok"}
            # does), so a dashboard never pins an older capture's change on a newer one.
            key2 = (cap.model, cap.trigger)
            if cap.comparison and not cap.comparison.get("error"):
                top = headline(cap.comparison)
                self.comparisons[key2] = ("", "same", 0.0) if top is None else (
                    top["op"], top["status"], float(top["added_seconds_per_call"]))
            else:
                self.comparisons.pop(key2, None)
        if cap.duration_seconds is not None:
            self.duration_sum += cap.duration_seconds
            self.duration_count += 1

