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
ones an hourly cap of their own. A profiler that is already running (the user's own) is never
touched: starting a nested session silently wipes the outer one.
"""

from __future__ import annotations

import collections
import gzip
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any, Protocol

from .exceptions import CaptureBusy, CaptureRateLimited
from .faults import InternalErrors
from .roofline import Peaks, op_summary
from .selfcost import AgentCpu
from .traces import TraceStore, new_id, worker_name

__all__ = [
    "TRANSITIONS", "Capture", "CaptureController", "CaptureOptions", "profiler_active",
    "torch_profiler", "warm_up_profiler",
]

IDLE, ARMED, RECORDING, EXPORTING = "idle", "armed", "recording", "exporting"

#: (state, event) -> next state; anything else is a bug.
TRANSITIONS: dict[tuple[str, str], str] = {
    (IDLE, "arm"): ARMED,
    (ARMED, "start"): RECORDING,
    (ARMED, "cancel"): IDLE,
    (RECORDING, "stop"): EXPORTING,
    (RECORDING, "fail"): IDLE,
    (EXPORTING, "done"): IDLE,
}

SUPPRESS_REASONS = ("cooldown", "rate_limit", "busy")
MAX_STEPS = 100
MAX_SECONDS = 60.0
TOP_OPS = 25


@dataclass(frozen=True, kw_only=True)
class CaptureOptions:
    steps: int = 5
    max_seconds: float = 10.0
    record_shapes: bool = True
    with_stack: bool = False
    profile_memory: bool = False


@dataclass
class Capture:
    """One capture's metadata (what ``/profiles/{id}`` shows). Times are UTC ISO 8601."""

    id: str
    model: str
    trigger: str  # "regression" | "manual"
    reason: dict[str, Any]
    options: CaptureOptions
    device: str
    status: str = ARMED
    outcome: str | None = None  # "ok" | "failed" | "aborted"
    error: str | None = None
    armed_at: str = ""
    started_at: str | None = None
    ended_at: str | None = None
    duration_seconds: float | None = None
    steps_recorded: int = 0
    thread: str | None = None
    summary: list[dict[str, Any]] = field(default_factory=list)
    #: Window totals: FLOPs, achieved FLOP/s, the peaks used and where they came from, MFU on GPU.
    compute: dict[str, Any] = field(default_factory=dict)

    def public(self) -> dict[str, Any]:
        d = asdict(self)
        d["options"] = asdict(self.options)
        return d


class Profiler(Protocol):
    def start(self) -> None: ...
    def stop(self) -> None: ...
    def export_chrome_trace(self, path: str) -> None: ...
    def events(self) -> Any: ...


#: Builds a profiler for a capture: (options, record CUDA activity) -> Profiler.
ProfilerFactory = Callable[[CaptureOptions, bool], Profiler]


def torch_profiler(options: CaptureOptions, cuda: bool) -> Profiler:
    """The real one: torch.profiler with CPU (and CUDA) activity."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    # with_flops costs nothing measurable here (5 steps of an 8-layer MLP: 5.3-5.8 ms either way).
    return profile(activities=activities, record_shapes=options.record_shapes,  # type: ignore[no-any-return]
                   with_stack=options.with_stack, profile_memory=options.profile_memory, with_flops=True)


def profiler_active() -> bool:
    """True while any torch profiler runs: the global Python flag (any thread) or this thread's session."""
    try:
        import torch
        from torch.autograd import profiler as autograd_profiler

        return bool(getattr(autograd_profiler, "_is_profiler_enabled", False)
                    or torch._C._autograd._profiler_enabled())
    except Exception:  # pragma: no cover - private API moved: assume busy rather than break a session
        return True


def warm_up_profiler() -> float:
    """Start and stop a profiler once on this thread; returns seconds taken.

    The first profiler start in a process initialises Kineto (measured 1.1-1.3 s here); doing it
    at Monitor.start(), before traffic, keeps that stall off the first capture's request.
    """
    if profiler_active():
        return 0.0
    t0 = time.perf_counter()
    prof = torch_profiler(CaptureOptions(record_shapes=False), cuda=False)
    prof.start()
    prof.stop()
    return time.perf_counter() - t0


def _now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


class CaptureController:
    """Owns the one capture slot of a monitor, its limits and its export thread."""

    def __init__(
        self,
        store: TraceStore,
        *,
        internal: InternalErrors,
        log: Any = None,
        cooldown_seconds: float = 600.0,
        max_auto_per_hour: int = 4,
        max_manual_per_hour: int = 30,
        arm_timeout_seconds: float = 60.0,
        profiler_factory: ProfilerFactory = torch_profiler,
        clock: Callable[[], float] = time.monotonic,
        cpu: AgentCpu | None = None,
        peaks: Callable[[str], Peaks | None] = lambda device: None,
    ) -> None:
        self._peaks = peaks
        self._cpu = cpu if cpu is not None else AgentCpu()
        self.store = store
        self._internal = internal
        self._log = log
        self.cooldown = cooldown_seconds
        self.max_auto = max_auto_per_hour
        self.max_manual = max_manual_per_hour
        self.arm_timeout = arm_timeout_seconds
        self._make_profiler = profiler_factory
        self._clock = clock
        self._auto: collections.deque[float] = collections.deque()
        self._manual: collections.deque[float] = collections.deque()
        self._last_auto: float | None = None
        self.reset_after_fork()

    def reset_after_fork(self) -> None:
        """The capture slot and its counts, fresh (at construction, and in a forked child: the
        parent's capture and profiler are the parent's)."""
        self._lock = threading.Lock()
        self.state = IDLE
        self.current: Capture | None = None
        self._state_ref: Any = None  # the ModelState being captured
        self._prof: Profiler | None = None
        self._thread_id: int | None = None
        self._armed_t = 0.0
        self._start_t = 0.0
        self._abort = False
        self._exporter: threading.Thread | None = None
        #: Exposed by the metrics collector.
        self.suppressed = dict.fromkeys(SUPPRESS_REASONS, 0)
        self.finished: dict[tuple[str, str, str], int] = {}
        self.last_finished: dict[tuple[str, str, str], float] = {}  # unix seconds
        self.duration_sum = 0.0  # seconds the profiler windows were open, all captures
        self.duration_count = 0

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
        """Arm a capture of ``st``'s model; raises CaptureBusy or CaptureRateLimited."""
        now = self._clock()
        with self._lock:
            if self.state != IDLE:
                cur = self.current
                raise CaptureBusy(f"a capture is {self.state}", cur.id if cur else None)
            if profiler_active():
                raise CaptureBusy("another torch profiler is running in this process; perfmon will not nest one "
                           "(a nested session silently wipes the outer one)", None)
            if trigger == "manual":
                self._check_rate(self._manual, self.max_manual, now, "rate_limit")
            else:
                if self._last_auto is not None and now - self._last_auto < self.cooldown:
                    raise CaptureRateLimited("automatic capture cooldown", self._last_auto + self.cooldown - now,
                                      "cooldown")
                self._check_rate(self._auto, self.max_auto, now, "rate_limit")
            cap = Capture(id=new_id(), model=st.name, trigger=trigger, reason=reason, options=options,
                          device=st.device, armed_at=_now_iso())
            self.current = cap
            self._state_ref = st
            self._abort = False
            self._armed_t = now
            self._move("arm")
            (self._manual if trigger == "manual" else self._auto).append(now)
            if trigger != "manual":
                self._last_auto = now
            # Route the model's next call to the slow path, where the capture starts.
            st.capture = self
            st.next_index = 0
        if self._log is not None:
            self._log.info("capture_armed", id=cap.id, model=cap.model, trigger=trigger, steps=options.steps)
        return cap

    def _check_rate(self, times: collections.deque[float], limit: int, now: float, reason: str) -> None:
        while times and now - times[0] >= 3600.0:
            times.popleft()
        if len(times) >= limit:
            raise CaptureRateLimited(f"at most {limit} captures per hour", times[0] + 3600.0 - now, reason)

    def auto(self, st: Any, options: CaptureOptions, reason: dict[str, Any]) -> Capture | None:
        """Arm an automatic capture, or count why not."""
        try:
            return self.arm(st, options, trigger="regression", reason=reason)
        except CaptureBusy:
            self.suppressed["busy"] += 1
        except CaptureRateLimited as exc:
            self.suppressed[exc.reason] += 1
        return None

    # -- the request thread ---------------------------------------------------------------

    def call(self, st: Any, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run one call of a model with a capture pending; starts/steps/stops the profiler as due."""
        me = threading.get_ident()
        if self.state == ARMED and self._state_ref is st:
            self._try_start(st, me)
        if self.state != RECORDING or self._thread_id != me or self._state_ref is not st:
            return fn(*args, **kwargs)  # another thread, or not capturing: untimed, unprofiled
        try:
            return fn(*args, **kwargs)
        finally:
            self._step(st)

    def _try_start(self, st: Any, me: int) -> None:
        with self._lock:
            if self.state != ARMED or self._state_ref is not st:
                return
            cap = self.current
            assert cap is not None
            if profiler_active():
                self._finish_locked(st, "failed", "another torch profiler started before the capture", "cancel")
                return
            try:
                cuda = getattr(st, "cuda_index", -1) >= 0
                prof = self._make_profiler(cap.options, cuda)
                prof.start()
            except Exception as exc:
                self._internal.report("capture", exc)
                self._finish_locked(st, "failed", f"profiler did not start: {type(exc).__name__}: {exc}", "cancel")
                return
            self._prof = prof
            self._thread_id = me
            self._start_t = self._clock()
            cap.started_at = _now_iso()
            cap.thread = threading.current_thread().name
            self._move("start")

    def _step(self, st: Any) -> None:
        cap = self.current
        if cap is None:
            return
        cap.steps_recorded += 1
        elapsed = self._clock() - self._start_t
        if cap.steps_recorded < cap.options.steps and elapsed < cap.options.max_seconds and not self._abort:
            return
        prof = self._prof
        try:
            assert prof is not None
            prof.stop()  # on the thread that started it
        except Exception as exc:
            self._internal.report("capture", exc)
            with self._lock:
                self._finish_locked(st, "failed", f"profiler did not stop: {type(exc).__name__}: {exc}", "fail")
            return
        with self._lock:
            cap.duration_seconds = elapsed
            cap.ended_at = _now_iso()
            self._release_model(st)
            self._move("stop")
            self._prof = None
        aborted = self._abort
        self._exporter = threading.Thread(target=self._export_measured, args=(cap, prof, aborted),
                                          name="perfmon-capture-export", daemon=True)
        self._exporter.start()

    def _release_model(self, st: Any) -> None:
        st.capture = None
        st.next_index = 0  # the next call is timed normally and resets the sampling stride
        self._state_ref = None
        self._thread_id = None

    def _finish_locked(self, st: Any, outcome: str, error: str | None, event: str) -> None:
        """End a capture that produced no trace (never started, or broke); stores its metadata."""
        cap = self.current
        assert cap is not None
        cap.ended_at = _now_iso()
        self._release_model(st)
        self._prof = None
        try:
            self.store.save({**cap.public(), "status": "done", "outcome": outcome, "error": error}, None, None)
        except Exception as exc:
            self._internal.report("trace_store", exc)
        cap.outcome, cap.error = outcome, error
        self._move(event)
        self._record(cap)
        self.current = None

    # -- export (background) --------------------------------------------------------------

    def _export_measured(self, cap: Capture, prof: Profiler, aborted: bool) -> None:
        with self._cpu.measure("capture_export"):
            self._export(cap, prof, aborted)

    def _export(self, cap: Capture, prof: Profiler, aborted: bool) -> None:
        # The outcome is published only once the files are in place: a client that sees "ok"
        # can download the trace at once.
        tmp = None
        trace = name = None
        outcome, error = ("aborted" if aborted else "ok"), None
        summary: list[dict[str, Any]] = []
        compute: dict[str, Any] = {}
        try:
            tmp = self.store.temp_path(cap.id, "json")
            prof.export_chrome_trace(str(tmp))
            trace = gzip.compress(tmp.read_bytes(), compresslevel=6)
            name = f"{worker_name()}.{time.time_ns()}.pt.trace.json.gz"
            summary, compute = op_summary(prof.events(), cuda=cap.device.startswith("cuda"),
                                          peaks=self._peaks(cap.device), window_seconds=cap.duration_seconds,
                                          limit=TOP_OPS)
        except Exception as exc:
            self._internal.report("capture_export", exc)
            outcome, error = "failed", f"export failed: {type(exc).__name__}: {exc}"
            trace = name = None
        finally:
            if tmp is not None:
                tmp.unlink(missing_ok=True)
        final = {**cap.public(), "status": "done", "outcome": outcome, "error": error, "summary": summary,
                 "compute": compute}
        try:
            stored = self.store.save(final, trace, name)
        except Exception as exc:  # disk full, unwritable directory: nothing partial is listed
            self._internal.report("trace_store", exc)
            outcome, error = "failed", f"store failed: {type(exc).__name__}: {exc}"
            stored = {**final, "outcome": outcome, "error": error}
            try:
                self.store.save(stored, None, None)
            except Exception:
                pass
        with self._lock:
            cap.summary, cap.compute, cap.outcome, cap.error = summary, compute, outcome, error
            self._record(cap)
            self.current = None
            self._move("done")
        if self._log is not None:
            self._log.info("capture_done", id=cap.id, model=cap.model, outcome=outcome, error=error,
                           steps=cap.steps_recorded, trace=stored.get("trace_file"))

    def _record(self, cap: Capture) -> None:
        key = (cap.model, cap.trigger, cap.outcome or "failed")
        self.finished[key] = self.finished.get(key, 0) + 1
        self.last_finished[key] = time.time()
        if cap.duration_seconds is not None:
            self.duration_sum += cap.duration_seconds
            self.duration_count += 1

    # -- housekeeping (resolver thread) and shutdown --------------------------------------

    def tick(self) -> None:
        """Expire a capture armed for too long with no call of its model."""
        with self._lock:
            if self.state == ARMED and self._clock() - self._armed_t > self.arm_timeout:
                self._finish_locked(self._state_ref, "aborted",
                                    f"no call of the model within {self.arm_timeout:g} s of arming", "cancel")

    def view(self, capture_id: str) -> dict[str, Any] | None:
        """The in-flight capture's metadata if it has this id."""
        cap = self.current
        if cap is not None and cap.id == capture_id:
            return cap.public()
        return None

    def stop(self, timeout_seconds: float) -> None:
        """Cancel an armed capture; ask a recording one to end at its thread's next call; wait for export."""
        deadline = self._clock() + timeout_seconds
        with self._lock:
            if self.state == ARMED:
                self._finish_locked(self._state_ref, "aborted", "monitor stopped", "cancel")
            elif self.state == RECORDING:
                self._abort = True
        while self.state == RECORDING and self._clock() < deadline:
            time.sleep(0.01)
        if self.state == RECORDING and self._log is not None:
            self._log.warning("capture_still_recording", id=self.current.id if self.current else None,
                              note="the profiler stops at the capturing thread's next call of the model")
        exporter = self._exporter
        if exporter is not None:
            exporter.join(max(0.0, deadline - self._clock()))
