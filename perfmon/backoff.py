"""The one retry schedule: how long to wait after n consecutive failures.

Every retry loop in perfmon asks this function: the NVML poller (``telemetry/nvml.py``), the trace uploader
(``store/uploader.py``), the fleet listing's reads (``store/remote.py``) and the agent port's rebind
(``http/ports.py``). A pure function of its arguments, so a schedule is tested by calling it
(``tests/test_backoff.py``), not by waiting.
"""

from __future__ import annotations

__all__ = ["backoff_seconds"]


def backoff_seconds(failures: int, *, initial: float, cap: float, jitter: float = 1.0) -> float:
    """Seconds before the next attempt after ``failures`` consecutive failures (>= 1): ``initial`` seconds
    after the first, doubled per further failure, capped at ``cap`` seconds, then scaled by
    ``0.5 + 0.5 * jitter``. ``jitter`` is a draw in 0..1 (``random.random()``, clamped), so a fleet does not
    retry in step: 0 halves the delay, 1 (the default: no jitter) leaves it whole."""
    exp = min(failures - 1, 60)  # 2**60 s is past any cap; no float overflow however long the outage
    return min(cap, initial * 2.0**exp) * (0.5 + 0.5 * min(max(jitter, 0.0), 1.0))
