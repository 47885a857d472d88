"""perfmon's structlog loggers.

perfmon is a library inside someone else's server, so it never reconfigures structlog globally.
By default it logs through a logger of its own: JSON lines, or readable console output when
stderr is a terminal. ``log_format="app"`` hands the events to the application's own structlog
configuration instead. Events are snake_case state changes (started, stopped, samples_dropped,
internal_error), never one per request.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

import structlog

__all__ = ["make_logger"]


def make_logger(log_format: str, level: str, *, component: str, stream: TextIO | None = None) -> Any:
    """A bound logger with ``component`` set."""
    if log_format == "app":
        return structlog.get_logger("perfmon").bind(component=component)
    out = stream if stream is not None else sys.stderr
    if log_format == "auto":
        log_format = "console" if getattr(out, "isatty", lambda: False)() else "json"
    renderer: Any
    if log_format == "console":
        renderer = structlog.dev.ConsoleRenderer(colors=False)
    else:
        renderer = structlog.processors.JSONRenderer()
    logger = structlog.wrap_logger(
        structlog.PrintLogger(out),
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        cache_logger_on_first_use=False,
    )
    return logger.bind(logger="perfmon", component=component)
