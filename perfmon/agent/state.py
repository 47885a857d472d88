"""The state the hot path shares: ``Hub`` (one per monitor) and ``ModelState`` (one per model or stage).

``ModelState`` holds what the request thread reads and bumps (plain slots, ``itertools.count``
counters) and the rare paths the hot path falls back to: a new signature, a due sample, a timed
call's start (``begin``), end (``finish``) and failure (``abort``), a user exception's count. The
background stages read its counters. ``Token`` is a timed call in progress.
"""

from __future__ import annotations

import collections
import itertools
import threading
from collections.abc import Callable, Hashable, Iterator, Mapping
from time import perf_counter_ns
from typing import Any

import torch

from ..config import Config
from ..faults import InternalErrors
from ..selfcost import AgentCpu, HttpShedding
from .clocks import CudaBackend, EventPair, EventPools
from .errors import ErrorCounts
from .exemplars import Deferred, TraceReader, otel_deferred
from .items import ItemCounts
from .phases import Signature, SignatureTable, batch_of, work_of
from .records import DROP_REASONS, Pending
from .sampling import Sampler

__all__ = ["GAP_BATCH", "Hub", "ModelState", "Token"]

#: Gaps a model draws at once for its timed calls (``Sampler.gaps``): ~20 µs a batch, once per 256 timed calls.
GAP_BATCH = 256

_OOM = torch.cuda.OutOfMemoryError
#: Builds a ``Pending`` from its fields in order without the named tuple's Python ``__new__`` (~70 against ~320 ns a
#: timed call, all its fields given).
_tuple_new = tuple.__new__
#: A timed call in progress: (cold, CUDA event pair or None on a wall clock, stream or None).
Token = tuple[bool, "EventPair | None", Any]
#: A timed call's token on a wall clock, made once (``begin`` builds nothing before a call's start stamp).
_WALL: dict[bool, Token] = {True: (True, None, None), False: (False, None, None)}


class Hub:
    """What every model's hot path shares: the queue to the resolver, the event pools, fault counts."""

    # Slots: a timed call reads five of these after its end stamp, each a slot read rather than an instance dict's
    # lookup (what a cold cache makes dear: docs/design.md, "After the end stamp").
    __slots__ = ("_wake_at", "backend", "config", "cpu", "created_ns", "http", "internal", "on_oom", "pools", "queue",
                 "queue_size", "requests", "started_ns", "timing", "trace_read", "trace_reader", "wake", "wake_at")

    def __init__(self, config: Config, backend: CudaBackend) -> None:
        self.config = config
        self.backend = backend
        self.queue: collections.deque[Pending] = collections.deque()
        self.queue_size = config.queue_size
        #: Set when a quarter of the queue or of the event pool is waiting: the resolver, which sleeps up to
        #: a second while nothing is in flight, drains it now (``Resolver``: wake only when there is work); at the
        #: first timed call while it dozes (``doze``, agent/doze.py).
        self.wake = threading.Event()
        self.wake_at = self._wake_at = max(1, min(config.queue_size, config.event_pool_size) // 4)
        self.pools = EventPools(backend, config.event_pool_size)
        self.internal = InternalErrors()
        #: CPU seconds the agent's own threads spend (exported as perfmon_agent_cpu_seconds_total).
        self.cpu = AgentCpu()
        #: What the agent's HTTP server refused, and how long it paused for its CPU budget.
        self.http = HttpShedding()
        #: False once the monitor stops: calls are still counted but no longer timed.
        self.timing = True
        #: Request spans open now (requests.py, under its lock). The hot path reads only this while it is 0.
        self.requests = 0
        #: perf_counter_ns() when the monitor was made, and when ``start()`` had it running (its own start-up done;
        #: the construction's until then): the origins of uptime and time to first forward (``first_forward_origin``).
        self.created_ns = self.started_ns = perf_counter_ns()
        #: Called on the request thread with a CUDA OutOfMemoryError (the allocator snapshot).
        self.on_oom: Callable[[BaseException], object] | None = None
        #: On timed calls only, after the end stamp (exemplars): reads the caller's OpenTelemetry span, or (with
        #: ``trace_read`` set) takes what the resolver reads it from; None: no exemplars (no OTel).
        self.trace_reader: TraceReader | Callable[[], Any] | None = None
        #: The resolver's half of the default reader (``exemplars.Deferred.read``), or None: ``trace_reader`` reads.
        self.trace_read: Callable[[Any], tuple[int, int] | None] | None = None
        self.set_trace_reader(otel_deferred())

    def set_trace_reader(self, reader: TraceReader | Deferred | None) -> None:
        """A reader for the exemplars' spans: a ``TraceReader`` (on the request thread), a ``Deferred`` (taken
        there, read on the resolver thread) or None (no exemplars)."""
        if isinstance(reader, Deferred):
            self.trace_reader, self.trace_read = reader.take, reader.read
        else:
            self.trace_reader, self.trace_read = reader, None

    def first_forward_origin(self, end_ns: int) -> int:
        """Where a model's time to first forward counts from, for a first call that ended at ``end_ns``: the monitor's
        start (perfmon's own start-up, ~1.6 s with the profiler prepared, is not the model's), or its construction for
        a model first called before ``start()``."""
        started = self.started_ns
        return started if end_ns >= started else self.created_ns

    def doze(self, on: bool) -> bool:
        """The resolver dozes (on): the queue's first timed call wakes it; True if one waits already."""
        self.wake_at = 1 if on else self._wake_at
        return bool(self.queue)

    def reset_after_fork(self) -> None:
        """In a forked child: fresh queue, event pools (CUDA state does not survive fork), fault counts."""
        self.queue = collections.deque()
        self.wake = threading.Event()
        self.wake_at = self._wake_at
        self.pools = EventPools(self.backend, self.config.event_pool_size)
        self.internal.reset_after_fork()  # reset in place: collectors hold references to these
        self.cpu.reset_after_fork()
        self.http.reset_after_fork()
        self.created_ns = self.started_ns = perf_counter_ns()


class ModelState:
    """Everything perfmon knows about one monitored model (or function, or span name).

    Attributes read by the hot path are plain slots; the background stages read the counters and
    write ``next_index`` (to enforce the sampling floor) and ``device`` (when the model moves).
    """

    __slots__ = (
        "_resolve_device", "attached", "calls", "calls_seen", "capturable", "capture", "cuda_index", "device", "drops",
        "errors", "gap", "gaps", "hub", "item_counts", "items_fn", "items_on", "last_sample_ns", "name", "next_index",
        "sampled", "sampler", "sigs", "stage", "stages", "table", "target", "warm", "warmup",
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
        self.item_counts = ItemCounts(self.items_fn, self.items_on, hub.internal)
        #: False for track() blocks: a capture profiles calls of a wrapped model or function.
        self.capturable = capturable
        #: False once its module was unwrapped (its name may be wrapped again and continue these counters).
        self.attached = True
        self.hub = hub
        self.calls = itertools.count()
        #: ``calls`` as the resolver's last pass read it (that thread alone writes it): calls since then keep the
        #: pass from counting as quiet (agent/doze.py), timed or not.
        self.calls_seen = 0
        self.sampled = itertools.count()  # timed attempts, drops included
        self.drops = {reason: itertools.count() for reason in DROP_REASONS}
        self.errors = ErrorCounts(cfg.max_exception_labels)
        self.warmup = cfg.warmup_calls
        self.sampler = Sampler(cfg.sample_rate, cfg.sample_floor_seconds)
        #: Calls from a steady timed call to the next: drawn after a timed call, added at the next one (``begin``).
        self.gap = self.sampler.gap()
        #: The gaps ``finish`` takes next (``Sampler.gaps``; empty: the first timed call draws a batch).
        self.gaps: Iterator[int] = iter(())
        # 0 until warm-up ends: every warm-up call takes the (cold, timed) slow path.
        self.next_index = 0 if cfg.warmup_calls else self.sampler.first_index(0)
        self.last_sample_ns = perf_counter_ns()
        #: The warm signatures of the hot path's one-tensor fast path (SignatureTable.warm): one dict for good.
        self.warm: dict[Hashable, Signature] = {}
        self.table = _table(self)
        self.sigs: dict[Hashable, Signature] | None = self.table.seen if cfg.track_signatures else None
        self.target: Any = None  #: weakref to the wrapped module (FLOPs are counted on a fake copy of it), else None
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
        self.calls_seen = 0
        self.sampled = itertools.count()
        self.drops = {reason: itertools.count() for reason in DROP_REASONS}
        self.errors = ErrorCounts(cfg.max_exception_labels)
        tracking = self.sigs is not None or self.table.churning
        self.table.orphan()
        self.table = _table(self)
        self.sigs = self.table.seen if (tracking and cfg.track_signatures) else None
        self.item_counts.reset_after_fork(self.sigs is not None)
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

    def members(self) -> list[ModelState]:
        """The states this model's calls feed: its stages' (a generative model), or its own."""
        return list(self.stages.values()) if self.stages else [self]

    def error_counts(self) -> dict[str, int]:
        return self.errors.counts()

    # -- request-thread side (cold paths; the per-call path is inlined in Probe.__call__) -----

    def new_signature(self, index: int, key: Hashable, args: tuple[Any, ...],
                      kwargs: Mapping[str, Any]) -> Token | Any | None:
        """A signature new or still warming up: count it; the call is cold (and timed) while it warms."""
        table = self.table
        cold = table.observe(key, args, kwargs)
        if table.churning and self.sigs is not None:
            self.item_counts.per_call()
            self.sigs = None  # (``warm`` keeps what it holds: churned, the table no longer changes)
            self.hub.internal.notice("signatures_churned", model=self.name, signatures=table.capacity, note=_CHURNED)
        if index < self.warmup:
            return self.due(index)
        if cold:
            return self.begin(index, True)
        return self.due(index) if index >= self.next_index else None

    def new_dtype(self, entry: Signature, dtype: Any) -> None:
        """A timed call of a known shape in a dtype not seen with it: a new signature, so the call was cold.

        Noticed on timed calls only, after their end stamp (``finish``; the unsampled path keys on the shape
        alone): a dtype switch is a deployment event (fp32 to bf16), not per-request traffic.
        """
        entry.dtypes = entry.dtypes | {dtype}
        entry.add_dtype(dtype)
        self.table.distinct += 1

    def items_counts(self) -> tuple[int | None, int | None]:
        """(items, padded items) so far, exact; None where not counted (``ItemCounts.counts``)."""
        return self.item_counts.counts(self.table)

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
        not timed: its overhead is not the model's latency).

        Only what must precede the call: under GIL contention, work the request thread does between deciding
        to time a call and its start stamp slows the timed call itself (~6% for ~10 µs, BENCHMARKS §3b, "Before
        the start stamp"), so counting, the next gap's draw and describing the call wait for ``finish``."""
        capture = self.capture
        if capture is not None:
            return capture
        hub = self.hub
        if not hub.timing:
            return None
        if not cold:
            self.next_index = index + self.gap
        cuda = self.cuda_index
        if cuda < 0:
            return _WALL[cold]
        backend = hub.backend
        if backend.is_capturing(cuda):
            self._drop("graph_capture")
            return None
        pair = hub.pools.get(cuda).acquire()
        if pair is None:
            self._drop("pool_exhausted")
            return None
        try:
            stream = backend.current_stream(cuda)
            pair.start.record(stream)
        except BaseException:
            hub.pools.release(pair)
            raise
        return (cold, pair, stream)

    def _drop(self, reason: str) -> None:
        """A timed attempt ``begin`` could not time: counted as sampled and dropped for ``reason``."""
        next(self.sampled)
        next(self.drops[reason])
        self.gap = self.sampler.gap()

    def finish(self, token: Token, index: int, start_ns: int, end_ns: int, items: int | None = None,
               sig: Signature | None = None, args: tuple[Any, ...] | None = None,
               kwargs: Mapping[str, Any] | None = None) -> None:
        """Close a timed call and hand it to the resolver; never raises.

        ``items``: what the user's ``items`` callable gave, or None; ``sig``: the call's signature, or None; ``args``
        and ``kwargs``: the call's inputs (its items and size class when ``sig`` is None, its dtype when ``sig`` keys
        a tensor's shape alone), or None when it has none (a ``track`` block)."""
        cold, pair, stream = token
        hub = self.hub
        try:
            if pair is not None:
                pair.end.record(stream)
            next(self.sampled)
            # The next gap from a batch drawn ahead: one C call, where the Sampler's draw is a Python frame of its own
            # (~3-7 µs of a timed call's cold cost after its end stamp in a server: docs/design.md, "After the end
            # stamp").
            gap = next(self.gaps, 0)
            if not gap:  # the batch used up (1 timed call in GAP_BATCH): the next one
                self.gaps = gaps = self.sampler.gaps(GAP_BATCH)
                gap = next(gaps)
            self.gap = gap
            size = items  # an items callable's count is the size class too
            if sig is not None:
                if items is None:
                    items = sig.items  # known from the signature: no need to look at the tensors again
                if self.items_fn is None:
                    size = sig.work
                dtypes = sig.dtypes  # a shape-keyed signature's (one tensor): is this a dtype not seen with it?
                dtype = getattr(args[0], "dtype", None) if dtypes and args else None
                if dtype is not None:
                    if dtype not in dtypes:
                        self.new_dtype(sig, dtype)
                        cold = True
                    variants = sig.variants
                    if variants is not None:  # the sample is priced in its own dtype (Signature.add_dtype)
                        sig = variants.get(dtype, sig)
            elif args is not None:
                try:
                    if items is None:
                        items = batch_of(args, kwargs or {})
                    if self.items_fn is None:
                        size = work_of(args, kwargs or {})
                except Exception:
                    items = size = None
            queue = hub.queue
            if len(queue) >= hub.queue_size:
                next(self.drops["queue_full"])
                if pair is not None:
                    hub.pools.release(pair)
                return
            # The caller's span, for an exemplar: read here, on timed calls only and after the end stamp
            # (never in the measured time); ~1 µs with OpenTelemetry (docs/design.md, "Exemplars").
            # The default reader's first half (exemplars.otel_deferred): OpenTelemetry's context, read by the resolver.
            reader = hub.trace_reader
            trace = None
            if reader is not None:
                try:
                    trace = reader()
                except Exception as exc:  # a broken tracer costs the exemplar, not the sample
                    hub.internal.report("exemplar", exc)
            queue.append(_tuple_new(Pending, (self, index, cold, start_ns, end_ns, pair, self.device, items, size,
                                                   trace, sig)))
            self.last_sample_ns = end_ns
            if len(queue) >= hub.wake_at:
                hub.wake.set()
        except Exception as exc:
            if pair is not None:
                hub.pools.release(pair)
            hub.internal.report("instrument", exc)

    def abort(self, token: Token | None) -> None:
        """The timed call raised: count the attempt, give its events back; never raises."""
        if token is None:
            return
        try:
            next(self.sampled)
            self.gap = self.sampler.gap()
            if token[1] is not None:
                self.hub.pools.release(token[1])
        except Exception as exc:
            self.hub.internal.report("instrument", exc)

    def error(self, exc: BaseException) -> None:
        """Count one exception raised by the user's code, by class name (capped); never raises."""
        try:
            cls = type(exc)
            errors = self.errors
            counter = errors.by_class.get(cls)
            if counter is None:
                counter = errors.counter(cls)
            next(counter)
            if cls is _OOM and self.hub.on_oom is not None:
                self.hub.on_oom(exc)
        except Exception as inner:
            self.hub.internal.report("errors", inner)


#: The ``signatures_churned`` warning's note (a workload's, not a fault: ``InternalErrors.notice``).
_CHURNED = ("more distinct input signatures than signature_cache_size; new signatures are no longer treated as cold "
            "for this model (warm-up calls still are): raise signature_cache_size to keep them")


def _table(st: ModelState) -> SignatureTable:
    """A model's signature table; it fills ``st.warm`` unless an ``items`` callable counts the items (call by call)."""
    cfg = st.hub.config
    return SignatureTable(cfg.signature_cache_size, cfg.signature_warmup_calls, specs=cfg.count_flops,
                          count_items=st.items_on and st.items_fn is None,
                          warm=st.warm if st.items_fn is None else None)
