"""What the agent itself costs, measured where it runs and exported so production users see it.

Each background loop adds the CPU time its thread spent (``time.thread_time``, per-thread CPU
seconds) after every iteration; the HTTP handler does the same per request. Reading it is a
dictionary copy; nothing here touches the request path.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["AgentCpu"]

#: The ``thread`` label values.
THREADS = ("resolver", "nvml", "http", "capture_export")


class AgentCpu:
    """CPU seconds per agent thread kind."""

    def __init__(self) -> None:
        self._seconds = dict.fromkeys(THREADS, 0.0)
        self._lock = threading.Lock()

    def reset_after_fork(self) -> None:
        self._seconds = dict.fromkeys(THREADS, 0.0)
        self._lock = threading.Lock()

    def add(self, thread: str, seconds: float) -> None:
        with self._lock:
            self._seconds[thread] = self._seconds.get(thread, 0.0) + seconds

    @contextmanager
    def measure(self, thread: str) -> Iterator[None]:
        """Add the CPU time this thread spends inside the block."""
        t0 = time.thread_time()
        try:
            yield
        finally:
            self.add(thread, time.thread_time() - t0)

    def totals(self) -> dict[str, float]:
        with self._lock:
            return dict(self._seconds)
