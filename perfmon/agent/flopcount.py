"""A signature's FLOPs and bytes, counted once, off the request thread, on a fake copy of the model.

How: the wrapped module is deep-copied under torch's ``FakeCopyMode`` (parameters and buffers become fake tensors:
shapes, dtypes and devices, no storage), the signature's inputs are rebuilt from their abstract description
(abstract.py) under the same ``FakeTensorMode``, and the copy's forward runs under a dispatch mode of perfmon's that
counts every aten op: FLOPs from torch's own formulas (``torch.utils.flop_counter``'s registry: matmuls,
convolutions, attention, CPU's fused attention too: opcount.py; elementwise ops count 0, as in ``FlopCounterMode``)
and bytes. No kernel runs and no memory is allocated. The copy is kept per model (re-made when its parameters change
shape, dtype or device) so the next signature of the same model costs only the fake forward.

Bytes, an estimate: for every aten op that is not a view, the sizes of its tensor inputs and outputs (an op reads
its inputs from memory and writes its outputs); a lookup (embedding, index_select, gather) counts the rows it
returns, read and written, and its indices, not the whole table. For a Linear at batch 1 that is the weight (read
once), the bias, the input and the output; caches, fusion (torch.compile) and re-reads inside a kernel are not
modelled, so it is the traffic of eager PyTorch with nothing kept in cache.

Why a copy and not the user's module: the forward of the copy may set attributes, update buffers in place or fill
caches, and none of it reaches the serving model; the real module is only read (``deepcopy``), never called.
``FlopCounterMode`` is not used itself: it installs *global* module hooks for its per-module table, which every
forward in the process, the serving thread's included, would run meanwhile. Dispatch and torch function modes are
thread-local: the serving thread's calls are untouched.

What ``deepcopy`` copies for real is what is not a tensor: a model holding more than ``MAX_COPIED_BYTES`` of other
data (a numpy table, bytes, large containers: an estimate, walked in its modules' attributes) is not copied, and its
count is unknown: the copy would hold that much memory as long as the model lives.

Unknown, never guessed: modules with forward hooks (a hook would run with fake tensors, on this thread), with an
instance-level ``forward`` (accelerate-style), or with a compiled submodule; calls whose arguments cannot be
described (a KV-cache object: decode steps); forwards that read tensor data (``.item()``, data-dependent shapes),
that fail, or that take longer than the timeout; calls in a dtype the model left before they were counted.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import copy
import itertools
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ..selfcost import AgentCpu
from .abstract import CallSpec, Opaque, TensorSpec, materialize
from .opcount import OpCounting, flop_registry

__all__ = ["FLOP_COUNT_DUTY", "FLOP_COUNT_SLICE_SECONDS", "OUTCOMES", "QUEUED", "Count", "FlopCounter", "Unknown"]

#: Outcomes of a count (perfmon_flop_counts_total): counted, unsafe to run (skipped), raised, ran too long, and
#: postponed for the budget (the thread waits for the next token: one per wait).
OUTCOMES = ("ok", "skipped", "failed", "timeout", "deferred")

class Count(NamedTuple):
    """One call of a signature: FLOPs, bytes moved (an estimate, see the module's docstring), whether its FLOPs
    run in 16 bits or fewer (the 16-bit peak applies), and the seconds counting it took."""

    flops: int
    bytes: int
    half: bool
    seconds: float


class Unknown(NamedTuple):
    """A signature perfmon could not count, and why (shown in /stats)."""

    reason: str


class _Timeout(Exception):
    pass


class _Stopped(Exception):
    """stop() was called during a count: the count is abandoned, its signature offered again later."""


class _Refused(Exception):
    """A module whose copy would cost too much (the reason)."""


#: Non-tensor data a model may hold (numpy arrays, bytes, strings, containers) before its copy is refused.
MAX_COPIED_BYTES = 64 * 2**20
#: Objects walked at most to estimate it; a model holding more is refused too (deepcopy would copy them all).
MAX_COPIED_OBJECTS = 1_000_000


#: Seconds a count works at a stretch before it pauses (``_Pace``), holding the GIL all the while. Shorter slices make
#: shorter stalls but more work: each restart after a pause finds the caches cold (benchmarks/flop_count.py, a 2-layer
#: GPT-2's count: 1 ms slices 1.9x the unpaced work, 2 ms 1.4x, 5 ms 1.15x with stalls of 5 ms).
FLOP_COUNT_SLICE_SECONDS = 0.002
#: The share of wall time a count works while it runs (``FlopCounter(duty=)``): after each slice it pauses nine slices'
#: time, the GIL let go. Unpaced, a count holds the GIL as long as Python lets it (the 5 ms switch interval at a time,
#: for the whole count: a lent H200 host counted a 4-layer encoder in ~150 ms), and a GIL-bound serving thread runs at
#: about half its speed meanwhile, a burst in its tail; paced, it loses about a sixth (benchmarks/flop_count.py: 15% of
#: its time late against 41% unpaced), in stalls of about a slice.
FLOP_COUNT_DUTY = 0.1


class _Pace:
    """A count's clock, checked at every object a copy copies and every op a fake forward runs: it ends the count
    when its thread is stopped (a count still running when the interpreter exits would be killed inside torch's
    C++: the process aborts) or past ``timeout`` seconds of work in the current part (``restart``), and pauses it
    (``stop.wait``, the GIL let go) so that it works ``duty`` of the wall time. ``slept``: its pauses, in
    seconds."""

    def __init__(self, timeout: float, stop: threading.Event, duty: float,
                 slice_seconds: float = FLOP_COUNT_SLICE_SECONDS) -> None:
        self.timeout, self.stop, self.duty, self.slice_seconds = timeout, stop, duty, slice_seconds
        self.slept = 0.0
        self.restart()

    def restart(self) -> None:
        """A new part of the count (the copy, then the forward): its own ``timeout`` from now."""
        self.slice = time.perf_counter()
        self.deadline = self.slice + self.timeout

    def check(self) -> None:
        if self.stop.is_set():
            raise _Stopped
        now = time.perf_counter()
        if now > self.deadline:
            raise _Timeout
        worked = now - self.slice
        if worked >= self.slice_seconds and self.duty < 1.0:
            stopped = self.stop.wait(worked * (1.0 / self.duty - 1.0))
            self.slice = time.perf_counter()
            self.slept += self.slice - now  # a pause a stop() cut short is a pause too, not work
            self.deadline += self.slice - now  # the timeout counts work, not pauses
            if stopped:
                raise _Stopped


class _Deadline(dict):  # type: ignore[type-arg]  # deepcopy's memo: id -> copy
    """A ``deepcopy`` memo that checks the count's ``_Pace``: deepcopy looks every object it copies up in it."""

    def __init__(self, pace: _Pace) -> None:
        super().__init__()
        self.pace = pace

    def get(self, key: Any, default: Any = None) -> Any:
        self.pace.check()
        return super().get(key, default)



class _Copy(NamedTuple):
    module: weakref.ref[Any]
    fingerprint: tuple[Any, ...]
    mode: Any  # the FakeTensorMode the copy's tensors belong to
    fake: torch.nn.Module


#: A signature waiting for the counting thread (its ``count`` until then).
QUEUED = Unknown("not counted yet (queued; at most flop_counts_per_minute counts a minute)")
#: Signatures waiting at most; beyond, a signature stays uncounted and is offered again at a later sample.
MAX_QUEUED = 1024


#: Seconds of counting the thread may spend at once before ``share`` paces it (FlopCounter): a model's first signatures
#: are counted as soon as they are seen, whatever they cost, up to this.
FLOP_COUNT_BURST_SECONDS = 0.5


#: Counters whose thread may be running: stopped at interpreter exit. A counting thread still alive when the interpreter
#: finalizes (one waiting out its time budget, or mid-count) aborts the process (SIGABRT, "terminate called without an
#: active exception") once torch's fake-tensor machinery has run on it; a monitor that was never started (no stop() at
#: exit) but had samples resolved by flush() left one behind.
_RUNNING: weakref.WeakSet[FlopCounter] = weakref.WeakSet()


@atexit.register
def _stop_at_exit() -> None:
    for counter in list(_RUNNING):
        counter.stop(2.0)


class FlopCounter:
    """Counts signatures on a thread of its own (``submit``), within two budgets: ``per_minute`` counts (a token
    bucket) and ``share`` of wall time spent counting (a bucket of seconds, ``FLOP_COUNT_BURST_SECONDS`` deep, that
    each count's duration is taken from and that refills at ``share`` seconds a second: a count holds the GIL,
    and the serving thread waits for it). While a count runs it works ``duty`` of the wall time, in slices of
    ``FLOP_COUNT_SLICE_SECONDS`` (``_Pace``; 1.0: unpaced). The copy and the fake forward are each cut at
    ``timeout_seconds`` of work. The thread runs only while signatures wait: it starts on the first ``submit`` and
    ends when the queue is empty (one wake per count, none when idle)."""

    def __init__(self, *, per_minute: int, timeout_seconds: float, share: float = 1.0, cpu: AgentCpu | None = None,
                 streams: Callable[[int], contextlib.AbstractContextManager[Any]] | None = None,
                 duty: float = FLOP_COUNT_DUTY, slice_seconds: float = FLOP_COUNT_SLICE_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0.0 < duty <= 1.0:
            raise ValueError(f"duty={duty!r}: a share of wall time in (0, 1]")
        if not slice_seconds > 0.0:
            raise ValueError(f"slice_seconds={slice_seconds!r}: must be positive")
        self.per_minute = per_minute
        self.duty, self.slice_seconds = duty, slice_seconds
        #: ``CudaBackend.own_stream``: the fake forward of a CUDA model runs with perfmon's own stream current.
        self._streams = streams
        self.timeout_seconds = timeout_seconds
        self.share = share
        self._cpu = cpu
        self._clock = clock
        self._tokens = float(per_minute)
        self._refilled = clock()
        #: Seconds of counting allowed now (goes negative by the last count's overrun: that debt is waited out).
        self._seconds = FLOP_COUNT_BURST_SECONDS
        self._copies: dict[int, _Copy] = {}
        self._registry = flop_registry()
        #: torch's one-time imports done on a caller's thread (``prepare``); a forked child keeps them.
        self._prepared = False
        self.reset_after_fork()

    def reset_after_fork(self) -> None:
        """Empty (also the initial state): no thread, no queue, counts from zero (the fake copies are rebuilt)."""
        for _, sig, _ in getattr(self, "_queue", ()):  # the parent's counting thread is not here: offer them again
            sig.count = None
        self.counts = {outcome: itertools.count() for outcome in OUTCOMES}
        #: Seconds spent counting (fake copies and fake forwards, their pauses apart), in total.
        self.seconds = 0.0
        self._queue: collections.deque[tuple[Any, Any, int]] = collections.deque()
        self._lock = threading.Lock()
        self._counting = threading.Lock()
        self._preparing = threading.Lock()  # a second caller waits for the first's imports
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._copies = {}

    def prepare(self) -> None:
        """Count a tiny Linear once, here, so that torch's one-time imports happen on this thread (Monitor.start's).

        A ``FakeTensorMode`` imports ``torch._dynamo`` (~1 s) and a fake forward parts of ``torch._inductor``.
        Imported for the first time on the counting thread, they would race the serving thread's own lazy imports
        (the profiler's start, a first ``torch.compile``): two threads importing torch's circular packages at once
        get half-made modules (an ImportError, or a deadlock error) in either thread, the user's included.
        """
        with self._preparing:
            if self._prepared:  # once a counter (a flush() before start(), two flushes at once, a restart)
                return
            try:
                probe = torch.nn.Linear(2, 2)  # unpaced: Monitor.start waits for it
                self._run(probe, probe, CallSpec((TensorSpec((1, 2), torch.float32, "cpu"),), ()),
                          _Pace(self.timeout_seconds, threading.Event(), 1.0))
            except Exception:  # counting will fail the same way later, and say so per signature
                pass
            finally:
                self._copies.clear()  # no counting thread yet: it starts after this (submit)
                self._prepared = True

    # -- the resolver thread -----------------------------------------------------------------

    def submit(self, target: Any, sig: Any, device_index: int = -1) -> None:
        """Queue signature ``sig`` (a phases.Signature) of the module ``target`` (a weakref, or None) for counting;
        its ``count`` is ``QUEUED`` until the thread sets the result. Starts the thread when none runs.
        ``device_index``: the CUDA device the model runs on (-1: none).

        A monitor never started (``flush()`` only) has not prepared: it does here, on the thread of the ``flush()``
        that submits its first signature, as ``Monitor.start()`` would (a started monitor submits on the resolver
        thread, prepared by then). On the counting thread the import would race the caller's own, and run on, ~1 s
        holding the GIL in long stretches, into whatever the caller times next (a lent H200's timing check read a
        1 ms kernel 20% long)."""
        if not self._prepared:
            self.prepare()
        with self._lock:
            if len(self._queue) >= MAX_QUEUED:
                return
            sig.count = QUEUED
            self._queue.append((target, sig, device_index))
            if self._thread is None:
                self._stop = threading.Event()
                self._thread = threading.Thread(target=self._work, args=(self._stop,), name="perfmon-flops",
                                                daemon=True)
                _RUNNING.add(self)
                self._thread.start()

    def stop(self, timeout_seconds: float) -> None:
        """Stop the thread, abandoning a count under way at its next op (bounded wait); what waits, and that count's
        signature, are offered again later."""
        with self._lock:
            thread, stop = self._thread, self._stop
        stop.set()
        if thread is not None:
            thread.join(timeout_seconds)

    @property
    def busy(self) -> bool:
        """True while signatures wait or one is being counted."""
        return self._thread is not None

    # -- the counting thread -----------------------------------------------------------------

    def _work(self, stop: threading.Event) -> None:
        try:
            while True:
                with self._lock:
                    if not self._queue or stop.is_set():
                        self._end(stop)  # under the same lock as submit(): no signature is left behind
                        return
                    target, sig, device_index = self._queue[0]
                if _refusal(target, sig.spec) is None:
                    wait = self._take()
                    if wait > 0:
                        next(self.counts["deferred"])
                        stop.wait(wait)  # the next token, or the time budget back above zero; a stop() ends it
                        continue
                with self._lock:
                    self._queue.popleft()
                if (moved := sig.moved(target)) is not None:  # counted now, it would mix two dtypes
                    next(self.counts["skipped"])
                    sig.count = Unknown(moved)
                    continue
                if self._cpu is not None:
                    with self._cpu.measure("flop_count"):
                        sig.count = self.count(target, sig.spec, stop, device_index)
                else:
                    sig.count = self.count(target, sig.spec, stop, device_index)
        except BaseException:  # pragma: no cover - count() never raises; the thread must still let go
            with self._lock:
                self._end(stop)
            raise

    def _end(self, stop: threading.Event) -> None:
        """The thread ends (under the lock): waiting signatures are offered again at a later sample."""
        if self._stop is stop:
            self._thread = None
            for _, sig, _ in self._queue:
                sig.count = None
            self._queue.clear()

    def count(self, target: Any, spec: Any, stop: threading.Event | None = None,
              device_index: int = -1) -> Count | Unknown | None:
        """Count one call of ``spec`` on the module ``target`` (a weakref, or None), now, whatever the budget.
        Never raises: a failure is an ``Unknown`` naming it; None when ``stop`` was set meanwhile (not counted).
        ``device_index``: the CUDA device the model runs on (-1: none), whose current stream on this thread is
        perfmon's own while the fake forward runs."""
        with self._counting:
            why = _refusal(target, spec)
            key = None if why is not None else target()
            module = None if key is None else _original(key)
            if why is None:
                why = ("the module is gone" if key is None else "a compiled module without its original (_orig_mod)"
                       if module is None else _unsafe(module))
            if why is not None:
                next(self.counts["skipped"])
                return Unknown(why)
            start = time.perf_counter()
            outcome = "failed"
            pace = _Pace(self.timeout_seconds, threading.Event() if stop is None else stop, self.duty,
                         self.slice_seconds)
            try:
                result = self._run(key, module, spec, pace, device_index)
            except _Stopped:
                self.seconds += time.perf_counter() - start - pace.slept
                return None
            except _Refused as exc:
                outcome = "skipped"
                result = Unknown(str(exc))
            except _Timeout:
                outcome = "timeout"
                result = Unknown(f"counting took longer than {self.timeout_seconds:g} s of work "
                                 "(flop_count_timeout_seconds)")
            except Exception as exc:
                first = str(exc).splitlines()[0][:160] if str(exc) else ""
                result = Unknown(f"the fake forward raised {type(exc).__name__}" + (f": {first}" if first else ""))
            spent = time.perf_counter() - start - pace.slept  # the work: what the serving thread may wait for
            self.seconds += spent
            self._seconds -= spent
            if isinstance(result, Count):
                next(self.counts["ok"])
                return result._replace(seconds=spent)
            next(self.counts[outcome])
            return result

    def _take(self) -> float:
        """0 and a token taken when both budgets allow a count now, else the seconds until they may."""
        now = self._clock()
        elapsed = now - self._refilled
        self._tokens = min(float(self.per_minute), self._tokens + elapsed * self.per_minute / 60.0)
        self._seconds = min(FLOP_COUNT_BURST_SECONDS, self._seconds + elapsed * self.share)
        self._refilled = now
        wait = max((1.0 - self._tokens) * 60.0 / self.per_minute if self._tokens < 1.0 else 0.0,
                   -self._seconds / self.share if self._seconds <= 0.0 else 0.0)
        if wait > 0:
            return max(wait, 0.001)
        self._tokens -= 1.0
        return 0.0

    def _run(self, key: Any, module: Any, spec: CallSpec, pace: _Pace, device_index: int = -1) -> Count | Unknown:
        copied = self._copy_of(key, module, pace)
        # The timeout bounds the copy (once per model; ~0.5 ms a tensor: 10,000 parameters take ~5 s) and the fake
        # forward, each; torch's fake-tensor import (once per process, ~1 s) is not cut. All count in self.seconds.
        pace.restart()
        counting = OpCounting(pace.check, self._registry)
        # A forward may reach the device past the dispatcher, where fake tensors cannot stop it: a raw kernel
        # (torch.cuda._sleep, an extension that takes no tensor), an event it records, a stream it waits on. On this
        # thread's default stream, the user's too, such a kernel would run between the user's kernels and inside
        # their timings (the GPU check's calibrated sleep kernel does); on perfmon's own it delays none of theirs.
        own = (self._streams(device_index) if self._streams is not None and device_index >= 0
               else contextlib.nullcontext())
        with own, copied.mode:
            args, kwargs = materialize(spec)
            with counting, torch.no_grad():
                copied.fake(*args, **kwargs)
        return Count(counting.flops, counting.bytes, counting.half, 0.0)

    def _copy_of(self, key: Any, module: Any, pace: _Pace) -> _Copy:
        """The fake copy of ``module`` (the wrapped ``key``'s original): kept while its parameters and buffers keep
        their shapes, dtypes and devices."""
        from torch._subclasses.fake_tensor import FakeCopyMode, FakeTensorMode

        fingerprint = tuple((id(t), t.dtype, t.device, t.shape)
                            for t in itertools.chain(module.parameters(), module.buffers()))
        kept = self._copies.get(id(key))
        if kept is not None and kept.module() is key and kept.fingerprint == fingerprint:
            return kept
        held = _held_bytes(module)
        if held is not None:
            raise _Refused(f"the model holds {held} of data that is not a tensor (its copy would hold it for real)")
        mode = FakeTensorMode()
        with FakeCopyMode(mode):
            # a monitored module copies as its bare class (wrap.py): no hot path in it
            fake = copy.deepcopy(module, _Deadline(pace))
        for m in fake.modules():
            if getattr(m, "_compiled_call_impl", None) is not None:  # module.compile(): the eager forward, not Dynamo
                m._compiled_call_impl = None
        kept = self._copies[id(key)] = _Copy(weakref.ref(key), fingerprint, mode, fake)
        for gone in [k for k, c in self._copies.items() if c.module() is None]:
            del self._copies[gone]
        return kept


def _refusal(target: Any, spec: Any) -> str | None:
    """Why a signature cannot be counted safely before running anything, or None."""
    if target is None:
        return "not a wrapped module (monitor.instrument and monitor.track are not counted)"
    if spec is None:
        return "no abstract inputs (signature tracking was off when it was seen)"
    if isinstance(spec, Opaque):
        return spec.reason
    return None


def _original(module: Any) -> Any:
    """What to copy and count: the module, or a ``torch.compile``'d module's original (same FLOPs; eager's bytes)."""
    if _is_compiled(module):
        module = getattr(module, "_orig_mod", None)
    return module if isinstance(module, torch.nn.Module) else None


def _is_compiled(module: Any) -> bool:
    frame = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing can be compiled
    return frame is not None and isinstance(module, frame.OptimizedModule)


def _unsafe(module: torch.nn.Module) -> str | None:
    """Why running a fake copy of ``module`` on another thread could have effects outside the copy, or None."""
    nn = torch.nn.modules.module
    for name in ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks"):
        if getattr(nn, name, None):
            return "global module hooks are installed (they would run during the fake forward)"
    for path, m in module.named_modules():
        if _is_compiled(m):
            return f"a torch.compile'd submodule ({path or 'the model'})"
        if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
            return f"forward hooks on {path or 'the model'} (they would run during the fake forward)"
        if "forward" in m.__dict__:
            return f"an instance-level forward on {path or 'the model'} (accelerate-style hook)"
    return None


def _held_bytes(module: torch.nn.Module) -> str | None:
    """How much non-tensor data a deep copy of ``module`` would copy for real, when over ``MAX_COPIED_BYTES`` (or
    ``MAX_COPIED_OBJECTS``), else None: its modules' attributes, walked (tensors and modules are not data here)."""
    total, seen = 0, set()
    todo: list[Any] = [v for m in module.modules() for k, v in vars(m).items()
                       if k not in ("_parameters", "_buffers", "_modules")]
    while todo:
        value = todo.pop()
        if id(value) in seen or isinstance(value, (torch.Tensor, torch.nn.Module, type)) or callable(value):
            continue
        seen.add(id(value))
        if len(seen) > MAX_COPIED_OBJECTS:
            return f"more than {MAX_COPIED_OBJECTS} objects"
        nbytes = getattr(value, "nbytes", None)  # a numpy array, a memoryview
        total += nbytes if isinstance(nbytes, int) else sys.getsizeof(value, 0)
        if total > MAX_COPIED_BYTES:
            return f"more than {MAX_COPIED_BYTES // 2**20} MiB"
        if isinstance(value, dict):
            todo.extend(value.keys())
            todo.extend(value.values())
        elif isinstance(value, (list, tuple, set, frozenset)):
            todo.extend(value)
        elif hasattr(value, "__dict__") and not isinstance(value, (str, bytes, bytearray)):
            todo.extend(vars(value).values())
    return None
