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
ones an hourly cap of their own, and baseline ones too. A profiler that is already running (the
user's own) is never touched: starting a nested session silently wipes the outer one.

Triggers: ``regression`` (the detector), ``manual`` (HTTP, CLI, ``Monitor.capture``) and ``baseline``
(a capture of the model while it is healthy, kept as the reference: ``latest_baseline``). Each
recorded model call runs inside a ``perfmon.step`` profiler annotation, so the export can say what
each op cost per call (``Capture.ops``); when a regression or manual capture of a model that has a
baseline finishes, ``perfmon.captures.compare`` diffs the two and the result is stored with it
(``Capture.comparison``).

What a capture may cost is bounded as well as its length: after each recorded step the serving
thread reads this process's resident memory (``/proc/self/statm``, a few µs) and ends the capture
early once its growth since the start, plus what ``stop()`` will add (estimated from measurements:
``recording_budget``), would pass ``max_bytes`` (``ended_by: "max_bytes"``). The export
never builds torch's per-event Python objects in this process: the profiler writes its Chrome trace
(C++) to a private temp file and is dropped, and a child process (``perfmon/captures/trace_summary.py``, at
lower priority, address space capped, killed after ``export_timeout_seconds``) streams the file,
gzips it and returns the op summary; then this process collects garbage and hands freed heap back
to the OS (``malloc_trim``). A child that fails or is killed fails the capture; nothing partial is
listed. Kineto's ``USDT:`` lines, printed to stderr at each profiler start and stop, are filtered out
of fd 2 around those calls only (see ``quiet_kineto``).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import ctypes.util
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any, Protocol

from ..exceptions import CaptureBusy, CaptureRateLimited
from ..faults import InternalErrors
from ..selfcost import AgentCpu
from ..store.traces import TraceStore, UnsafeTraceDir, new_id, worker_name
from .compare import compare, headline
from .roofline import Peaks, summarise
from .trace_summary import STEP_ANNOTATION

__all__ = [
    "TRANSITIONS", "Capture", "CaptureController", "CaptureOptions", "ResidentMemory", "profiler_active",
    "quiet_kineto", "torch_profiler", "warm_up_profiler",
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
TRIGGERS = ("regression", "manual", "baseline")
#: Captures of these triggers are compared with their model's latest baseline when they finish.
COMPARED_TRIGGERS = ("regression", "manual")
MAX_STEPS = 100
MAX_SECONDS = 60.0
TOP_OPS = 25
#: Address-space cap of the export child (RLIMIT_AS). Measured: 52 MB peak RSS (VmHWM) and 1.9 s of
#: CPU for a 61 MB trace of 160,800 events (~90 bytes an event plus the interpreter); the cap leaves
#: room for ~5M events and stops a runaway well before it can hurt the pod.
EXPORT_MAX_MEMORY_BYTES = 512 * 2**20
#: How much more memory the profiler's stop() adds, per byte it grew while recording (it materialises
#: its results): measured on 67 steps of a 200-layer MLP, +280 MB after +270 MB recorded with default
#: options, +700 MB after +265 MB with with_stack and profile_memory. A capture's recording is cut at
#: ``max_bytes / (1 + factor)`` so that recording and stop together stay within ``max_bytes``.
STOP_GROWTH_FACTOR = 1.0
STOP_GROWTH_FACTOR_WITH_STACK = 2.6
_SUMMARY_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "trace_summary.py")


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
    trigger: str  # "regression" | "manual" | "baseline"
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
    #: What ended the recording: "steps", "max_seconds", "max_bytes" (memory bound) or "stopped".
    ended_by: str | None = None
    #: Growth of this process's resident memory while the profiler recorded, bytes (None: unknown).
    memory_growth_bytes: int | None = None
    thread: str | None = None
    summary: list[dict[str, Any]] = field(default_factory=list)
    #: Window totals: FLOPs, achieved FLOP/s, the peaks used and where they came from, MFU on GPU.
    compute: dict[str, Any] = field(default_factory=dict)
    #: The export: host events in the trace, seconds from recording end to files in place, the
    #: child's CPU seconds and peak RSS bytes.
    export: dict[str, Any] = field(default_factory=dict)
    #: Per op name, per recorded step (one model call): ``calls_per_step``, ``seconds_per_step`` (self
    #: device seconds on CUDA, self CPU seconds on CPU) and ``seconds_per_step_stdev`` over the steps;
    #: at most 200 names, the rest as ``[other]`` (``perfmon.captures.trace_summary.step_table``).
    ops: dict[str, dict[str, float]] = field(default_factory=dict)
    #: Steps the ``ops`` table averages over (the first recorded step is left out when there are two or more).
    steps: int = 0
    #: ``perfmon.captures.compare.compare(latest baseline, this capture)`` for a regression or manual capture of a
    #: model that had a baseline capture; None otherwise.
    comparison: dict[str, Any] | None = None

    def public(self) -> dict[str, Any]:
        d = asdict(self)
        d["options"] = asdict(self.options)
        return d


class Profiler(Protocol):
    def start(self) -> None: ...
    def stop(self) -> None: ...
    def export_chrome_trace(self, path: str) -> None: ...


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
    quiet_kineto(prof.start)
    quiet_kineto(prof.stop)
    return time.perf_counter() - t0


@contextlib.contextmanager
def _no_cycle_warning() -> Iterator[None]:
    """Ignore torch.profiler's "Profiler clears events at the end of each cycle" UserWarning.

    torch 2.11 warns at a profiler start (once per process) although perfmon records one cycle per
    profiler; under ``-W error`` (or pytest's ``filterwarnings = error``) the warning became an
    exception and the capture failed with "profiler did not start". ``catch_warnings`` swaps the
    process-wide filter list for the call; a start or stop is rare (one per capture), and another
    thread's warning raised inside that window is at worst filtered by the same one message.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Warning: Profiler clears events", category=UserWarning)
        yield


def quiet_kineto(fn: Callable[[], None]) -> None:
    """Run ``fn`` (a profiler start or stop) with Kineto's ``USDT:`` stderr lines filtered out
    (and torch's one-cycle warning ignored: ``_no_cycle_warning``).

    Kineto logs ``USDT: ... profiler_start`` / ``profiler_stop`` at its USDT severity (5), above
    ERROR (4), so no ``KINETO_LOG_LEVEL`` hides them without also hiding Kineto's errors (6 hides
    everything), and the level is read once, at the first profiler start in the process. Instead,
    fd 2 points at an anonymous temp file for the duration of the call (a start ~1 ms; a stop as long
    as the stop, ~0.7 s at the default memory bound for a large model) and everything written there
    except lines starting ``USDT:`` is written back to the real stderr. Another thread's stderr output
    in that window is delayed, not lost; a process killed inside the window would lose it.
    """
    try:
        sys.stderr.flush()  # what Python has buffered goes out before the switch, in order
    except (AttributeError, OSError, ValueError):
        pass
    try:
        saved = os.dup(2)
    except OSError:  # no stderr at all: nothing to protect
        with _no_cycle_warning():
            fn()
        return
    ran = False
    data = b""
    try:
        with tempfile.TemporaryFile() as scratch:
            os.dup2(scratch.fileno(), 2)
            try:
                ran = True
                with _no_cycle_warning():
                    fn()
            finally:
                os.dup2(saved, 2)
                scratch.seek(0)
                data = scratch.read()
    except OSError:
        if ran:
            raise
    finally:
        os.close(saved)
        kept = b"".join(line for line in data.splitlines(keepends=True) if not line.startswith(b"USDT:"))
        while kept:
            try:
                kept = kept[os.write(2, kept):]
            except OSError:
                break
    if not ran:  # no temp file could be made: run it unfiltered
        fn()


class ResidentMemory:
    """This process's resident set size in bytes, cheaply: ``pread`` of ``/proc/self/statm``.

    Where there is no procfs, ``getrusage``'s peak RSS stands in (it only grows, so a bound on its
    growth is conservative); where neither exists, ``read()`` returns None and no byte bound applies.
    """

    def __init__(self, path: str = "/proc/self/statm") -> None:
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        try:
            self._fd: int | None = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._fd = None

    def read(self) -> int | None:
        if self._fd is not None:
            try:
                return int(os.pread(self._fd, 128, 0).split()[1]) * self._page
            except (OSError, IndexError, ValueError):
                pass
        try:
            import resource

            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            return peak if sys.platform == "darwin" else peak * 1024
        except (ImportError, OSError):
            return None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def recording_budget(max_bytes: int, options: CaptureOptions) -> int:
    """Bytes of RSS growth allowed while recording, so that recording plus stop() stay within ``max_bytes``."""
    factor = STOP_GROWTH_FACTOR_WITH_STACK if options.with_stack or options.profile_memory else STOP_GROWTH_FACTOR
    return int(max_bytes / (1.0 + factor))


def release_memory(*, collect: bool = True) -> None:
    """Collect garbage (the profiler sits in reference cycles: ``del`` alone frees nothing) and hand
    freed heap back to the OS (glibc ``malloc_trim``; elsewhere a no-op)."""
    if collect:
        gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


_TRIM: list[Any] = []


def _malloc_trim() -> Any:
    if not _TRIM:
        fn = None
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            fn = getattr(libc, "malloc_trim", None)
            if fn is not None:
                fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
        except OSError:
            fn = None
        _TRIM.append(fn)
    return _TRIM[0]


def _members(st: Any) -> list[Any]:
    """The states a capture of ``st``'s model arms: its stages', or its own."""
    stages = getattr(st, "stages", None)
    return list(stages.values()) if stages else [st]


def _no_scope(name: str) -> contextlib.AbstractContextManager[Any]:
    return contextlib.nullcontext()


def _record_function() -> Callable[[str], contextlib.AbstractContextManager[Any]]:
    """torch's ``record_function`` (a profiler annotation), looked up once per capture."""
    try:
        from torch.autograd.profiler import record_function
    except ImportError:  # pragma: no cover - perfmon runs with torch; a fake profiler may not need it
        return _no_scope
    return record_function  # type: ignore[no-any-return]


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
        max_baseline_per_hour: int = 4,
        arm_timeout_seconds: float = 60.0,
        profiler_factory: ProfilerFactory = torch_profiler,
        clock: Callable[[], float] = time.monotonic,
        cpu: AgentCpu | None = None,
        peaks: Callable[[str], Peaks | None] = lambda device: None,
        max_bytes: int = 256 * 2**20,
        export_timeout_seconds: float = 120.0,
        export_max_memory_bytes: int = EXPORT_MAX_MEMORY_BYTES,
        memory: Callable[[], ResidentMemory] = ResidentMemory,
    ) -> None:
        #: Memory one capture may add (recording + stop), bytes; see ``recording_budget``.
        self.max_bytes = max_bytes
        self.export_timeout = export_timeout_seconds
        self.export_max_memory = export_max_memory_bytes
        self._memory = memory
        self._peaks = peaks
        self._cpu = cpu if cpu is not None else AgentCpu()
        self.store = store
        self._internal = internal
        self._log = log
        self.cooldown = cooldown_seconds
        self.max_auto = max_auto_per_hour
        self.max_manual = max_manual_per_hour
        self.max_baseline = max_baseline_per_hour
        self.arm_timeout = arm_timeout_seconds
        self._make_profiler = profiler_factory
        self._clock = clock
        self._auto: collections.deque[float] = collections.deque()
        self._manual: collections.deque[float] = collections.deque()
        self._baseline: collections.deque[float] = collections.deque()
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
        self._rss: ResidentMemory | None = None
        self._rss0: int | None = None
        self._step_scope: Callable[[str], contextlib.AbstractContextManager[Any]] = _no_scope
        #: Exposed by the metrics collector.
        self.suppressed = dict.fromkeys(SUPPRESS_REASONS, 0)
        self.finished: dict[tuple[str, str, str], int] = {}
        self.last_finished: dict[tuple[str, str, str], float] = {}  # unix seconds
        self.duration_sum = 0.0  # seconds the profiler windows were open, all captures
        self.duration_count = 0
        #: (model, trigger) -> (op, status, added seconds per call): the top change of the latest ok
        #: capture of that kind, when it was compared with a baseline (exposed by the metrics collector).
        self.comparisons: dict[tuple[str, str], tuple[str, str, float]] = {}

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
        automatic cooldown (a baseline neither waits for it nor starts it: a reference taken while the
        model is healthy must not delay the capture of a regression that follows it).
        """
        if trigger not in TRIGGERS:
            raise ValueError(f"trigger={trigger!r}: expected one of {', '.join(TRIGGERS)}")
        now = self._clock()
        problem = self.store.problem()
        if problem is not None:  # a trace could not be stored: do not slow the model for nothing
            exc = UnsafeTraceDir(problem)
            self._internal.report("trace_store", exc)
            key = (st.name, trigger, "failed")
            with self._lock:
                self.finished[key] = self.finished.get(key, 0) + 1
                self.last_finished[key] = time.time()
            if self._log is not None:
                self._log.error("capture_refused", model=st.name, trigger=trigger, error=problem)
            raise exc
        with self._lock:
            if self.state != IDLE:
                cur = self.current
                raise CaptureBusy(f"a capture is {self.state}", cur.id if cur else None)
            if profiler_active():
                raise CaptureBusy("another torch profiler is running in this process; perfmon will not nest one "
                           "(a nested session silently wipes the outer one)", None)
            bucket = self._bucket(trigger)
            if trigger == "regression" and self._last_auto is not None and now - self._last_auto < self.cooldown:
                raise CaptureRateLimited("automatic capture cooldown", self._last_auto + self.cooldown - now,
                                         "cooldown")
            self._check_rate(bucket[0], bucket[1], now, "rate_limit")
            cap = Capture(id=new_id(), model=st.name, trigger=trigger, reason=reason, options=options,
                          device=st.device, armed_at=_now_iso())
            self.current = cap
            self._state_ref = st
            self._abort = False
            self._armed_t = now
            self._move("arm")
            bucket[0].append(now)
            if trigger == "regression":
                self._last_auto = now
            # Route the model's next call to the slow path, where the capture starts.
            for member in _members(st):  # every stage of a generative model: prefill and decode steps
                member.capture = self
                member.next_index = 0
        if self._log is not None:
            self._log.info("capture_armed", id=cap.id, model=cap.model, trigger=trigger, steps=options.steps)
        return cap

    def _bucket(self, trigger: str) -> tuple[collections.deque[float], int]:
        """The arm times of the last hour and the hourly cap that apply to ``trigger``."""
        if trigger == "manual":
            return self._manual, self.max_manual
        if trigger == "baseline":
            return self._baseline, self.max_baseline
        return self._auto, self.max_auto

    def _check_rate(self, times: collections.deque[float], limit: int, now: float, reason: str) -> None:
        while times and now - times[0] >= 3600.0:
            times.popleft()
        if len(times) >= limit:
            raise CaptureRateLimited(f"at most {limit} captures per hour", times[0] + 3600.0 - now, reason)

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
            self.suppressed["busy"] += 1
        except CaptureRateLimited as exc:
            self.suppressed[exc.reason] += 1
        except UnsafeTraceDir:
            pass  # counted as a failed capture and an internal error by arm()
        return None

    def latest_baseline(self, model: str) -> dict[str, Any] | None:
        """The stored metadata of ``model``'s newest baseline capture that finished ok with an op table,
        or None. Read from the trace store (retention keeps it), so it outlives this process; its
        ``ended_at`` (UTC ISO 8601) says when it was taken."""
        for meta in self.store.list():  # newest first
            if (meta.get("model") == model and meta.get("trigger") == "baseline" and meta.get("outcome") == "ok"
                    and meta.get("ops")):
                return meta
        return None

    # -- the request thread ---------------------------------------------------------------

    def call(self, st: Any, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run one call of a model with a capture pending; starts/steps/stops the profiler as due."""
        me = threading.get_ident()
        if self.state == ARMED and self._owns(st):
            self._try_start(st, me)
        if self.state != RECORDING or self._thread_id != me or not self._owns(st):
            return fn(*args, **kwargs)  # another thread, or not capturing: untimed, unprofiled
        try:
            # One annotation per recorded call: the export attributes each op to its step by it. Only
            # here, while this thread records (a few µs under the profiler; never on other calls).
            with self._step_scope(STEP_ANNOTATION):
                return fn(*args, **kwargs)
        finally:
            self._step(st)

    def _try_start(self, st: Any, me: int) -> None:
        with self._lock:
            if self.state != ARMED or not self._owns(st):
                return
            cap = self.current
            assert cap is not None
            if profiler_active():
                self._finish_locked(st, "failed", "another torch profiler started before the capture", "cancel")
                return
            try:
                cuda = getattr(st, "cuda_index", -1) >= 0
                prof = self._make_profiler(cap.options, cuda)
                self._step_scope = _record_function()
                self._rss = self._memory()
                self._rss0 = self._rss.read()
                quiet_kineto(prof.start)
            except Exception as exc:
                self._close_rss()
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
        rss = self._rss.read() if self._rss is not None else None
        if rss is not None and self._rss0 is not None:
            cap.memory_growth_bytes = rss - self._rss0
        if self._abort:
            cap.ended_by = "stopped"
        elif cap.memory_growth_bytes is not None and \
                cap.memory_growth_bytes > recording_budget(self.max_bytes, cap.options):
            cap.ended_by = "max_bytes"
        elif cap.steps_recorded >= cap.options.steps:
            cap.ended_by = "steps"
        elif elapsed >= cap.options.max_seconds:
            cap.ended_by = "max_seconds"
        else:
            return
        self._close_rss()
        prof = self._prof
        try:
            assert prof is not None
            quiet_kineto(prof.stop)  # on the thread that started it
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
        if self._log is not None and cap.ended_by == "max_bytes":
            self._log.warning("capture_cut", id=cap.id, model=cap.model, steps=cap.steps_recorded,
                              memory_growth_bytes=cap.memory_growth_bytes, max_bytes=self.max_bytes,
                              recording_budget_bytes=recording_budget(self.max_bytes, cap.options))
        aborted = self._abort
        # The export thread takes the profiler out of this list, so that no frame or Thread
        # attribute keeps it (and the gigabyte it may hold) alive once the trace is written.
        self._exporter = threading.Thread(target=self._export_measured, args=(cap, [prof], aborted),
                                          name="perfmon-capture-export", daemon=True)
        del prof
        self._exporter.start()

    def _close_rss(self) -> None:
        if self._rss is not None:
            self._rss.close()
            self._rss = None

    def _owns(self, st: Any) -> bool:
        """``st`` is the model being captured, or one of its stages."""
        ref = self._state_ref
        return ref is st or (ref is not None and getattr(ref, "stages", None) is not None
                             and getattr(st, "stages", None) is ref.stages)

    def _release_model(self, st: Any) -> None:
        for member in _members(self._state_ref if self._state_ref is not None else st):
            member.capture = None
            member.next_index = 0  # the next call is timed normally and resets the sampling stride
        self._state_ref = None
        self._thread_id = None

    def _finish_locked(self, st: Any, outcome: str, error: str | None, event: str) -> None:
        """End a capture that produced no trace (never started, or broke); stores its metadata."""
        cap = self.current
        assert cap is not None
        cap.ended_at = _now_iso()
        self._release_model(st)
        self._prof = None
        self._close_rss()
        try:
            self.store.save({**cap.public(), "status": "done", "outcome": outcome, "error": error}, None, None)
        except Exception as exc:
            self._internal.report("trace_store", exc)
        cap.outcome, cap.error = outcome, error
        self._move(event)
        self._record(cap)
        self.current = None

    # -- export (background) --------------------------------------------------------------

    def _export_measured(self, cap: Capture, holder: list[Profiler], aborted: bool) -> None:
        with self._cpu.measure("capture_export"):
            self._export(cap, holder, aborted)

    def _export(self, cap: Capture, holder: list[Profiler], aborted: bool) -> None:
        # The outcome is published only once the files are in place: a client that sees "ok"
        # can download the trace at once.
        t0 = time.monotonic()
        json_tmp = gz_tmp = None
        name = None
        outcome, error = ("aborted" if aborted else "ok"), None
        summary: list[dict[str, Any]] = []
        compute: dict[str, Any] = {}
        ops: dict[str, dict[str, float]] = {}
        steps = 0
        comparison: dict[str, Any] | None = None
        try:
            json_tmp, path = self.store.new_temp("json")
            prof = holder.pop()
            try:
                prof.export_chrome_trace(str(path))  # C++: Kineto writes the file itself
            finally:
                del prof  # the profiler's event buffers go with it
                release_memory()
            gz_tmp, _ = self.store.new_temp("gz")
            result = self._summarise_in_child(json_tmp, gz_tmp, device_time=cap.device.startswith("cuda"))
            self.store.remove_temp(json_tmp)
            json_tmp = None
            name = f"{worker_name()}.{time.time_ns()}.pt.trace.json.gz"
            # The window for achieved FLOP/s and MFU: the host's recording time, or the device's busy
            # span where that is longer (async CUDA work queued in the window runs on after it; with
            # the host window alone, MFU read 4.7 on an H100 for back-to-back matmuls).
            window = max(filter(None, (cap.duration_seconds, result.get("device_span_seconds"))), default=None)
            summary, compute = summarise(result["rows"], cuda=cap.device.startswith("cuda"),
                                         peaks=self._peaks(cap.device), window_seconds=window, limit=TOP_OPS)
            ops, steps = result.get("ops") or {}, int(result.get("steps") or 0)
            cap.export = {"trace_events": result.get("events"), "child_cpu_seconds": result.get("cpu_seconds"),
                          "child_max_rss_bytes": result.get("max_rss_bytes")}
        except Exception as exc:
            self._internal.report("capture_export", exc)
            outcome, error = "failed", f"export failed: {type(exc).__name__}: {exc}"
            name = None
        finally:
            holder.clear()
            for tmp in (json_tmp, gz_tmp if name is None else None):
                if tmp is not None:
                    self.store.remove_temp(tmp)
        if outcome == "ok" and cap.trigger in COMPARED_TRIGGERS:
            comparison = self._compare(cap, ops, steps)
        cap.export["seconds"] = round(time.monotonic() - t0, 3)
        final = {**cap.public(), "status": "done", "outcome": outcome, "error": error, "summary": summary,
                 "compute": compute, "ops": ops, "steps": steps, "comparison": comparison}
        try:
            stored = self.store.save(final, None, name, trace_temp=gz_tmp if name is not None else None)
        except Exception as exc:  # disk full, unwritable directory: nothing partial is listed
            self._internal.report("trace_store", exc)
            outcome, error = "failed", f"store failed: {type(exc).__name__}: {exc}"
            stored = {**final, "outcome": outcome, "error": error, "summary": [], "compute": {}, "ops": {},
                      "steps": 0, "comparison": None}
            summary, compute, ops, steps, comparison = [], {}, {}, 0, None
            if gz_tmp is not None:
                self.store.remove_temp(gz_tmp)
            try:
                self.store.save(stored, None, None)
            except Exception:
                pass
        release_memory(collect=False)  # the summary rows: trim only (a full collection costs ~0.2 s of GIL)
        with self._lock:
            cap.summary, cap.compute, cap.outcome, cap.error = summary, compute, outcome, error
            cap.ops, cap.steps, cap.comparison = ops, steps, comparison
            self._record(cap)
            self.current = None
            self._move("done")
        if self._log is not None:
            self._log.info("capture_done", id=cap.id, model=cap.model, outcome=outcome, error=error,
                           steps=cap.steps_recorded, ended_by=cap.ended_by, trace=stored.get("trace_file"),
                           trace_bytes=stored.get("trace_bytes"))

    def _compare(self, cap: Capture, ops: dict[str, dict[str, float]], steps: int) -> dict[str, Any] | None:
        """``compare(latest baseline, this capture)``, or None without a baseline; never raises (a
        comparison that fails is reported as a ``capture_compare`` internal error, the capture stands)."""
        try:
            base = self.latest_baseline(cap.model)
            if base is None:
                return None
            return compare(base, {**cap.public(), "ops": ops, "steps": steps})
        except Exception as exc:
            self._internal.report("capture_compare", exc)
            return None

    def _summarise_in_child(self, json_tmp: str, gz_tmp: str, *, device_time: bool = False) -> dict[str, Any]:
        """Run ``trace_summary.py`` on the temp trace in a child; returns its result or raises.

        A fresh interpreter (``subprocess``, never ``fork``: this process has threads and a profiler
        library loaded), isolated (``-I``), given the two files as inherited descriptors, so it never
        resolves a path in the trace directory itself.
        """
        src = self.store.open_temp(json_tmp, os.O_RDONLY)
        try:
            dst = self.store.open_temp(gz_tmp, os.O_WRONLY | os.O_TRUNC)
        except BaseException:
            os.close(src)
            raise
        try:
            cmd = [sys.executable, "-I", _SUMMARY_SCRIPT, "--in-fd", str(src), "--gz-fd", str(dst),
                   "--max-memory-bytes", str(int(self.export_max_memory))] + (["--device-time"] if device_time else [])
            child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     pass_fds=(src, dst), close_fds=True)
        finally:
            os.close(src)
            os.close(dst)
        try:
            out, err = child.communicate(timeout=self.export_timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.communicate()
            raise TimeoutError(f"trace summary took over {self.export_timeout:g} s; child killed") from None
        if child.returncode != 0:
            last = err.decode(errors="replace").strip().splitlines()[-1:] or [f"exit status {child.returncode}"]
            raise RuntimeError(f"trace summary child failed (exit {child.returncode}): {last[0][:300]}")
        result: dict[str, Any] = json.loads(out)
        cpu = result.get("cpu_seconds")
        if isinstance(cpu, (int, float)):
            self._cpu.add("capture_export", float(cpu))
        return result

    def _record(self, cap: Capture) -> None:
        key = (cap.model, cap.trigger, cap.outcome or "failed")
        self.finished[key] = self.finished.get(key, 0) + 1
        self.last_finished[key] = time.time()
        if cap.outcome == "ok" and cap.trigger in COMPARED_TRIGGERS:
            # Follows the latest ok capture of this kind (as perfmon_capture_timestamp_seconds{outcome="ok"}
            # does), so a dashboard never pins an older capture's change on a newer one.
            key2 = (cap.model, cap.trigger)
            if cap.comparison and not cap.comparison.get("error"):
                top = headline(cap.comparison)
                self.comparisons[key2] = ("", "same", 0.0) if top is None else (
                    top["op"], top["status"], float(top["added_seconds_per_call"]))
            else:
                self.comparisons.pop(key2, None)
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
