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
from collections.abc import Callable, Hashable, Mapping
from time import perf_counter_ns
from typing import Any

import torch

from ..config import Config
from ..faults import InternalErrors, count_value
from ..selfcost import AgentCpu, HttpShedding
from .clocks import CudaBackend, EventPair, EventPools
from .exemplars import TraceReader, otel_reader
from .phases import Signature, SignatureTable
from .records import DROP_REASONS, Pending
from .sampling import Sampler

__all__ = ["Hub", "ModelState", "Token"]

_OOM = torch.cuda.OutOfMemoryError
#: Builds a ``Pending`` from its fields in order without the named tuple's Python ``__new__`` (~70 against ~320 ns a
#: timed call, all its fields given).
_tuple_new = tuple.__new__
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
        #: perf_counter_ns() when the monitor started (origin of time-to-first-forward).
        self.started_ns = perf_counter_ns()
        #: Called on the request thread with a CUDA OutOfMemoryError (the allocator snapshot).
        self.on_oom: Callable[[BaseException], object] | None = None
        #: Reads the caller's OpenTelemetry span on timed calls only (exemplars); None without OTel.
        self.trace_reader: TraceReader | None = otel_reader()

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
        "stages", "table", "target", "warm", "warmup",
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
        self.table = _table(self)
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

    def members(self) -> list[ModelState]:
        """The states this model's calls feed: its stages' (a generative model), or its own."""
        return list(self.stages.values()) if self.stages else [self]

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
            self.sigs = None  # (``warm`` keeps what it holds: churned, the table no longer changes)
            self.hub.internal.notice("signatures_churned", model=self.name, signatures=table.capacity, note=_CHURNED)
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
        entry.respec(dtype)
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

    def drain_items(self) -> bool:
        """Fold queued per-call items into the totals (resolver housekeeping and scrapes); True if any were."""
        q = self.items_q
        if not q:
            return False
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
        return True

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
               size: int | None = None, sig: Signature | None = None) -> None:
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


#: The ``signatures_churned`` warning's note (a workload's, not a fault: ``InternalErrors.notice``).
_CHURNED = ("more distinct input signatures than signature_cache_size; new signatures are no longer treated as cold "
            "for this model (warm-up calls still are): raise signature_cache_size to keep them")


def _table(st: ModelState) -> SignatureTable:
    """A model's signature table; it fills ``st.warm`` unless an ``items`` callable counts the items (call by call)."""
    cfg = st.hub.config
    return SignatureTable(cfg.signature_cache_size, cfg.signature_warmup_calls, specs=cfg.count_flops,
                          count_items=st.items_on and st.items_fn is None,
                          warm=st.warm if st.items_fn is None else None)
