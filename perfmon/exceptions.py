"""Errors perfmon raises to its caller.

perfmon raises only while it is being set up (configuration, wrapping). Once a model is wrapped,
nothing the agent does can raise into a request: failures are counted in
``perfmon_internal_errors_total{stage}`` and logged once instead.

Hierarchy::

    PerfmonError
     ├── ConfigError (also a ValueError)   a setting or environment variable is invalid
     └── WrapError   (also a TypeError)    an object cannot be wrapped (already wrapped, not callable)
"""

from __future__ import annotations

__all__ = ["ConfigError", "PerfmonError", "WrapError"]


class PerfmonError(Exception):
    """Base class of every error perfmon raises."""


class ConfigError(PerfmonError, ValueError):
    """A setting (keyword argument or ``PERFMON_*`` variable) is out of range or malformed."""


class WrapError(PerfmonError, TypeError):
    """The object handed to ``Monitor.wrap``/``instrument`` cannot be monitored as asked."""
