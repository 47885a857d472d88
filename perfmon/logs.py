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
import threading
from typing import Any, TextIO

import structlog

__all__ = ["LineWriter", "make_logger"]


class LineWriter:
    """structlog's final logger for perfmon's own events: one rendered line per event, written and flushed
    under a lock. Unlike ``structlog.PrintLogger`` it never raises: a closed or broken stream (a test's captured
    stderr after it ends, a daemon's stderr pointing at a closed pipe) loses the line and counts it in
    ``lost``, so ``stop()`` or a background thread is never broken by a log line."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.lost = 0
        self._lock = threading.Lock()

    def msg(self, message: str) -> None:
        """Write ``message`` and a newline; on a closed or failing stream, count the line as lost."""
        try:
            with self._lock:
                self.stream.write(message + "\n")
                self.stream.flush()
        except (OSError, ValueError):  # ValueError: "I/O operation on closed file"
            self.lost += 1

    log = debug = info = warn = warning = msg
    fatal = failure = err = error = critical = exception = msg


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
        LineWriter(out),
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
