"""RegressionPolicy: when a steady-state latency regression fires an automatic capture (validated settings).

The detector (detector.py) judges windows with it; the capture policy (policy.py) arms captures with its capture
options. Kept apart from the detector's logic: settings validated where they are born.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

from ..exceptions import ConfigError
from .records import MAX_SECONDS, MAX_STEPS

__all__ = ["QUANTILE_LEVELS", "RegressionPolicy"]

#: Percentile names a policy may trigger on -> quantile level.
QUANTILE_LEVELS = {"p50": 0.5, "p90": 0.9, "p95": 0.95, "p99": 0.99}


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
    #: Once a model's baseline is learned, one short ``baseline`` capture of it (the reference later
    #: regression and manual captures are compared with), taken again when older than the max age.
    baseline_capture: bool = True
    baseline_capture_max_age_seconds: float = 6 * 3600.0
    baseline_captures_per_hour: int = 4

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ConfigError:
            return ConfigError(f"RegressionPolicy {name}={getattr(self, name)!r}: {why}")

        for name in ("window_seconds", "cooldown_seconds", "capture_max_seconds", "baseline_capture_max_age_seconds"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
                raise bad(name, "must be a finite number of seconds > 0")
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)) or not 1.0 < self.ratio < math.inf:
            raise bad("ratio", "must be a number > 1")
        for name in ("min_samples", "consecutive", "baseline_windows", "max_captures_per_hour",
                     "baseline_captures_per_hour"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise bad(name, "must be an integer >= 1")
        if isinstance(self.capture_steps, bool) or not isinstance(self.capture_steps, int) \
                or not 1 <= self.capture_steps <= MAX_STEPS:
            raise bad("capture_steps", f"must be an integer 1..{MAX_STEPS}")
        # The capture's own bound (CaptureOptions): past it, every automatic capture would be refused.
        if self.capture_max_seconds > MAX_SECONDS:
            raise bad("capture_max_seconds", f"must be at most {MAX_SECONDS:g} seconds (a capture's bound)")
        if not self.quantiles or any(q not in QUANTILE_LEVELS for q in self.quantiles):
            raise bad("quantiles", f"must be a non-empty subset of {sorted(QUANTILE_LEVELS)}")
        object.__setattr__(self, "quantiles", tuple(self.quantiles))
        for name in ("capture_record_shapes", "capture_with_stack", "capture_profile_memory", "baseline_capture"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be true or false")
        if self.capture_with_stack or self.capture_profile_memory:
            warnings.warn("RegressionPolicy enables with_stack/profile_memory for automatic captures: they make "
                          "each capture several times heavier on the serving thread", stacklevel=3)
