"""The hot path: what runs on the request thread for every call of a monitored model.

Per call it counts (one ``next()`` on an ``itertools.count``), decides whether the call is cold
or due for a sample (integer comparisons and, with signature tracking, one dict lookup) and, for
the few calls that are timed, stamps ``perf_counter_ns``/records a CUDA event pair and appends a
tuple to a bounded deque. Nothing here touches prometheus_client, logs, takes a lock per call,
computes a percentile or waits for the GPU.

Anything that fails in here is counted as an internal error and the user's call proceeds; the
user's own exceptions are counted by class and re-raised unchanged.
"""

from __future__ import annotations

import collections
import functools
import itertools
import threading
import types
from collections.abc import Callable, Hashable, Mapping
from time import perf_counter_ns
from typing import Any

import torch

from ..config import Config
from ..faults import InternalErrors, count_value
from ..selfcost import AgentCpu, HttpShedding
from .clocks import CudaBackend, EventPair, EventPools
from .exemplars import TraceReader, otel_reader
from .phases import Signature, SignatureTable, batch_of, signature, work_of
from .records import DROP_REASONS, Pending
from .sampling import Sampler
from .stages import MAX_STAGES, StageFn, stage_label

__all__ = ["Hub", "ModelState", "MonitoredFunction", "MonitoredModule", "Probe", "Span", "Stages", "mark_for_dynamo",
           "staged_path", "unwrap_module"]

_Tensor = torch.Tensor
_OOM = torch.cuda.OutOfMemoryError
#: A timed call in progress: (cold, CUDA event pair or None on a wall clock, stream or None).
Token = tuple[bool, "EventPair | None", Any]
_OTHER = "other"


class Hub:
    """What every model's hot path shares: the queue to the resolver, the event pools, fault counts."""

    def __init__(self, config: Config, backend: CudaBackend) -> None:
        self.config = config
        self.backend = backend
        self.queue: collections.deque[Pending] = collections.deque()
        self.queue_size = config.queue_size
        self.pools = EventPools(backend, config.event_pool_size)
        self.internal = InternalErrors()
        #: CPU seconds the agent's own threads spend (exported as perfmon_agent_cpu_seconds_total).
        self.cpu = AgentCpu()
        #: What the agent's HTTP server refused, and how long it paused for its CPU budget.
        self.http = HttpShedding()
        #: False once the monitor stops: calls are still counted but no longer timed.
        self.timing = True
        #: perf_counter_ns() when the monitor started (origin of time-to-first-forward).
        self.started_ns = perf_counter_ns()
        #: Called on the request thread with a CUDA OutOfMemoryError (the allocator snapshot).
        self.on_oom: Callable[[BaseException], object] | None = None
        #: Reads the caller's OpenTelemetry span on timed calls only (exemplars); None without OTel.
        self.trace_reader: TraceReader | None = otel_reader()

    def reset_after_fork(self) -> None:
        """In a forked child: fresh queue, event pools (CUDA state does not survive fork), fault counts."""
        self.queue = collections.deque()
        self.pools = EventPools(self.backend, self.config.event_pool_size)
        self.internal.reset_after_fork()  # reset in place: collectors hold references to these
        self.cpu.reset_after_fork()
        self.http.reset_after_fork()
        self.started_ns = perf_counter_ns()


class ModelState:
    """Everything perfmon knows about one monitored model (or function, or span name).

    Attributes read by the hot path are plain slots; the background stages read the counters and
    write ``next_index`` (to enforce the sampling floor) and ``device`` (when the model moves).
    """

    __slots__ = (
        "_error_lock", "_error_names", "_items_lock", "_resolve_device", "attached", "calls", "capturable", "capture",
        "cuda_index", "device", "drops", "errors", "hub", "items_fn", "items_on", "items_padded", "items_q",
        "items_total", "last_sample_ns", "name", "next_index", "padded_total", "sampled", "sampler", "sigs", "stage",
        "stages", "table", "warmup",
    )

    def __init__(self, name: str, hub: Hub, resolve_device: Callable[[], str], *, capturable: bool = True,
                 items: Any = None, stage: str = "") -> None:
        cfg = hub.config
        self.name = name
        #: "" for a model with one stage; "prefill"/"decode" (or a stage= label) for one stage of a model.
        self.stage = stage
        #: The model's stages (label -> state) when it has several, shared by all of them; else None.
        self.stages: dict[str, ModelState] | None = None
        #: None: the batch dimension (counted through signatures); a callable: (args, kwargs) -> int or
        #: (effective, padded); False: not counted.
        self.items_fn: Callable[..., Any] | None = items if callable(items) else None
        self.items_on = items is not False and (self.items_fn is not None or cfg.track_signatures)
        self.items_padded = False
        self.items_q: collections.deque[Any] | None = collections.deque() if self.items_fn is not None else None
        self._items_lock = threading.Lock()
        self.items_total = 0
        self.padded_total = 0
        #: False for track() blocks: a capture profiles calls of a wrapped model or function.
        self.capturable = capturable
        #: False once its module was unwrapped (its name may be wrapped again and continue these counters).
        self.attached = True
        self.hub = hub
        self.calls = itertools.count()
        self.sampled = itertools.count()  # timed attempts, drops included
        self.drops = {reason: itertools.count() for reason in DROP_REASONS}
        self.errors: dict[type, itertools.count[int]] = {}
        self._error_names: dict[str, itertools.count[int]] = {}
        self._error_lock = threading.Lock()
        self.warmup = cfg.warmup_calls
        self.sampler = Sampler(cfg.sample_rate, cfg.sample_floor_seconds)
        # 0 until warm-up ends: every warm-up call takes the (cold, timed) slow path.
        self.next_index = 0 if cfg.warmup_calls else self.sampler.first_index(0)
        self.last_sample_ns = perf_counter_ns()
        self.table = SignatureTable(cfg.signature_cache_size, cfg.signature_warmup_calls,
                                    count_items=self.items_on and self.items_fn is None)
        self.sigs: dict[Hashable, Signature] | None = self.table.seen if cfg.track_signatures else None
        self._resolve_device = resolve_device
        self.device = "cpu"
        self.cuda_index = -1
        #: The capture controller while a capture of this model is armed or recording, else None.
        self.capture: Any = None
        self.refresh_device()

    # -- background side ---------------------------------------------------------------------

    def reset_after_fork(self) -> None:
        """In a forked child: fresh counters and locks. The parent's calls are the parent's to report;
        a child that inherited them would count them again in every worker."""
        cfg = self.hub.config
        self.calls = itertools.count()
        self.sampled = itertools.count()
        self.drops = {reason: itertools.count() for reason in DROP_REASONS}
        self.errors = {}
        self._error_names = {}
        self._error_lock = threading.Lock()
        self._items_lock = threading.Lock()
        self.items_total = self.padded_total = 0
        if self.items_q is not None:
            self.items_q = collections.deque()
        tracking = self.sigs is not None or self.table.churning
        self.table = SignatureTable(cfg.signature_cache_size, cfg.signature_warmup_calls,
                                    count_items=self.items_on and self.items_fn is None)
        self.sigs = self.table.seen if (tracking and cfg.track_signatures) else None
        if self.sigs is not None and self.items_fn is None and self.items_q is not None:
            self.items_q = None  # counted through signatures again
        self.next_index = self.sampler.first_index(0)
        self.last_sample_ns = perf_counter_ns()
        self.capture = None
        self.cuda_index = -1 if self.cuda_index < 0 else self.cuda_index

    def refresh_device(self) -> None:
        """Re-read the model's device (it may have moved with ``.to()``)."""
        label = self._resolve_device()
        if label == self.device:
            return
        index = -1
        if label.startswith("cuda") and self.hub.backend.available():
            index = int(label.partition(":")[2] or 0)
        # Write the index first: a racing call then times on the new device with the old label at worst.
        self.cuda_index = index
        self.device = label
        self.table.rewarm()  # the first calls on the new device are cold (empty at construction)

    def error_counts(self) -> dict[str, int]:
        return {name: count_value(c) for name, c in list(self._error_names.items())}

    # -- request-thread side (cold paths; the per-call path is inlined in Probe.__call__) -----

    def new_signature(self, index: int, key: Hashable, args: tuple[Any, ...],
                      kwargs: Mapping[str, Any]) -> Token | Any | None:
        """A signature new or still warming up: count it; the call is cold (and timed) while it warms."""
        table = self.table
        cold = table.observe(key, args, kwargs)
        if table.churning and self.sigs is not None:
            if self.items_fn is None and self.items_on:
                self.items_q = collections.deque()  # items are counted per call from now on
            self.sigs = None
            self.hub.internal.report("signatures", _Churn(self.name, table.capacity))
        if index < self.warmup:
            return self.due(index)
        if cold:
            return self.begin(index, True)
        return self.due(index) if index >= self.next_index else None

    def new_dtype(self, entry: Signature, dtype: Any, token: Token) -> Token:
        """A timed call of a known shape in a dtype not seen with it: a new signature, so a cold call.

        Noticed on timed calls only (the unsampled path keys on the shape alone): a dtype switch is a
        deployment event (fp32 to bf16), not per-request traffic, and its first timed call is cold.
        """
        entry.dtypes = entry.dtypes | {dtype}
        self.table.distinct += 1
        return (True, token[1], token[2])

    # -- items ---------------------------------------------------------------------------------

    def count_items(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int | None:
        """Run the user's ``items`` callable; queue (effective, padded); never raises (faults are counted)."""
        try:
            value = self.items_fn(args, kwargs)  # type: ignore[misc]
            if isinstance(value, tuple):
                effective, padded = value
            else:
                effective, padded = value, None
            for v in (effective, padded):
                if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                    raise ValueError(f"items callable returned {value!r}: expected int >= 0 or (effective, padded)")
            if padded is not None and effective > padded:
                raise ValueError(f"items callable returned {value!r}: effective items exceed padded items")
        except Exception as exc:
            self.hub.internal.report("items", exc)
            return None
        if padded is not None:
            self.items_padded = True
        self.items_q.append((effective, padded))  # type: ignore[union-attr]
        return int(effective)

    def drain_items(self) -> None:
        """Fold queued per-call items into the totals (resolver housekeeping and scrapes)."""
        q = self.items_q
        if q is None:
            return
        effective = padded = 0
        while q:
            try:
                v = q.popleft()
            except IndexError:
                break
            if isinstance(v, tuple):
                effective += v[0]
                padded += v[1] if v[1] is not None else 0
            elif v is not None:
                effective += v
        with self._items_lock:
            self.items_total += effective
            self.padded_total += padded

    def items_counts(self) -> tuple[int | None, int | None]:
        """(items, padded items) so far, exact; None where not counted."""
        self.drain_items()
        if not self.items_on:
            return None, None
        with self._items_lock:
            items, padded = self.items_total, self.padded_total
        if self.items_fn is None:
            return items + self.table.items(), None
        return items, (padded if self.items_padded else None)

    def due(self, index: int) -> Token | Any | None:
        """Call ``index`` reached ``next_index``: a warm-up call (cold) or a steady-state sample."""
        warmup = self.warmup
        if index < warmup:
            if index == warmup - 1 and self.capture is None:
                # Warm-up ends: steady sampling starts at a random phase. (Not while a capture is pending:
                # every call must reach it; releasing the capture restarts the stride.)
                self.next_index = self.sampler.first_index(warmup)
            return self.begin(index, True)
        return self.begin(index, False)

    def begin(self, index: int, cold: bool) -> Token | Any | None:
        """Start timing call ``index``; returns a token for ``finish``, None if not timed, or the
        capture controller when a capture of this model is pending (calls under the profiler are
        not timed: its overhead is not the model's latency)."""
        capture = self.capture
        if capture is not None:
            return capture
        hub = self.hub
        if not hub.timing:
            return None
        if not cold:
            self.next_index = self.sampler.next_index(index)
        next(self.sampled)
        cuda = self.cuda_index
        if cuda < 0:
            return (cold, None, None)
        backend = hub.backend
        if backend.is_capturing(cuda):
            next(self.drops["graph_capture"])
            return None
        pair = hub.pools.get(cuda).acquire()
        if pair is None:
            next(self.drops["pool_exhausted"])
            return None
        try:
            stream = backend.current_stream(cuda)
            pair.start.record(stream)
        except BaseException:
            hub.pools.release(pair)
            raise
        return (cold, pair, stream)

    def finish(self, token: Token, index: int, start_ns: int, end_ns: int, items: int | None = None,
               size: int | None = None) -> None:
        """Close a timed call and hand it to the resolver; never raises."""
        cold, pair, stream = token
        hub = self.hub
        try:
            if pair is not None:
                pair.end.record(stream)
            queue = hub.queue
            if len(queue) >= hub.queue_size:
                next(self.drops["queue_full"])
                if pair is not None:
                    hub.pools.release(pair)
                return
            # The caller's span, for an exemplar: read here, on timed calls only and after the end stamp
            # (never in the measured time); ~1 µs with OpenTelemetry (docs/design.md, "Exemplars").
            reader = hub.trace_reader
            trace = None
            if reader is not None:
                try:
                    trace = reader()
                except Exception as exc:  # a broken tracer costs the exemplar, not the sample
                    hub.internal.report("exemplar", exc)
            queue.append(Pending(self, index, cold, start_ns, end_ns, pair, self.device, items, size, trace))
            self.last_sample_ns = end_ns
        except Exception as exc:
            if pair is not None:
                hub.pools.release(pair)
            hub.internal.report("instrument", exc)

    def abort(self, token: Token | None) -> None:
        """The timed call raised: give its events back; never raises."""
        if token is None or token[1] is None:
            return
        try:
            self.hub.pools.release(token[1])
        except Exception as exc:
            self.hub.internal.report("instrument", exc)

    def error(self, exc: BaseException) -> None:
        """Count one exception raised by the user's code, by class name (capped); never raises."""
        try:
            cls = type(exc)
            counter = self.errors.get(cls)
            if counter is None:
                counter = self._error_counter(cls)
            next(counter)
            if cls is _OOM and self.hub.on_oom is not None:
                self.hub.on_oom(exc)
        except Exception as inner:
            self.hub.internal.report("errors", inner)

    def _error_counter(self, cls: type) -> itertools.count[int]:
        with self._error_lock:
            names = self._error_names
            name = cls.__name__
            counter = names.get(name)
            if counter is None:
                if len(names) >= self.hub.config.max_exception_labels:
                    name = _OTHER
                counter = names.setdefault(name, itertools.count())
            # Bounded too: beyond this, unseen classes take the lock path (errors are rare anyway).
            if len(self.errors) < 4 * self.hub.config.max_exception_labels:
                self.errors[cls] = counter
            return counter


class _Churn(Exception):
    def __init__(self, model: str, capacity: int) -> None:
        super().__init__(
            f"model {model!r}: more than {capacity} distinct input signatures; new signatures are no "
            "longer treated as cold for this model (warm-up calls still are)"
        )


def hot_path(st: ModelState, fn: Callable[..., Any]) -> Callable[..., Any]:
    """Build the ``__call__`` of one monitored object: the per-call hot path.

    ``fn(self, *args, **kwargs)`` runs the call itself: for a module, its class's own ``__call__``
    (``nn.Module.__call__``: hooks, then ``forward``); for a function, the function. A closure rather
    than a method: the state, the target and the constants are closure cells, read without an
    attribute lookup. On an unsampled call it does: one ``next()``, one comparison and, with signature
    tracking, the signature's dict lookup and one ``next()`` on its counter (which is also how items
    are counted). Everything else is on the rare paths.
    """
    tensor = _Tensor
    general_signature = signature
    clock = perf_counter_ns
    items_fn = st.items_fn

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        items = entry = None
        try:
            # st.calls, not a captured counter: after fork() the child gets fresh counters (reset_after_fork).
            n = next(st.calls)
            sigs = st.sigs
            token: Token | Any | None
            if sigs is not None:
                if len(args) == 1 and not kwargs and type(a := args[0]) is tensor:
                    # The shape alone (a torch.Size hashes ~3x faster than a (shape, dtype) tuple, and
                    # reading dtype costs ~50 ns more): the dtype is checked on timed calls below.
                    key: Hashable = a.shape
                else:
                    key = general_signature(args, kwargs)
                    a = None
                entry = sigs.get(key)
                if entry is None or entry.warm_left:
                    token = st.new_signature(n, key, args, kwargs)
                else:
                    next(entry.calls)
                    if n >= st.next_index:
                        token = st.due(n)
                        if a is not None and token.__class__ is tuple and a.dtype not in entry.dtypes:
                            token = st.new_dtype(entry, a.dtype, token)  # type: ignore[arg-type]
                    else:
                        token = None
            else:
                if st.items_q is not None and items_fn is None:
                    st.items_q.append(batch_of(args, kwargs))  # signatures churned: count items directly
                token = st.due(n) if n >= st.next_index else None
            if items_fn is not None:
                items = st.count_items(args, kwargs)
        except Exception as exc:
            st.hub.internal.report("instrument", exc)
            token = None
        if token is None:
            try:
                return fn(self, *args, **kwargs)
            except BaseException as exc:
                st.error(exc)
                raise
        if token.__class__ is not tuple:  # a capture is pending: the controller runs the call
            try:
                return token.call(st, fn, (self, *args), kwargs)  # type: ignore[union-attr]
            except BaseException as exc:
                st.error(exc)
                raise
        # Sampled calls only: the batch-size histogram, and the work that sets the size class.
        size = items
        if entry is not None:
            if items is None:
                items = entry.items  # known from the signature: no need to look at the tensors again
            if items_fn is None:
                size = entry.work
        else:
            try:
                if items is None:
                    items = batch_of(args, kwargs)
                if items_fn is None:
                    size = work_of(args, kwargs)
            except Exception:
                items = size = None
        t0 = clock()
        try:
            out = fn(self, *args, **kwargs)
        except BaseException as exc:
            st.abort(token)
            st.error(exc)
            raise
        st.finish(token, n, t0, clock(), items, size)
        return out

    return __call__


class Stages:
    """The stages of one model (prefill/decode, or a ``stage=`` callable's labels): a state and a hot
    path per stage, made on the (rare) first call of a new stage, at most ``MAX_STAGES``."""

    def __init__(self, stage_fn: StageFn, make_state: Callable[[str], ModelState], fn: Callable[..., Any], *,
                 first: ModelState, internal: InternalErrors) -> None:
        self.stage_fn = stage_fn
        self._make = make_state
        self._fn = fn
        self.internal = internal
        #: label -> state; every state of the model holds this same dict as ``stages``.
        self.states: dict[str, ModelState] = {}
        #: label -> that stage's hot path (read without a lock by staged_path).
        self.calls: dict[str, Callable[..., Any]] = {}
        self._lock = threading.Lock()
        for st in list((first.stages or {}).values()):  # wrapped again after unwrap(): same counters
            if st is not first:
                self._register(st)
        self.fallback = self._register(first)

    def _register(self, st: ModelState) -> Callable[..., Any]:
        pending = next((s.capture for s in self.states.values() if s.capture is not None), None)
        if pending is not None and st.capture is None:  # a capture of the model is armed: this stage too
            st.capture = pending
            st.next_index = 0
        st.stages = self.states
        self.states[st.stage] = st
        call = self.calls[st.stage] = hot_path(st, self._fn)
        return call

    def add(self, label: Any) -> Callable[..., Any]:
        """The hot path for a stage label not seen before (validated; bounded; "other" beyond)."""
        try:
            label = stage_label(label)
        except ValueError as exc:
            self.internal.report("stage", exc)
            return self.fallback
        with self._lock:
            call = self.calls.get(label)
            if call is not None:
                return call
            if len(self.states) >= MAX_STAGES:
                label = "other"
                if label in self.calls:
                    return self.calls[label]
            return self._register(self._make(label))


def staged_path(stages: Stages) -> Callable[..., Any]:
    """``__call__`` of a model with stages: find the call's stage, then run that stage's hot path.

    One more Python call and the stage function per call (for Hugging Face models: a kwargs lookup
    and the cache's ``get_seq_length()``), on models whose forwards take milliseconds.
    """
    pick = stages.stage_fn
    calls = stages.calls
    add = stages.add
    internal = stages.internal
    local = _generating

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        label = None
        try:
            label = pick(args, kwargs)
            call = calls.get(label) or add(label)
        except Exception as exc:  # the stage function failed: count it, time the call under the fallback
            internal.report("stage", exc)
            call = stages.fallback
        active = local.__dict__.get("requests")
        if active is None or active[0] is not self:
            return call(self, *args, **kwargs)
        if active[2]:  # a timed request: every step of it is timed (CUDA events on GPU: device time per step)
            st = stages.states.get(label)  # type: ignore[arg-type]
            if st is not None:
                st.next_index = 0
        out = call(self, *args, **kwargs)
        # Inside this model's own generate(): each forward of it makes one token per sequence.
        try:
            for g in active[1]:
                g.token()
        except Exception as exc:  # never the user's problem: their output is returned
            internal.report("generation", exc)
        return out

    return __call__


#: Per thread: (model, its requests, timed) while a monitored model's generate() runs on the thread.
_generating = threading.local()


def tracked_generate(generate: Callable[..., Any],
                     start: Callable[[tuple[Any, ...], Mapping[str, Any]], tuple[list[Any], bool]],
                     internal: InternalErrors) -> Callable[..., Any]:
    """A model's own ``generate()`` (Hugging Face's), tracked as generation requests, one per sequence.

    ``start(args, kwargs)`` opens the requests (``GenerationTracker.start``); every forward of the
    model during the call is one token of each (``staged_path``: host time when the forward
    returned, the token is chosen right after), so the first gives the time to first token, the
    next ones the inter-token latency. Works with or without a ``streamer=`` (tokens are timed by
    the forwards, so no device-to-host copy is added) and never syncs. The outcome is ``ok``,
    ``error`` (the exception passes through unchanged) or ``cancelled`` (KeyboardInterrupt and the like).
    ``start`` also says whether this call is a timed request (the first, then one in 1/sample_rate):
    every forward of a timed request is timed, so on CUDA each step gets device time from events
    (``perfmon_forward_duration_seconds{stage}``, host time beside it), never a sync.
    """

    @functools.wraps(generate)
    def generate_(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _generating.__dict__.get("requests") is not None:  # nested: the outer generate() tracks
            return generate(self, *args, **kwargs)
        try:
            requests, timed = start(args, kwargs)
        except Exception as exc:
            internal.report("generation", exc)
            requests, timed = [], False
        _generating.requests = (self, requests, timed)
        outcome = "ok"
        try:
            return generate(self, *args, **kwargs)
        except Exception:
            outcome = "error"
            raise
        except BaseException:
            outcome = "cancelled"
            raise
        finally:
            _generating.requests = None
            for g in requests:
                try:
                    g.finish(outcome)
                except Exception as exc:
                    internal.report("generation", exc)

    return generate_


class Probe:
    """Base of the objects ``Monitor.instrument`` returns (a monitored function).

    Each instance gets its own subclass whose ``__call__`` is ``hot_path(state, target)``
    (see ``Probe.create``); the bounded number of models keeps the number of classes bounded.
    """

    __slots__ = ("_pm", "_pm_fn")

    _pm: ModelState
    _pm_fn: Callable[..., Any]

    @classmethod
    def create(cls, target: Callable[..., Any], state: ModelState) -> Any:
        def call(_probe: Any, *args: Any, **kwargs: Any) -> Any:
            return target(*args, **kwargs)

        mark_for_dynamo()
        sub = type(cls.__name__, (cls,), {"__slots__": (), "__call__": hot_path(state, call),
                                          "__module__": cls.__module__, "__qualname__": cls.__qualname__})
        return sub(target, state)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # pragma: no cover - replaced per instance
        raise TypeError("use Probe.create()")


class MonitoredModule:
    """The mark of a monitored ``nn.Module``: a base of the per-model class ``Monitor.wrap`` gives it.

    ``wrap`` does not return a proxy. It swaps the module's class for a subclass made for this one
    model, with the same name, module and qualified name, whose ``__call__`` is the hot path in front
    of the class's own ``__call__`` (hooks, then ``forward``). So every call is monitored, however it
    comes: through the object ``wrap`` returned, from the model's own methods (Hugging Face
    ``generate()`` calls ``self(...)``), from a parent module or a pipeline holding it. And it is the
    user's object: ``isinstance`` holds, ``.to()``/``.eval()`` return it, ``state_dict`` is unchanged.
    ``type(model) is Cls`` is the one check that no longer holds (``type(model).__name__`` still does).

    Pickling (``torch.save``), ``copy.copy`` and ``copy.deepcopy`` produce the bare class: a copy is a
    new model, not the monitored one. ``Monitor.unwrap`` restores the class.
    """

    __slots__ = ()

    _perfmon_state: ModelState
    _perfmon_base: type

    @classmethod
    def create(cls, module: torch.nn.Module, state: ModelState, stages: Callable[..., Stages] | None = None,
               requests: Callable[[tuple[Any, ...], Mapping[str, Any]], tuple[list[Any], bool]] | None = None
               ) -> Any:
        """Swap ``module``'s class for a monitored subclass (in place); returns ``module``.

        ``stages``, for a model with stages, builds its ``Stages`` from the call target; ``state`` is
        then its first stage's. ``requests`` opens the generation requests of a ``generate()`` call
        (models with stages only: see ``tracked_generate``).
        """
        base = type(module)
        mark_for_dynamo()
        if stages is not None:
            call = staged_path(stages(base.__call__))
        elif base.__call__ is _MODULE_CALL:
            # nn.Module.__call__ only checks for module.compile()'s _compiled_call_impl, then runs
            # _call_impl: calling _call_impl directly saves that frame (~190 ns). module.compile()
            # switches this class back to the full __call__ (_compile_then_call_fully).
            call = hot_path(state, _CALL_IMPL)
        else:
            call = hot_path(state, base.__call__)
        ns: dict[str, Any] = {
            "__slots__": (), "__module__": base.__module__, "__qualname__": base.__qualname__,
            "__doc__": base.__doc__, "_perfmon_state": state, "_perfmon_base": base, "__call__": call,
        }
        if _is_torch_builtin(base.forward):
            ns["forward"] = _compilable_forward(base.forward)
        if stages is not None and requests is not None and callable(getattr(base, "generate", None)):
            ns["generate"] = tracked_generate(base.generate, requests, state.hub.internal)  # type: ignore[attr-defined]
        if stages is None and base.__call__ is _MODULE_CALL:
            ns["compile"] = _compile_then_call_fully(base, state)
        sub = type(base.__name__, (base, cls), ns)
        sub.__reduce_ex__ = _reduce_as(sub, base)  # type: ignore[method-assign]
        sub._apply = _apply_then_relabel(base, state)  # type: ignore[attr-defined]
        module.__class__ = sub
        return module

    @property
    def perfmon_name(self) -> str:
        """The ``model`` label of this module's metrics."""
        return type(self)._perfmon_state.name


def unwrap_module(module: Any) -> Any:
    """Give a monitored module its own class back (exactly: the object is the same); returns it."""
    cls = type(module)
    if not isinstance(module, MonitoredModule):
        raise TypeError(f"{cls.__name__!r} object is not a module monitored by perfmon")
    module.__class__ = cls._perfmon_base
    return module


def _is_torch_builtin(forward: Any) -> bool:
    return str(getattr(forward, "__module__", "")).startswith("torch.")


_MODULE_CALL = torch.nn.Module.__call__
_CALL_IMPL = torch.nn.Module._call_impl


def _compile_then_call_fully(base: type, state: ModelState) -> Callable[..., Any]:
    """``module.compile()``: compile as torch does, then run the full ``nn.Module.__call__`` (which calls
    the compiled ``_compiled_call_impl``) behind the hot path."""
    compile_ = base.compile  # type: ignore[attr-defined]

    def compile(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = compile_(self, *args, **kwargs)
        type(self).__call__ = hot_path(state, base.__call__)
        return result

    return compile


def _compilable_forward(forward: Callable[..., Any]) -> Callable[..., Any]:
    """The builtin ``forward`` behind a frame of perfmon's own (one Python call, builtins only).

    ``torch.compile`` inlines the whole ``__call__`` of a module whose ``forward`` is torch's own
    (``nn.Sequential``, ``nn.Linear``...) instead of compiling its frame; inlined, perfmon's hot path
    would stop the graph and leave the model uncompiled. With a ``forward`` that is not torch's, the
    module's ``__call__`` frame is compiled as for any user-defined model (tests/test_wrap.py). Where
    the builtin's parameters are plain (``forward(self, input)``), the trampoline has the same ones:
    no ``*args``/``**kwargs`` packing (~70 ns instead of ~200 ns).
    """
    import inspect

    try:
        params = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    plain = bool(params) and all(p.kind is p.POSITIONAL_OR_KEYWORD and p.default is p.empty for p in params)
    if plain and all(p.name.isidentifier() for p in params):
        names = ", ".join(p.name for p in params)
        scope: dict[str, Any] = {"forward": forward, "__name__": __name__ + "._trampolines"}
        exec(f"def forward_({names}):\n    return forward({names})\n", scope)  # names from the signature
        return functools.wraps(forward)(scope["forward_"])  # type: ignore[no-any-return]

    @functools.wraps(forward)
    def forward_(self: Any, *args: Any, **kwargs: Any) -> Any:
        return forward(self, *args, **kwargs)

    return forward_


def _reduce_as(sub: type, base: type) -> Callable[..., Any]:
    """``__reduce_ex__`` that pickles and copies a monitored module as its bare class.

    The copy is then loadable where perfmon is not installed, and a deep copy is a new, unmonitored
    model rather than a second object counting under the first one's name.
    """
    import copyreg

    def __reduce_ex__(self: Any, protocol: Any) -> Any:
        rv = super(sub, self).__reduce_ex__(protocol)  # type: ignore[arg-type]
        if not isinstance(rv, tuple) or len(rv) < 2:
            return rv
        func, args = rv[0], rv[1]
        if func is copyreg.__newobj__ and tuple(args) == (sub,):  # type: ignore[attr-defined]
            # pickle insists that __newobj__'s class is type(obj); the reconstructor does the same job.
            return (copyreg._reconstructor, (base, object, None), *rv[2:])  # type: ignore[attr-defined]
        return (func, tuple(base if a is sub else a for a in args), *rv[2:])

    return __reduce_ex__


def _apply_then_relabel(base: type, state: ModelState) -> Callable[..., Any]:
    """``nn.Module._apply`` (behind ``.to()``, ``.cuda()``, ``.half()``...), then re-read the device label."""
    apply = base._apply  # type: ignore[attr-defined]

    def _apply(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = apply(self, *args, **kwargs)
        try:
            for st in list((state.stages or {state.stage: state}).values()):
                st.refresh_device()
        except Exception as exc:
            state.hub.internal.report("device", exc)
        return result

    return _apply


_DYNAMO_MARKED = False


def mark_for_dynamo() -> bool:
    """Tell torch.compile (Dynamo) to run perfmon eagerly and compile only the model it calls.

    Traced, the hot path would graph-break (locks, deques) or, worse, specialise on the call counter
    and recompile on every call. So the hot path's frame is skipped (the frames it calls are still
    compiled: the model's own ``__call__`` frame is compiled whole, zero graph breaks from perfmon) and
    every other perfmon function is skipped with everything it calls (the slow paths, which hold
    locks). Every call is still counted and sampled. The marks are on code objects, free at run time;
    they need ``torch._dynamo`` (~1 s to import), so they are set once something else imported it:
    here when a model is wrapped, and from the resolver's housekeeping tick (``Monitor`` calls it).
    """
    global _DYNAMO_MARKED
    if _DYNAMO_MARKED:
        return True
    import sys

    if "torch._dynamo" not in sys.modules:
        return False
    _DYNAMO_MARKED = True
    try:
        from torch._dynamo.eval_frame import set_code_exec_strategy  # type: ignore[attr-defined]
        from torch._dynamo.types import FrameAction, FrameExecStrategy  # type: ignore[attr-defined]

        for code in _HOT_CODES:
            set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, FrameAction.DEFAULT))
        everything = FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP)
        for code in _perfmon_code(sys.modules):
            if code not in _HOT_CODES:
                set_code_exec_strategy(code, everything)
    except Exception:  # an older or newer torch without these: compile still works, it just traces us
        pass
    return True


def _perfmon_code(modules: Mapping[str, Any]) -> list[types.CodeType]:
    """The code objects of perfmon's functions and methods (module level and in classes)."""
    out: list[types.CodeType] = []
    for name, module in list(modules.items()):
        if not (name == "perfmon" or name.startswith("perfmon.")) or module is None:
            continue
        for obj in list(vars(module).values()):
            if getattr(obj, "__module__", None) != name:
                continue
            members = vars(obj).values() if isinstance(obj, type) else (obj,)
            for member in members:
                fn = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
                fn = fn.fget if isinstance(fn, property) else fn
                code = getattr(fn, "__code__", None)
                if isinstance(code, types.CodeType):
                    out.append(code)
    return out


def _inner_code(fn: Any) -> types.CodeType:
    """The code object of the ``__call__`` a closure factory builds."""
    return next(c for c in fn.__code__.co_consts if getattr(c, "co_name", None) == "__call__")  # type: ignore[no-any-return]


#: Frames torch.compile skips but whose callees it compiles: the user's model runs inside them.
_HOT_CODES = (_inner_code(hot_path), _inner_code(staged_path))


class MonitoredFunction(Probe):
    """A monitored plain callable (a ``generate()`` loop, a pipeline step); also works on methods."""

    __slots__ = ("__dict__", "__weakref__")

    def __init__(self, fn: Callable[..., Any], state: ModelState) -> None:
        self._pm_fn = fn
        self._pm = state
        functools.update_wrapper(self, fn)  # type: ignore[arg-type]

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self
        return types.MethodType(self, instance)

    def __repr__(self) -> str:
        return f"<perfmon monitored {self._pm_fn!r} as {self._pm.name!r}>"


class Span:
    """``with monitor.track(name):`` — count and sample-time a block of code like a call."""

    __slots__ = ("_index", "_st", "_start_ns", "_token")

    def __init__(self, state: ModelState) -> None:
        self._st = state
        self._token: Token | None = None

    def __enter__(self) -> Span:
        st = self._st
        try:
            n = self._index = next(st.calls)
            token = st.due(n) if n >= st.next_index else None
            # Blocks are not captured (a capture profiles calls of a wrapped model or function).
            self._token = token if token.__class__ is tuple else None
        except Exception as exc:
            st.hub.internal.report("instrument", exc)
            self._token = None
        self._start_ns = perf_counter_ns()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        end_ns = perf_counter_ns()
        st = self._st
        if exc is not None:
            st.abort(self._token)
            st.error(exc)
        elif self._token is not None:
            st.finish(self._token, self._index, self._start_ns, end_ns)
