"""Whether a capture may be armed now: an hourly cap per trigger, and the cooldown of automatic ones.

Each trigger has its own hourly cap; ``regression`` alone has the automatic cooldown (a baseline neither
waits for it nor starts it: a reference taken while the model is healthy must not delay the capture of
a regression that follows it). The controller calls ``check`` and ``take`` under its lock.
"""

from __future__ import annotations

import collections

from ..exceptions import CaptureRateLimited

__all__ = ["CaptureLimits"]


class CaptureLimits:
    """The arm times of the last hour per trigger, and the time of the last automatic capture."""

    def __init__(self, *, cooldown_seconds: float, max_auto_per_hour: int, max_manual_per_hour: int,
                 max_baseline_per_hour: int) -> None:
        self.cooldown = cooldown_seconds
        self.max_auto = max_auto_per_hour
        self.max_manual = max_manual_per_hour
        self.max_baseline = max_baseline_per_hour
        self._auto: collections.deque[float] = collections.deque()
        self._manual: collections.deque[float] = collections.deque()
        self._baseline: collections.deque[float] = collections.deque()
        self.last_auto: float | None = None

    def check(self, trigger: str, now: float) -> None:
        """Raise ``CaptureRateLimited`` (reason "cooldown" or "rate_limit") if ``trigger`` may not arm now."""
        if trigger == "regression" and self.last_auto is not None and now - self.last_auto < self.cooldown:
            raise CaptureRateLimited("automatic capture cooldown", self.last_auto + self.cooldown - now,
                                     "cooldown")
        times, limit = self._bucket(trigger)
        while times and now - times[0] >= 3600.0:
            times.popleft()
        if len(times) >= limit:
            raise CaptureRateLimited(f"at most {limit} captures per hour", times[0] + 3600.0 - now, "rate_limit")

    def cooldown_left(self, now: float) -> float:
        """Seconds until the automatic cooldown lets a ``regression`` capture arm (0 when it would now)."""
        if self.last_auto is None:
            return 0.0
        return max(0.0, self.last_auto + self.cooldown - now)

    def take(self, trigger: str, now: float) -> None:
        """Count a capture of ``trigger`` armed at ``now`` (after ``check`` let it through)."""
        self._bucket(trigger)[0].append(now)
        if trigger == "regression":
            self.last_auto = now

    def _bucket(self, trigger: str) -> tuple[collections.deque[float], int]:
        """The arm times of the last hour and the hourly cap that apply to ``trigger``."""
        if trigger == "manual":
            return self._manual, self.max_manual
        if trigger == "baseline":
            return self._baseline, self.max_baseline
        return self._auto, self.max_auto
