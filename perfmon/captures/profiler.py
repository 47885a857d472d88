"""torch.profiler, and only here: the profiler a capture runs, and how it is started and stopped.

``torch_profiler`` builds the real one (``ProfilerFactory`` is the seam a fake goes through);
``profiler_active`` says whether any profiler runs (perfmon never nests one: a nested session silently
wipes the outer one); ``warm_up_profiler`` pays Kineto's first start before traffic; ``quiet_kineto``
runs a start or stop with Kineto's ``USDT:`` stderr lines filtered out of fd 2; ``step_annotation``
is torch's ``record_function``, which marks each recorded model call for the export.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from .records import CaptureOptions

__all__ = [
    "Profiler", "ProfilerFactory", "Scope", "exclusive_start", "no_scope", "profiler_active", "profiler_has_run",
    "profiler_warming", "quiet_kineto", "reset_after_fork", "step_annotation", "torch_profiler", "wait_warm_up",
    "warm_up_profiler",
]

#: A real torch profiler was built in this process, or in a parent before it forked this one (a fork
#: copies the flag): Kineto's threads may exist, or have existed in a parent (``perfmon.process``).
_HAS_RUN = False


def profiler_has_run() -> bool:
    """True once perfmon built a real torch profiler in this process or in a parent before the fork."""
    return _HAS_RUN


class Profiler(Protocol):
    """What a capture uses of torch's profiler; one may also have ``step_scope`` (a ``Scope``: the recording then
    marks each recorded call with it rather than with torch's ``record_function``)."""

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def export_chrome_trace(self, path: str) -> None: ...


#: Builds a profiler for a capture: (options, record CUDA activity) -> Profiler.
ProfilerFactory = Callable[[CaptureOptions, bool], Profiler]

#: A named profiler annotation: name -> context manager (torch's ``record_function``, or ``no_scope``).
Scope = Callable[[str], contextlib.AbstractContextManager[Any]]


def torch_profiler(options: CaptureOptions, cuda: bool) -> Profiler:
    """The real one: torch.profiler with CPU (and CUDA) activity."""
    from torch.profiler import ProfilerActivity, profile

    global _HAS_RUN
    _HAS_RUN = True  # before the start: a start that fails half-way may have initialised Kineto already
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


#: Held while perfmon decides to start a profiler and starts it (``exclusive_start``, and the warm-up's decision):
#: two of perfmon's never start at once.
_STARTING = threading.Lock()
#: Clear while ``warm_up_profiler``'s profiler runs (seconds): a capture armed meanwhile waits for it to end.
_IDLE = threading.Event()
_IDLE.set()
#: Until when (``time.monotonic()``) the calls that would start a capture wait for the running warm-up: set by the
#: first that waits for it, None before. A warm-up that runs long (22 s beside a busy thread) delays them
#: ``wait_warm_up``'s ``seconds`` in all, not each.
_WAIT_UNTIL: float | None = None


def profiler_warming() -> bool:
    """True while perfmon's own warm-up profiler runs (a capture waits for it rather than fail as "nested")."""
    return not _IDLE.is_set()


def wait_warm_up(seconds: float) -> bool:
    """Wait for perfmon's warm-up to end (at once when none runs), up to ``seconds`` after the first call that waited
    for this warm-up (a later call waits what is left of that, so none waits again once it passed); True once none
    runs."""
    global _WAIT_UNTIL
    if _IDLE.is_set():
        return True
    now = time.monotonic()
    until = _WAIT_UNTIL
    if until is None:
        until = _WAIT_UNTIL = now + seconds
    return _IDLE.wait(max(0.0, until - now))


def warm_up_profiler(make_profiler: ProfilerFactory | None = None) -> float:
    """Start and stop a profiler once on this thread (``make_profiler``'s, torch's by default); returns seconds taken
    (0 when a profiler runs already).

    The first profiler start in a process initialises Kineto (measured 1.1-1.3 s here); doing it
    at Monitor.start(), before traffic, keeps that stall off the first capture's request. On a thread of its own
    beside a busy one it takes far longer (22 s beside a pure-Python loop here: it gives up the GIL often), while
    that thread stands still for 0.35 s in all.
    """
    global _WAIT_UNTIL
    with _STARTING:
        if profiler_active():
            return 0.0
        _WAIT_UNTIL = None
        _IDLE.clear()
    try:
        t0 = time.perf_counter()
        prof = (make_profiler or torch_profiler)(CaptureOptions(record_shapes=False), False)  # (no CUDA)
        quiet_kineto(prof.start)
        quiet_kineto(prof.stop)
        return time.perf_counter() - t0
    finally:
        _IDLE.set()


@contextlib.contextmanager
def exclusive_start() -> Iterator[bool]:
    """Around a capture's decision to start its profiler and the start: yields False while another of perfmon's
    starts or the warm-up runs (the capture stays armed and tries at the model's next call), True otherwise."""
    if not _STARTING.acquire(blocking=False):
        yield False
        return
    try:
        yield _IDLE.is_set()
    finally:
        _STARTING.release()


def reset_after_fork() -> None:
    """In a forked child: no warm-up runs here (its thread was the parent's), no start is in progress."""
    global _STARTING, _WAIT_UNTIL
    _STARTING = threading.Lock()
    _WAIT_UNTIL = None
    _IDLE.set()


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


#: The complaint Kineto's first start in a process prints when it runs on another thread than the one that imported
#: torch (torch registers its Kineto client there; a capture starts on a serving thread). On that line Kineto skips the
#: client's ``init()``, which torch leaves empty: the profiler starts and records all the same (tests/test_capture.py).
_WRONG_THREAD = b"ERROR: External init callback must run in same thread as registerClient"
#: What ``quiet_kineto`` drops of a start's or stop's fd-2 output: that complaint and Kineto's ``USDT:`` trace points,
#: matched as Kineto writes them. A ``USDT:`` line comes in two writes, its text and then its newline, so another
#: thread's line written in between lands glued to it ("USDT:... profiler_stop{...}\n\n"): dropping whole lines that
#: start with the prefix dropped that line too (a worker's ``port_unavailable`` once, in a full suite run). Only the
#: text goes, with its newline when it follows at once; what another thread wrote stays (one blank line after it in
#: that race). A ``USDT:`` line of another form is dropped whole, as before.
_KINETO_TEXT = re.compile(rb"USDT:[^\n\]]*\] profiler_(?:start|stop)\n?|" + re.escape(_WRONG_THREAD) + rb"[^\n]*\n?")


def quiet_kineto(fn: Callable[[], None]) -> None:
    """Run ``fn`` (a profiler start or stop) with Kineto's ``USDT:`` stderr lines filtered out, and its
    wrong-thread complaint (``_WRONG_THREAD``), and torch's one-cycle warning ignored (``_no_cycle_warning``).

    Kineto logs ``USDT: ... profiler_start`` / ``profiler_stop`` at its USDT severity (5), above
    ERROR (4), so no ``KINETO_LOG_LEVEL`` hides them without also hiding Kineto's errors (6 hides
    everything), and the level is read once, at the first profiler start in the process. Instead,
    fd 2 points at an anonymous temp file for the duration of the call (a start ~1 ms; a stop as long
    as the stop, ~0.7 s at the default memory bound for a large model) and everything written there
    except those lines is written back to the real stderr. Another thread's stderr output
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
        kept = b"".join(line for line in _KINETO_TEXT.sub(b"", data).splitlines(keepends=True)
                        if not line.startswith(b"USDT:"))
        while kept:
            try:
                kept = kept[os.write(2, kept):]
            except OSError:
                break
    if not ran:  # no temp file could be made: run it unfiltered
        fn()


def no_scope(name: str) -> contextlib.AbstractContextManager[Any]:
    return contextlib.nullcontext()


def step_annotation() -> Scope:
    """torch's ``record_function`` (a profiler annotation), looked up once per capture."""
    try:
        from torch.autograd.profiler import record_function
    except ImportError:  # pragma: no cover - perfmon runs with torch; a fake profiler may not need it
        return no_scope
    return record_function  # type: ignore[no-any-return]
