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

from .clocks import CudaBackend, EventPair, EventPools
from .config import Config
from .faults import InternalErrors, count_value
from .phases import Signature, SignatureTable, batch_of, signature
from .records import DROP_REASONS, Pending
from .sampling import Sampler
from .selfcost import AgentCpu, HttpShedding

__all__ = ["Hub", "ModelState", "MonitoredFunction", "MonitoredModule", "Probe", "Span"]

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
        "_error_lock", "_error_names", "_items_lock", "_resolve_device", "calls", "capturable", "capture",
        "cuda_index", "device", "drops", "errors", "hub", "items_fn", "items_on", "items_padded", "items_q",
        "items_total", "last_sample_ns", "name", "next_index", "padded_total", "sampled", "sampler", "sigs", "table",
        "warmup",
    )

    def __init__(self, name: str, hub: Hub, resolve_device: Callable[[], str], *, capturable: bool = True,
                 items: Any = None) -> None:
        cfg = hub.config
        self.name = name
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
            if index == warmup - 1:
                # Warm-up ends: steady sampling starts at a random phase.
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

    def finish(self, token: Token, index: int, start_ns: int, end_ns: int, items: int | None = None) -> None:
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
            queue.append(Pending(self, index, cold, start_ns, end_ns, pair, self.device, items))
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

    A closure rather than a method: the state, the target and the constants are closure cells, read
    without an attribute lookup (a proxy class that defines ``__getattr__`` pays extra for every
    ``self.x``). On an unsampled call it does: one ``next()``, one comparison and, with signature
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
                    key: Hashable = (a.shape, a.dtype)
                else:
                    key = general_signature(args, kwargs)
                entry = sigs.get(key)
                if entry is None or entry.warm_left:
                    token = st.new_signature(n, key, args, kwargs)
                else:
                    next(entry.calls)
                    token = st.due(n) if n >= st.next_index else None
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
                return fn(*args, **kwargs)
            except BaseException as exc:
                st.error(exc)
                raise
        if token.__class__ is not tuple:  # a capture is pending: the controller runs the call
            try:
                return token.call(st, fn, args, kwargs)  # type: ignore[union-attr]
            except BaseException as exc:
                st.error(exc)
                raise
        if items is None:  # sampled calls only: the batch-size histogram
            if entry is not None:
                items = entry.items  # known from the signature: no need to look at the tensors again
            else:
                try:
                    items = batch_of(args, kwargs)
                except Exception:
                    items = None
        t0 = clock()
        try:
            out = fn(*args, **kwargs)
        except BaseException as exc:
            st.abort(token)
            st.error(exc)
            raise
        st.finish(token, n, t0, clock(), items)
        return out

    return __call__


class Probe:
    """Base of the objects ``Monitor.wrap``/``instrument`` return.

    Each instance gets its own subclass whose ``__call__`` is ``hot_path(state, target)``
    (see ``Probe.create``); the bounded number of models keeps the number of classes bounded.
    """

    __slots__ = ("_pm", "_pm_fn")

    _pm: ModelState
    _pm_fn: Callable[..., Any]

    @classmethod
    def create(cls, target: Callable[..., Any], state: ModelState) -> Any:
        sub = type(cls.__name__, (cls,), {"__slots__": (), "__call__": hot_path(state, target),
                                          "__module__": cls.__module__, "__qualname__": cls.__qualname__})
        return sub(target, state)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # pragma: no cover - replaced per instance
        raise TypeError("use Probe.create()")


_OWN = frozenset(("_pm", "_pm_fn"))


class MonitoredModule(Probe):
    """A transparent proxy of an ``nn.Module`` whose calls are monitored.

    Attribute reads and writes go to the module; ``isinstance(proxy, type(module))`` holds; methods
    that return the module itself (``.eval()``, ``.to()``, ``.cuda()``, ``.half()``,
    ``.requires_grad_()``...) return the proxy, so ``model = model.to(device).eval()`` stays
    monitored. Pickling (``torch.save``) saves the bare module.
    """

    __slots__ = ()

    def __init__(self, module: torch.nn.Module, state: ModelState) -> None:
        object.__setattr__(self, "_pm_fn", module)
        object.__setattr__(self, "_pm", state)

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        return type(self._pm_fn)

    def __getattr__(self, name: str) -> Any:
        module = object.__getattribute__(self, "_pm_fn")
        value = getattr(module, name)
        if isinstance(value, types.MethodType) and value.__self__ is module:
            return self._rebind(value)
        return value

    def _rebind(self, method: Callable[..., Any]) -> Callable[..., Any]:
        module = self._pm_fn

        @functools.wraps(method)
        def call(*args: Any, **kwargs: Any) -> Any:
            result = method(*args, **kwargs)
            if result is module:
                # The module may have moved (.to/.cuda/.cpu): re-read its device now.
                try:
                    self._pm.refresh_device()
                except Exception as exc:
                    self._pm.hub.internal.report("device", exc)
                return self
            return result

        return call

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self._pm_fn, name, value)

    def __delattr__(self, name: str) -> None:
        delattr(self._pm_fn, name)

    def __dir__(self) -> list[str]:
        return dir(self._pm_fn)

    def __repr__(self) -> str:
        return repr(self._pm_fn)

    # Containers (nn.Sequential, nn.ModuleList, nn.ModuleDict): special methods bypass __getattr__.
    def __len__(self) -> int:
        return len(self._pm_fn)  # type: ignore[arg-type]

    def __iter__(self) -> Any:
        return iter(self._pm_fn)  # type: ignore[call-overload]

    def __getitem__(self, key: Any) -> Any:
        return self._pm_fn[key]  # type: ignore[index]

    def __contains__(self, key: Any) -> bool:
        return key in self._pm_fn  # type: ignore[operator]

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self._pm_fn.__reduce_ex__(protocol)

    @property
    def perfmon_name(self) -> str:
        """The ``model`` label of this proxy's metrics."""
        return self._pm.name

    @property
    def unwrapped(self) -> torch.nn.Module:
        """The bare module."""
        return self._pm_fn  # type: ignore[return-value]


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
