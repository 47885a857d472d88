"""What the agent itself costs, measured where it runs, bounded, and exported so production users see it.

Each background loop adds the CPU time its thread spent (``time.thread_time``, per-thread CPU
seconds) after every iteration; the HTTP server does the same per loop turn and spends from a
``CpuBudget``. The trace uploader also adds what fsspec's shared IO thread spent during each attempt
(async SDKs do their requests there; ``upload.io_thread_cpu``, 10 ms ticks). Reading any of it is a
dictionary copy; nothing here touches the request path.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["THREADS", "WAKING", "AgentCpu", "CpuBudget", "HttpShedding"]

#: The ``thread`` label values.
THREADS = ("resolver", "nvml", "http", "capture_export", "upload", "flop_count")
#: The threads that wake on their own (timeouts, polls): ``perfmon_agent_wakeups_total{thread}``.
WAKING = ("resolver", "nvml", "http", "upload", "health")


class AgentCpu:
    """CPU seconds per agent thread kind, and how often each background thread woke up.

    CPU seconds do not show what a wake costs the serving thread of a GIL-bound server: each wake takes
    the GIL from it at least once (a hand-off, tens of µs there, measured in benchmarks/agent_cost.py),
    whatever the wake then spends. So the background loops count their wakes too (``woke``).
    """

    def __init__(self) -> None:
        self.reset_after_fork()

    def reset_after_fork(self) -> None:
        self._seconds = dict.fromkeys(THREADS, 0.0)
        self._wakes = dict.fromkeys(WAKING, 0)
        self._lock = threading.Lock()

    def woke(self, thread: str) -> None:
        """Count one wake of a background thread (its loop's thread only: one writer per key, so no lock)."""
        self._wakes[thread] = self._wakes.get(thread, 0) + 1

    def wakes(self) -> dict[str, int]:
        """Wakes so far per background thread kind."""
        return dict(self._wakes)

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


class CpuBudget:
    """A token bucket of CPU seconds: on average ``fraction`` of one core, at most ``burst_seconds`` at once.

    The HTTP server charges what each loop turn cost (its thread's CPU time) and, while the bucket
    is in debt, stops reading sockets until it has refilled. Whatever the clients do, the agent's
    HTTP work then takes at most ``fraction`` of a core (plus one request's overshoot) from the
    model's process, and the kernel's accept queue holds the rest. Used by one thread: no lock.
    """

    def __init__(self, fraction: float, burst_seconds: float, *, resume_seconds: float = 0.01,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < fraction <= 1 or burst_seconds <= 0 or resume_seconds < 0:
            raise ValueError(f"need 0 < fraction <= 1, burst_seconds > 0, resume_seconds >= 0; got {fraction}, "
                             f"{burst_seconds}, {resume_seconds}")
        self.fraction = fraction
        self.burst = burst_seconds
        # Once in debt, wait until this much is back: work then resumes in batches worth doing (one
        # render answers every scrape that queued meanwhile) instead of one request per refill.
        self.resume = min(resume_seconds, burst_seconds)
        self._clock = clock
        self._tokens = burst_seconds
        self._at = clock()

    def _refill(self) -> None:
        now = self._clock()
        # max(0, ...): a clock that stepped back refills nothing rather than draining the bucket
        self._tokens = min(self.burst, self._tokens + max(0.0, now - self._at) * self.fraction)
        self._at = now

    def charge(self, cpu_seconds: float) -> None:
        """Spend ``cpu_seconds`` (the bucket may go into debt: a request is never cut short)."""
        self._refill()
        self._tokens -= cpu_seconds

    def available(self) -> float:
        """CPU seconds that may be spent now (negative while in debt)."""
        self._refill()
        return self._tokens

    def wait_seconds(self) -> float:
        """0 while not in debt; in debt, seconds until the bucket holds ``resume_seconds`` again."""
        self._refill()
        return 0.0 if self._tokens >= 0 else (self.resume - self._tokens) / self.fraction


#: Why the agent's HTTP server refused or cut a connection (the ``reason`` label values).
REFUSALS = ("busy", "evicted", "timeout", "throttled", "too_large", "bad_request")


class HttpShedding:
    """What the agent's HTTP server refused, and how long it paused for its CPU budget.

    Written by the server's one thread, read at scrape time (plain ints and floats under the GIL).
    """

    def __init__(self) -> None:
        self.reset_after_fork()

    def reset_after_fork(self) -> None:
        self.refused: dict[str, int] = dict.fromkeys(REFUSALS, 0)
        self.paused_seconds = 0.0
