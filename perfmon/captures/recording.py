"""One capture's recording, on the thread that started it: the running profiler, the annotation around
each recorded call, this process's memory read after each call, and what ends the recording.

The recording ends at the first of: a stop request (``"stopped"``), memory growth past the recording's
share of ``max_bytes`` (``"max_bytes"``, see ``rss.recording_budget``), ``steps`` recorded calls
(``"steps"``), ``max_seconds`` (``"max_seconds"``). The controller decides when to start and stop it
(its state machine); this class holds what the serving thread uses meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable

from .profiler import Profiler, ProfilerFactory, Scope, quiet_kineto, step_annotation
from .records import Capture, CaptureOptions
from .rss import ResidentMemory, recording_budget

__all__ = ["Recording"]


class Recording:
    """A started profiler and what the serving thread reads and checks after each recorded call."""

    def __init__(self, prof: Profiler, *, scope: Scope, rss: ResidentMemory, rss0: int | None, thread_id: int,
                 started: float) -> None:
        self._prof: Profiler | None = prof
        #: torch's ``record_function``, looked up once per capture: one annotation per recorded call.
        self.scope = scope
        #: The thread that started the profiler: only its calls are recorded, and it stops it.
        self.thread_id = thread_id
        self._rss: ResidentMemory | None = rss
        self._rss0 = rss0
        self._started = started

    @classmethod
    def start(cls, make_profiler: ProfilerFactory, options: CaptureOptions, cuda: bool, *,
              memory: Callable[[], ResidentMemory], thread_id: int, clock: Callable[[], float]) -> Recording:
        """Build the profiler and start it on this thread; raises (leaving nothing open) if it cannot."""
        rss = None
        try:
            prof = make_profiler(options, cuda)
            scope = step_annotation()
            rss = memory()
            rss0 = rss.read()
            quiet_kineto(prof.start)
        except BaseException:
            if rss is not None:
                rss.close()
            raise
        return cls(prof, scope=scope, rss=rss, rss0=rss0, thread_id=thread_id, started=clock())

    def step(self, cap: Capture, now: float, *, abort: bool, max_bytes: int) -> float | None:
        """Count one recorded call of ``cap``; returns the seconds recorded when the recording is due to end
        (``cap.ended_by`` says why), else None."""
        cap.steps_recorded += 1
        elapsed = now - self._started
        rss = self._rss.read() if self._rss is not None else None
        if rss is not None and self._rss0 is not None:
            cap.memory_growth_bytes = rss - self._rss0
        if abort:
            cap.ended_by = "stopped"
        elif cap.memory_growth_bytes is not None and \
                cap.memory_growth_bytes > recording_budget(max_bytes, cap.options):
            cap.ended_by = "max_bytes"
        elif cap.steps_recorded >= cap.options.steps:
            cap.ended_by = "steps"
        elif elapsed >= cap.options.max_seconds:
            cap.ended_by = "max_seconds"
        else:
            return None
        return elapsed

    def stop(self) -> Profiler:
        """Stop the profiler (on the thread that started it) and hand it over; raises if it does not stop."""
        prof, self._prof = self._prof, None
        self.close()
        assert prof is not None
        quiet_kineto(prof.stop)  # on the thread that started it
        return prof

    def close(self) -> None:
        """Stop reading memory and let go of the profiler (a recording that broke, or ended)."""
        self._prof = None
        if self._rss is not None:
            self._rss.close()
            self._rss = None
