"""Errors perfmon raises to its caller.

perfmon raises only while it is being set up (configuration, wrapping). Once a model is wrapped,
nothing the agent does can raise into a request: failures are counted in
``perfmon_internal_errors_total{stage}`` and logged once instead.

Hierarchy::

    PerfmonError
     ├── ConfigError (also a ValueError)   a setting, environment variable or capture option is invalid
     ├── WrapError   (also a TypeError)    an object cannot be wrapped (already wrapped, not callable)
     ├── CaptureBusy                       a capture (or the user's own profiler) is already running
     ├── CaptureRateLimited                too many captures recently; ``retry_after`` says when to retry
     └── PortUnavailable (also an OSError) no port of the range could be bound and ``require_port`` is set
"""

from __future__ import annotations

__all__ = ["CaptureBusy", "CaptureRateLimited", "ConfigError", "PerfmonError", "PortUnavailable", "WrapError"]


class PerfmonError(Exception):
    """Base class of every error perfmon raises."""


class ConfigError(PerfmonError, ValueError):
    """A setting (keyword argument or ``PERFMON_*`` variable) is out of range or malformed."""


class WrapError(PerfmonError, TypeError):
    """The object handed to ``Monitor.wrap``/``instrument`` cannot be monitored as asked."""


class CaptureBusy(PerfmonError):
    """A capture is armed, recording or exporting, another torch profiler is running, or the monitor is stopped."""

    def __init__(self, message: str, running_id: str | None) -> None:
        super().__init__(message)
        #: The id of the capture in flight, when it is perfmon's.
        self.running_id = running_id


class CaptureRateLimited(PerfmonError):
    """Too many captures recently (``reason``: cooldown or rate_limit)."""

    def __init__(self, message: str, retry_after: float, reason: str) -> None:
        super().__init__(message)
        #: Seconds until the next capture is allowed.
        self.retry_after = retry_after
        self.reason = reason


class PortUnavailable(PerfmonError, OSError):
    """``start()`` found no free port in ``port .. port + port_range - 1`` and ``require_port=True``.

    Without ``require_port`` (the default) perfmon never fails the application's start for this: it
    logs an error naming the range, keeps counting and timing, and retries the bind in the background.
    """
