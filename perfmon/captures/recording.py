"""One capture's recording, on the thread that started it: the running profiler, the annotation around
each recorded call, this process's memory read after each call, and what ends the recording.

The recording ends at the first of: a stop request (``"stopped"``), memory growth past the recording's
share of ``max_bytes`` (``"max_bytes"``, see ``rss.recording_budget``), ``steps`` recorded calls
(``"steps"``), ``max_seconds`` (``"max_seconds"``), or the end of the thread that started it
(``"thread_ended"``). The controller decides when to start and stop it (its state machine); this class
holds what the serving thread uses meanwhile.

**Which thread owns it.** torch's profiler records the ops of the thread that started it and must be
stopped on that same OS thread: stopped anywhere else, torch has already torn the session down with
the thread and ``export_chrome_trace`` segfaults (measured: exit 139, 3 of 3 runs under a stdlib
``ThreadingHTTPServer``). ``threading.get_ident()`` is no proof of "the same thread": a thread-per-request
server's next thread often gets the ident of the one that just ended. The owner is instead marked by an
entry in a ``threading.local``, which a new thread never sees, whatever its ident.

**A thread that ends while recording** (every request thread of ``ThreadingHTTPServer``, werkzeug's
threaded server, Django's runserver): CPython clears a thread's ``threading.local`` entries on that
thread as it exits, so the entry's finaliser (``_ThreadEnd``) runs on the owner, after its last call,
and ends the recording there, the one place the profiler can be stopped. On such a server a capture
covers the calls of one request.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable

from .profiler import Profiler, ProfilerFactory, Scope, exclusive_start, profiler_active, quiet_kineto, step_annotation
from .records import Capture, CaptureOptions
from .rss import ResidentMemory, recording_budget

__all__ = ["Recording"]


class _ThreadEnd:
    """Kept in the owner thread's ``threading.local``: its finaliser runs on that thread as it exits
    (CPython clears a thread's locals there), and calls ``callback`` unless the recording let go first.

    Not in a forked child: there the owner thread does not exist and its locals are cleared inside ``os.fork()``, on
    the forking thread, before any after-fork hook has reset the controller. Ending the recording there stopped the
    parent's profiler in the child and started an export thread mid-fork, which segfaulted in
    ``export_chrome_trace`` (every ``DataLoader`` worker forked while a capture recorded, 5 of 5)."""

    __slots__ = ("__weakref__", "callback", "pid")

    def __init__(self, callback: Callable[[], None] | None) -> None:
        self.callback = callback
        self.pid = os.getpid()

    def __del__(self) -> None:
        callback, self.callback = self.callback, None
        if callback is not None and os.getpid() == self.pid:
            callback()  # never raises: the controller reports its own failures


class Recording:
    """A started profiler and what the serving thread reads and checks after each recorded call."""

    def __init__(self, prof: Profiler, *, scope: Scope, rss: ResidentMemory, rss0: int | None,
                 started: float) -> None:
        self._prof: Profiler | None = prof
        #: torch's ``record_function``, looked up once per capture: one annotation per recorded call.
        self.scope = scope
        self._rss: ResidentMemory | None = rss
        self._rss0 = rss0
        #: When the profiler started (the controller's clock, seconds).
        self.started = started
        # The owner's mark: an entry only the thread that started the profiler sees (see the module doc).
        self._owner = threading.local()
        # A weak reference: the owner's local must hold the only strong one, or its end frees nothing.
        self._guard: weakref.ref[_ThreadEnd] | None = None

    def owned_here(self) -> bool:
        """True on the thread that started the profiler (only its calls are recorded, and it stops it)."""
        return getattr(self._owner, "guard", None) is not None

    def on_thread_end(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` on the owner thread as it exits, if the recording has not ended by then.
        Call this on the owner thread."""
        guard = _ThreadEnd(callback)
        self._owner.guard = guard
        self._guard = weakref.ref(guard)

    @classmethod
    def start(cls, make_profiler: ProfilerFactory, options: CaptureOptions, cuda: bool, *,
              memory: Callable[[], ResidentMemory], clock: Callable[[], float]) -> Recording:
        """Build the profiler and start it on this thread; raises (leaving nothing open) if it cannot."""
        rss = None
        try:
            prof = make_profiler(options, cuda)
            # A profiler may bring its own step annotation (perfmon.testing.FakeProfiler); torch's is record_function.
            scope = getattr(prof, "step_scope", None) or step_annotation()
            rss = memory()
            rss0 = rss.read()
            quiet_kineto(prof.start)
        except BaseException:
            if rss is not None:
                rss.close()
            raise
        return cls(prof, scope=scope, rss=rss, rss0=rss0, started=clock())

    @classmethod
    def try_start(cls, make_profiler: ProfilerFactory, options: CaptureOptions, cuda: bool, *,
                  memory: Callable[[], ResidentMemory],
                  clock: Callable[[], float]) -> Recording | Exception | str | None:
        """``start`` unless a profiler runs: the Recording; None while perfmon's own warm-up runs or starts (the
        capture stays armed: the model's next call tries again); why not (a str) when another torch profiler runs
        (a nested session silently wipes the outer one); the exception when the profiler did not start."""
        with exclusive_start() as free:
            if not free:
                return None
            if profiler_active():
                return "another torch profiler started before the capture"
            try:
                return cls.start(make_profiler, options, cuda, memory=memory, clock=clock)
            except Exception as exc:
                return exc

    def step(self, cap: Capture, now: float, *, abort: bool, max_bytes: int, work: int | None = None) -> float | None:
        """Count one recorded call of ``cap`` that did ``work`` (its size, for ``cap.step_sizes``: comparisons line
        captures up by it); returns the seconds recorded when the recording is due to end (``cap.ended_by`` says
        why), else None."""
        cap.steps_recorded += 1
        cap.step_sizes.append(work)
        elapsed = now - self.started
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
        """Stop reading memory and let go of the profiler (a recording that broke, or ended); from here on
        the owner thread's exit does nothing."""
        ref, self._guard = self._guard, None
        guard = ref() if ref is not None else None
        if guard is not None:
            # Disarmed before the local is dropped: dropping it from another thread would run the
            # finaliser there.
            guard.callback = None
        self._prof = None
        if self._rss is not None:
            self._rss.close()
            self._rss = None
