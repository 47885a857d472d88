"""Profiler captures: a short, bounded ``torch.profiler`` window on the serving thread.

A capture is armed (by the regression detector or over HTTP), starts at the next call of the
chosen model on whichever thread makes it (the profiler records the ops of the thread that starts
it, so it must start there), covers ``steps`` calls on that thread or ``max_seconds``, whichever
ends first, stops on that same thread (stopping from another thread leaves the profiler's callbacks
attached to the first one), and is exported — Chrome trace, op summary — by a background thread.

The life of a capture is a transition table, as in torch.profiler::

    idle --arm--> armed --start--> recording --stop--> exporting --done--> idle
                  armed --cancel--> idle        recording --fail--> idle

One capture at a time per process. Automatic captures have a cooldown and an hourly cap; manual
ones an hourly cap of their own, and baseline ones too (``limits``). A profiler that is already
running (the user's own) is never touched: starting a nested session silently wipes the outer one.

Triggers: ``regression`` (the detector), ``manual`` (HTTP, CLI, ``Monitor.capture``) and ``baseline``
(a capture of the model while it is healthy, kept as the reference: ``latest_baseline``). Each
recorded model call runs inside a ``perfmon.step`` profiler annotation, so the export can say what
each op cost per call (``Capture.ops``); when a regression or manual capture of a model that has a
baseline finishes, ``perfmon.captures.compare`` diffs the two and the result is stored with it
(``Capture.comparison``).

What a capture may cost is bounded as well as its length: after each recorded step the serving
thread reads this process's resident memory (``/proc/self/statm``, a few µs) and ends the capture
early once its growth since the start, plus what ``stop()`` will add (estimated from measurements:
``rss.recording_budget``), would pass ``max_bytes`` (``ended_by: "max_bytes"``). The export
never builds torch's per-event Python objects in this process (``export``: a child process,
``perfmon/captures/trace_summary.py``, summarises the trace file). Kineto's ``USDT:`` lines, printed
to stderr at each profiler start and stop, are filtered out of fd 2 around those calls only (see
``profiler.quiet_kineto``).

The modules beside this one: ``records`` (options, metadata, vocabulary), ``profiler`` (the one
torch.profiler user), ``rss`` (the memory bound), ``limits`` (caps and cooldown), ``counts`` (what
the metrics collector reads), ``export`` (the export thread's work).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from ..exceptions import CaptureBusy, CaptureRateLimited
from ..faults import InternalErrors
from ..selfcost import AgentCpu
from ..store.files import UnsafeTraceDir, new_id
from ..store.traces import TraceStore
from .counts import CaptureCounts
from .ending import CaptureEnds
from .export import EXPORT_MAX_MEMORY_BYTES, Exporter, latest_baseline
from .limits import CaptureLimits
from .profiler import Profiler, ProfilerFactory, profiler_active, profiler_warming, torch_profiler, wait_warm_up
from .recording import Recording
from .records import ARMED, EXPORTING, IDLE, RECORDING, TRIGGERS, Capture, CaptureOptions
from .roofline import Peaks
from .rss import ResidentMemory, recording_budget
from .trace_summary import STEP_ANNOTATION

__all__ = ["TRANSITIONS", "CaptureController"]

#: (state, event) -> next state; anything else is a bug.
TRANSITIONS: dict[tuple[str, str], str] = {
    (IDLE, "arm"): ARMED,
    (ARMED, "start"): RECORDING,
    (ARMED, "cancel"): IDLE,
    (RECORDING, "stop"): EXPORTING,
    (RECORDING, "fail"): IDLE,
    (EXPORTING, "done"): IDLE,
}


def _now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


class CaptureController(CaptureEnds):
    """Owns the one capture slot of a monitor, its limits and its export thread."""

    def __init__(self, store: TraceStore, *, internal: InternalErrors, log: Any = None, cooldown_seconds: float = 600.0,
                 max_auto_per_hour: int = 4, max_manual_per_hour: int = 30, max_baseline_per_hour: int = 4,
                 arm_timeout_seconds: float = 60.0, profiler_factory: ProfilerFactory = torch_profiler,
                 clock: Callable[[], float] = time.monotonic, cpu: AgentCpu | None = None,
                 peaks: Callable[[str], Peaks | None] = lambda device: None, max_bytes: int = 256 * 2**20,
                 export_timeout_seconds: float = 120.0, export_max_memory_bytes: int = EXPORT_MAX_MEMORY_BYTES,
                 memory: Callable[[], ResidentMemory] = ResidentMemory) -> None:
        #: Memory one capture may add (recording + stop), bytes; see ``recording_budget``.
        self.max_bytes = max_bytes
        self._memory = memory
        self._cpu = cpu if cpu is not None else AgentCpu()
        self.store = store
        self._internal = internal
        self._log = log
        self.limits = CaptureLimits(cooldown_seconds=cooldown_seconds, max_auto_per_hour=max_auto_per_hour,
                                    max_manual_per_hour=max_manual_per_hour,
                                    max_baseline_per_hour=max_baseline_per_hour)
        self.exporter = Exporter(store, internal=internal, cpu=self._cpu, peaks=peaks,
                                 timeout_seconds=export_timeout_seconds, max_memory_bytes=export_max_memory_bytes)
        self.arm_timeout = arm_timeout_seconds
        self._make_profiler = profiler_factory
        self.clock = clock  #: monotonic seconds: what the limits count in
        #: Why ``arm`` refuses every capture (the monitor stopped), or None. Set and read under ``_lock``: a
        #: ``capture()`` racing ``stop()``/``close()`` is refused or cancelled, never left armed in a stopped monitor.
        self._refusal: str | None = None
        self.reset_after_fork()

    def reset_after_fork(self) -> None:
        """The capture slot and its counts, fresh (at construction, and in a forked child: the
        parent's capture and profiler are the parent's)."""
        self._lock = threading.Lock()
        self.state = IDLE
        self.current: Capture | None = None
        self._state_ref: Any = None  # the ModelState being captured
        self._recording: Recording | None = None  # while the state is RECORDING
        self._armed_t = 0.0
        self._abort = False
        self._export_thread: threading.Thread | None = None
        self.counts = CaptureCounts()

    # -- state machine --------------------------------------------------------------------

    def _move(self, event: str) -> None:
        nxt = TRANSITIONS.get((self.state, event))
        if nxt is None:
            raise RuntimeError(f"capture: no transition from {self.state!r} on {event!r}")
        self.state = nxt
        if self.current is not None:
            self.current.status = nxt if nxt != IDLE else "done"

    # -- arming -----------------------------------------------------------------------------

    def arm(self, st: Any, options: CaptureOptions, *, trigger: str, reason: dict[str, Any]) -> Capture:
        """Arm a capture of ``st``'s model; raises CaptureBusy or CaptureRateLimited.

        ``trigger`` is one of ``TRIGGERS``. Each has its own hourly cap; ``regression`` alone has the
        automatic cooldown (``limits.CaptureLimits``).
        """
        if trigger not in TRIGGERS:
            raise ValueError(f"trigger={trigger!r}: expected one of {', '.join(TRIGGERS)}")
        now = self.clock()
        problem = self.store.problem()
        if problem is not None:  # a trace could not be stored: do not slow the model for nothing
            exc = UnsafeTraceDir(problem)
            self._internal.report("trace_store", exc)
            with self._lock:
                self.counts.ended(st.name, trigger, "failed")
            if self._log is not None:
                self._log.error("capture_refused", model=st.name, trigger=trigger, error=problem)
            raise exc
        with self._lock:
            if self._refusal is not None:
                raise CaptureBusy(self._refusal, None)
            if self.state != IDLE:
                cur = self.current
                raise CaptureBusy(f"a capture is {self.state}", cur.id if cur else None)
            if profiler_active() and not profiler_warming():  # (perfmon's warm-up: the capture waits for its end)
                raise CaptureBusy("another torch profiler is running in this process; perfmon will not nest one "
                           "(a nested session silently wipes the outer one)", None)
            self.limits.check(trigger, now)
            cap = Capture(id=new_id(), model=st.name, trigger=trigger, reason=reason, options=options,
                          device=st.device, armed_at=_now_iso())
            self.current = cap
            self._state_ref = st
            self._abort = False
            self._armed_t = now
            self._move("arm")
            self.limits.take(trigger, now)
            # Route the model's next call to the slow path, where the capture starts.
            for member in st.members():  # every stage of a generative model: prefill and decode steps
                member.capture = self
                member.next_index = 0
        if self._log is not None:
            self._log.info("capture_armed", id=cap.id, model=cap.model, trigger=trigger, steps=options.steps)
        return cap

    def auto(self, st: Any, options: CaptureOptions, reason: dict[str, Any]) -> Capture | None:
        """Arm an automatic capture, or count why not."""
        return self._arm_or_count(st, options, "regression", reason)

    def baseline(self, st: Any, options: CaptureOptions, reason: dict[str, Any]) -> Capture | None:
        """Arm a baseline capture of a healthy model (the reference later captures are compared with),
        or count why not in ``suppressed``; returns the capture or None."""
        return self._arm_or_count(st, options, "baseline", reason)

    def _arm_or_count(self, st: Any, options: CaptureOptions, trigger: str, reason: dict[str, Any]) -> Capture | None:
        try:
            return self.arm(st, options, trigger=trigger, reason=reason)
        except CaptureBusy:
            self.counts.suppressed["busy"] += 1
        except CaptureRateLimited as exc:
            self.counts.suppressed[exc.reason] += 1
        except UnsafeTraceDir:
            pass  # counted as a failed capture and an internal error by arm()
        return None

    def latest_baseline(self, model: str, size_class: str | None = None) -> dict[str, Any] | None:
        """``model``'s newest ok baseline capture (of ``size_class`` when given; ``export.latest_baseline``)."""
        return latest_baseline(self.store, model, size_class=size_class)

    # -- the request thread ---------------------------------------------------------------

    def call(self, st: Any, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
             work: int | None = None) -> Any:
        """Run one call with a capture pending (starts/steps/stops the profiler); ``work``: its ``step_sizes`` entry."""
        if self.state == ARMED and self._owns(st):
            self._try_start(st)
        rec = self._recording
        if self.state != RECORDING or rec is None or not rec.owned_here() or not self._owns(st):
            return fn(*args, **kwargs)  # another thread, or not capturing: untimed, unprofiled
        try:
            # One annotation per recorded call: the export attributes each op to its step by it. Only
            # here, while this thread records (a few µs under the profiler; never on other calls).
            with rec.scope(STEP_ANNOTATION):
                return fn(*args, **kwargs)
        finally:
            self._step(st, work)

    def _try_start(self, st: Any) -> None:
        # perfmon's warm-up on a thread of its own (a forked worker's): wait for its end outside the lock (a first
        # start would stall this call as long unprepared), bounded for all the calls together, not for each.
        wait_warm_up(WARM_UP_WAIT_SECONDS)
        with self._lock:
            if self.state != ARMED or not self._owns(st):
                return
            cap = self.current
            assert cap is not None
            rec = Recording.try_start(self._make_profiler, cap.options, getattr(st, "cuda_index", -1) >= 0,
                                      memory=self._memory, clock=self.clock)
            if rec is None:  # perfmon's warm-up runs (a forked worker's, on its own thread): the next call tries
                return
            if not isinstance(rec, Recording):
                if isinstance(rec, Exception):
                    self._internal.report("capture", rec)
                    rec = f"profiler did not start: {type(rec).__name__}: {rec}"
                self._finish_locked(st, "failed", rec, "cancel")
                return
            # A thread-per-request server's thread ends after its request: the recording ends with it,
            # on it (the one thread the profiler can be stopped on; see ``recording``).
            rec.on_thread_end(lambda: self._thread_ended(st))
            self._recording = rec
            cap.started_at = _now_iso()
            cap.thread = threading.current_thread().name
            self._move("start")

    def _step(self, st: Any, work: int | None = None) -> None:
        cap, rec = self.current, self._recording
        if cap is not None and rec is not None:
            elapsed = rec.step(cap, self.clock(), abort=self._abort, max_bytes=self.max_bytes, work=work)
            if elapsed is not None:
                self._end_recording(st, cap, rec, elapsed)

    def _thread_ended(self, st: Any) -> None:
        """The owner thread is exiting with the recording on (its locals' finaliser, on that thread)."""
        try:
            cap, rec = self.current, self._recording
            # At interpreter shutdown torch may be half torn down and no export thread can start: leave it.
            if self.state != RECORDING or cap is None or rec is None or sys.is_finalizing():
                return
            cap.ended_by = "thread_ended"
            self._end_recording(st, cap, rec, self.clock() - rec.started)
        except BaseException as exc:  # a finaliser must not raise: Python would only print it
            self._internal.report("capture", exc)

    def _end_recording(self, st: Any, cap: Capture, rec: Recording, elapsed: float) -> None:
        """Stop the profiler (on its own thread: the caller is it) and hand the result to the export thread."""
        try:
            prof = rec.stop()
        except Exception as exc:
            self._internal.report("capture", exc)
            with self._lock:
                self._finish_locked(st, "failed", f"profiler did not stop: {type(exc).__name__}: {exc}", "fail")
            return
        # The export thread takes the profiler out of this list, so that no frame or Thread
        # attribute keeps it (and the gigabyte it may hold) alive once the trace is written.
        held = [prof]
        del prof
        with self._lock:
            cap.duration_seconds = elapsed
            cap.ended_at = _now_iso()
            self._release_model(st)
            self._move("stop")
            # Started with the move to exporting: stop() reads both under this lock, so it sees a recording still
            # or a thread it can join (it joined one not yet started, which raises).
            self._export_thread = _exporter(self._export, cap, held, self._abort)
            del held
            self._export_thread.start()
        if self._log is not None and cap.ended_by == "max_bytes":
            _warn_cut(self._log, cap, self.max_bytes)

    def _owns(self, st: Any) -> bool:
        """``st`` is the model being captured, or one of its stages."""
        ref = self._state_ref
        return ref is st or (ref is not None and getattr(ref, "stages", None) is not None
                             and getattr(st, "stages", None) is ref.stages)

    def _release_model(self, st: Any) -> None:
        for member in (self._state_ref if self._state_ref is not None else st).members():
            member.capture = None
            member.next_index = 0  # the next call is timed normally and resets the sampling stride
        self._state_ref = None
        if self._recording is not None:
            self._recording.close()
            self._recording = None

    def _finish_locked(self, st: Any, outcome: str, error: str | None, event: str) -> None:
        """End a capture that produced no trace (never started, or broke); stores its metadata."""
        cap = self.current
        assert cap is not None
        cap.ended_at = _now_iso()
        self._release_model(st)
        cap.outcome, cap.error = outcome, error
        try:
            self.store.save({**cap.public(), "status": "done"}, None, None)
        except Exception as exc:
            self._internal.report("trace_store", exc)
            self.exporter.unstored.appendleft({**cap.public(), "status": "done"})
        self._move(event)
        self.counts.record(cap)
        self.current = None

    # -- export (background) --------------------------------------------------------------

    def _export(self, cap: Capture, holder: list[Profiler], aborted: bool) -> None:
        """The export thread: files in place (``Exporter.export``), then the outcome is published, so a
        client that sees "ok" can download the trace at once."""
        with self._cpu.measure("capture_export"):
            done = self.exporter.export(cap, holder, aborted)
            with self._lock:
                cap.summary, cap.compute, cap.outcome, cap.error = done.summary, done.compute, done.outcome, done.error
                cap.ops, cap.steps, cap.comparison = done.ops, done.steps, done.comparison
                self.counts.record(cap)
                self.current = None
                self._move("done")
            if self._log is not None:
                self._log.info("capture_done", id=cap.id, model=cap.model, outcome=done.outcome, error=done.error,
                               steps=cap.steps_recorded, ended_by=cap.ended_by, trace=done.stored.get("trace_file"),
                               trace_bytes=done.stored.get("trace_bytes"))


#: How long the calls that would start an armed capture wait for perfmon's warm-up to end (seconds, counted from the
#: first of them, in all); then they run unrecorded and the capture stays armed for a call after the warm-up.
WARM_UP_WAIT_SECONDS = 2.0


def _exporter(target: Callable[..., None], *args: Any) -> threading.Thread:
    """The export thread. daemon=True given, not inherited: inheriting reads threading.current_thread(), which on an
    exiting thread (``_thread_ended``) would register a stray dummy thread."""
    return threading.Thread(target=target, args=args, name="perfmon-capture-export", daemon=True)


def _warn_cut(log: Any, cap: Capture, max_bytes: int) -> None:
    """A capture ended by its memory budget: say so (its steps, growth and budget)."""
    log.warning("capture_cut", id=cap.id, model=cap.model, steps=cap.steps_recorded,
                memory_growth_bytes=cap.memory_growth_bytes, max_bytes=max_bytes,
                recording_budget_bytes=recording_budget(max_bytes, cap.options))
