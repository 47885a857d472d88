"""Request spans: a served request's end-to-end latency split into queue, model and rest.

    request thread   RequestTracker.open(): one lock (the open-span count), a RequestSpan (__slots__)
                     wrapped calls in the span's context stamp its first model start and last end
                     (hotpath.in_request); track() blocks and batch() call RequestSpan.model_call()
                     RequestSpan.finish(): one lock, one counter, one deque append ─► RequestTracker.queue
    resolver thread  RequestTracker.drain() (Monitor._tick) ─► sinks: RequestCollector.observe (histograms)
                     and the /stats rings kept here (``recent``, ``stats``)

Definitions (README, docs/metrics.md "Request spans"), host time (``perf_counter_ns``) throughout:

- **total** = arrival (entering the span, or ``arrived_ns``) → the span's end (exit, or the response's last
  byte handed to the server by the middleware);
- **model** = the start of the first model work → the end of the last: wrapped calls, tracked ``generate()``
  forwards and ``monitor.track`` blocks that run in the span's context (a ``contextvars`` variable: threads
  started with a copied context and ``run_in_threadpool`` see it), or a ``monitor.batch(spans)`` block on a
  batcher thread, which stamps every span of the batch at once;
- **queue** = ``span.enqueued()`` → the model's start; 0 when the server never marks an enqueue (the time
  before the model is then pre-processing, part of rest);
- **rest** = total - queue - model: pre- and post-processing, serialisation, sending.

The hot path pays one attribute read (``Hub.requests``, the number of open spans in the process) while no
span is open; only then does it read the context variable and stamp (hotpath.py).
"""

from __future__ import annotations

import collections
import itertools
import threading
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from time import perf_counter_ns
from types import TracebackType
from typing import Any

from ..config import log_buckets
from ..exceptions import ConfigError
from ..faults import InternalErrors, count_value
from ..stats.windows import summarize
from .gen_events import check_name
from .state import Hub
from .streams import OK, OUTCOMES, outcome_of

__all__ = ["PARTS", "REQUEST_BUCKETS", "RequestApi", "RequestBatch", "RequestCounts", "RequestDone", "RequestSpan",
           "RequestTracker", "check_span_name", "current"]

#: The parts of a request's latency (the ``part`` label; ``phase`` already means cold/steady here).
PARTS = ("queue", "model", "rest")
#: Request latency buckets (s): 5 per decade (adjacent bounds 58% apart, histogram_quantile within ~25%)
#: from 0.1 ms to 63 s: 30 bounds, the same for every part and the end-to-end duration, so that four
#: histograms per model stay within its series budget (docs/metrics.md). Queue waits of a dynamic batcher
#: are milliseconds (its max wait), a request's rest from 0.1 ms (a JSON body) to seconds (a large upload).
REQUEST_BUCKETS: tuple[float, ...] = log_buckets(0.0001, 60.0, 5)

#: The request span (or batch) of the running context; None outside one. Read by the hot path only while
#: ``Hub.requests`` says a span is open somewhere in the process.
current: ContextVar[Any] = ContextVar("perfmon_request", default=None)

#: A request that ended ok after model work, as the resolver hands it to the sinks:
#: (model, end_ns, total_s, queue_s, model_s, rest_s).
RequestDone = tuple[str, int, float, float, float, float]


class RequestCounts:
    """Exact request counts of one ``model`` label, by outcome, read at scrape time."""

    __slots__ = ("dropped", "name", "requests")

    def __init__(self, name: str) -> None:
        self.name = name
        self.requests = {o: itertools.count() for o in OUTCOMES}
        self.dropped = itertools.count()  # timings lost to a full queue (the request is still counted)

    def request_counts(self) -> dict[str, int]:
        return {o: count_value(c) for o, c in self.requests.items()}


def check_span_name(name: Any) -> None:
    """A request span's name: the generation names' rule, the ``model`` label on every render (ConfigError)."""
    check_name(name, "request span name")


class RequestSpan:
    """One served request: ``with monitor.request():`` (or a middleware) from its arrival to its response.

    ``enqueued()`` marks when it entered a queue or batcher. Model work in its context marks the model part
    (``model_call``); so does ``monitor.batch(spans)`` on a batcher thread. The block's exception passes
    through unchanged: an Exception ends it ``error``, another BaseException ``cancelled``.
    """

    __slots__ = ("_epoch", "_token", "_tracker", "arrived_ns", "end_ns", "enqueued_ns", "model", "model_end_ns",
                 "model_start_ns", "name", "outcome")

    def __init__(self, tracker: RequestTracker, name: str | None, arrived_ns: int, epoch: int) -> None:
        self._tracker = tracker
        self._epoch = epoch
        self._token: Any = None
        self.name = name  # the model label given to the span, or None: the first model work's
        self.arrived_ns = arrived_ns
        self.enqueued_ns: int | None = None
        self.model_start_ns: int | None = None
        self.model_end_ns: int | None = None
        self.model: str | None = None  # the model of the earliest-starting model work
        self.end_ns: int | None = None
        self.outcome: str | None = None  # set once, by finish()

    def enqueued(self, at_ns: int | None = None) -> None:
        """Mark now (or ``at_ns``, a ``perf_counter_ns`` stamp) as when the request entered a queue or batcher:
        queue time runs from here to the model's start. The first mark stands."""
        if self.enqueued_ns is None:
            self.enqueued_ns = perf_counter_ns() if at_ns is None else at_ns

    def model_call(self, start_ns: int, end_ns: int, model: str | None) -> None:
        """Model work of this request ran from ``start_ns`` to ``end_ns`` (hot path, track, batch)."""
        first = self.model_start_ns
        if first is None or start_ns < first:
            self.model_start_ns = start_ns
            if model is not None:
                self.model = model
        last = self.model_end_ns
        if last is None or end_ns > last:
            self.model_end_ns = end_ns

    def finish(self, outcome: str = OK, at_ns: int | None = None) -> None:
        """End the request with ``outcome`` (ok, error, cancelled) now or at ``at_ns``. Idempotent: the first wins."""
        if outcome not in OUTCOMES:
            raise ConfigError(f"outcome={outcome!r}: expected one of {', '.join(OUTCOMES)}")
        self._tracker.close(self, outcome, perf_counter_ns() if at_ns is None else at_ns)

    @property
    def label(self) -> str:
        """The ``model`` label it is counted under: its name, else its first model work's model, else ""."""
        return self.name if self.name is not None else (self.model or "")

    def parts(self) -> dict[str, float] | None:
        """Once ended: queue, model, rest and total in seconds (None before, or without model work)."""
        parts = _parts_ns(self)
        return None if parts is None else dict(zip(("total", *PARTS), (v / 1e9 for v in parts), strict=True))

    def __enter__(self) -> RequestSpan:
        self._token = current.set(self)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        end = perf_counter_ns()
        _reset(self._token)
        self.finish(outcome_of(exc), end)

    async def __aenter__(self) -> RequestSpan:
        return self.__enter__()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.__exit__(exc_type, exc, tb)

    def __repr__(self) -> str:
        return f"<RequestSpan {self.label!r} outcome={self.outcome or 'in flight'}>"


class RequestBatch:
    """``with monitor.batch(spans):`` on a batcher thread: the block is the model part of every span in it.

    A wrapped call inside the block gives the spans its model label (when they have no name of their own).
    """

    # model_start_ns/model_end_ns: the hot path stamps a batch as it stamps a span (hotpath.in_request).
    __slots__ = ("_token", "model", "model_end_ns", "model_start_ns", "name", "spans", "start_ns")

    def __init__(self, spans: Iterable[RequestSpan | None], name: str | None = None) -> None:
        self.spans = [s for s in spans if s is not None]
        self.name = name
        self.model: str | None = None
        self.model_start_ns: int | None = None
        self.model_end_ns: int | None = None
        self._token: Any = None
        self.start_ns = 0

    def model_call(self, start_ns: int, end_ns: int, model: str | None) -> None:
        """A wrapped call in the block: remember the model of the earliest one."""
        if self.model_start_ns is None or start_ns < self.model_start_ns:
            self.model_start_ns = start_ns
            self.model = model

    def __enter__(self) -> RequestBatch:
        self._token = current.set(self)
        self.start_ns = perf_counter_ns()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        end = perf_counter_ns()
        _reset(self._token)
        model = self.name if self.name is not None else self.model
        for span in self.spans:
            span.model_call(self.start_ns, end, model)


def _reset(token: Any) -> None:
    if token is None:
        return
    try:
        current.reset(token)
    except ValueError:  # exited in another context than it entered (an async generator's): leave that one
        pass


def _parts_ns(span: RequestSpan) -> tuple[int, int, int, int] | None:
    """(total, queue, model, rest) in ns of an ended span with model work, else None."""
    start, stop, end = span.model_start_ns, span.model_end_ns, span.end_ns
    if start is None or stop is None or end is None:
        return None
    total = max(0, end - span.arrived_ns)
    model = max(0, stop - start)
    enq = span.enqueued_ns
    queue = 0 if enq is None else min(total, max(0, start - max(enq, span.arrived_ns)))
    model = min(model, total - queue)  # model work outside the span (a batch stamped late) is not the request's
    return total, queue, model, max(0, total - queue - model)


class RequestTracker:
    """Open spans (``Hub.requests``), exact counts per ``model`` label, the record queue and the /stats rings."""

    def __init__(self, hub: Hub) -> None:
        cfg = hub.config
        self._hub = hub
        self._internal: InternalErrors = hub.internal
        #: Names given to spans (``request(name=...)``), beyond the wrapped models' own: at most ``max_models``.
        self.max_names = cfg.max_models
        self.queue_size = cfg.generation_queue_size  # the generation records' bound: ~1 record per request here
        self.wake_at = self._wake_at = max(1, self.queue_size // 4)  # a quarter; one while the resolver dozes
        self.window_ns = int(cfg.stats_window_seconds * 1e9)
        self.max_samples = cfg.stats_max_samples
        self.sinks: list[Callable[[list[RequestDone]], None]] = []
        #: Called in a forked child after the tracker's own reset (the collector's histograms).
        self.on_fork: list[Callable[[], None]] = []
        self._epoch = 0
        self._reset()

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._names: dict[str, RequestCounts] = {}
        self._named = 0  # names given to spans (request(name=...)): capped at max_names
        self.queue: collections.deque[tuple[RequestCounts, int, int, int, int, int]] = collections.deque()
        self._rings: dict[str, collections.deque[tuple[int, float, float, float, float]]] = {}
        self._rings_lock = threading.Lock()
        self._hub.requests = 0

    def reset_after_fork(self) -> None:
        """In a forked child: no span is open here (one the forking thread ends later is not counted down)."""
        self._epoch += 1
        self._reset()
        for reset in self.on_fork:
            reset()

    # -- request path -------------------------------------------------------------------------

    def open(self, name: str | None = None, arrived_ns: int | None = None) -> RequestSpan:
        """A new request span, arrived now (or at ``arrived_ns``, a ``perf_counter_ns`` stamp).

        ``name`` fixes its ``model`` label (at most ``max_names`` such names); None takes the first model work's
        model. Use it as a context manager, or end it with ``finish()``. This runs in the request path, so a name
        perfmon cannot take (invalid, or a new one past ``max_models``) never raises here: the span goes on as if
        unnamed, and each such span counts in ``perfmon_internal_errors_total{stage="requests"}``.
        """
        now = perf_counter_ns() if arrived_ns is None else arrived_ns
        if name is not None:
            name = self.take_name(name)
        with self._lock:
            self._hub.requests += 1
        return RequestSpan(self, name, now, self._epoch)

    def take_name(self, name: str | None) -> str | None:
        """``name`` registered as a span label (``open``, ``monitor.batch``), or None when perfmon cannot take it (not a
        valid label, or one past ``max_models``): counted as an internal error, never raised into the request."""
        if name is None:
            return None
        try:
            if name not in self._names:  # (an unhashable name raises here: refused the same way)
                self._register(name, named=True)
        except (ConfigError, TypeError) as exc:
            self._internal.report("requests", exc)
            return None
        return name

    def _register(self, name: str, *, named: bool = False) -> RequestCounts:
        if named:
            check_span_name(name)
        with self._lock:
            counts = self._names.get(name)
            if counts is None:
                if named:
                    if self._named >= self.max_names:
                        raise ConfigError(f"at most max_models={self.max_names} request span names per monitor "
                                          f"(each is a label value on every request metric); {name!r} is one more")
                    self._named += 1
                counts = self._names[name] = RequestCounts(name)
        return counts

    def close(self, span: RequestSpan, outcome: str, end_ns: int) -> None:
        """End ``span`` (``RequestSpan.finish``): count it, queue its parts for the resolver. Idempotent."""
        hub = self._hub
        with self._lock:  # check-and-set under the lock: two threads ending one span count it once
            if span.outcome is not None:
                return
            span.outcome = outcome
            span.end_ns = end_ns
            if span._epoch != self._epoch:  # opened before a fork: the parent's request, not this process's
                return
            if hub.requests > 0:
                hub.requests -= 1
        label = span.label
        counts = self._names.get(label)
        if counts is None:
            # Unnamed spans take a wrapped model's name (bounded by max_models) or "": no cap needed here.
            counts = self._register(label)
        next(counts.requests[outcome])
        if outcome != OK or not hub.timing:  # as for forwards: a failed request's length is not the server's speed
            return
        parts = _parts_ns(span)
        if parts is None:  # no model work: counted, not split
            return
        queue = self.queue
        if len(queue) >= self.queue_size:
            next(counts.dropped)
            return
        queue.append((counts, end_ns, *parts))
        if len(queue) >= self.wake_at:
            hub.wake.set()

    def doze(self, on: bool) -> bool:
        """The resolver dozes (on): the first record wakes it; True if one waits already."""
        self.wake_at = 1 if on else self._wake_at
        return bool(self.queue)

    # -- resolver thread ----------------------------------------------------------------------

    def drain(self, now_ns: int | None = None) -> int:
        """Turn queued records into seconds for the sinks and the /stats rings; returns how many. Never raises."""
        queue = self.queue
        done = 0
        while queue:
            batch: list[RequestDone] = []
            while len(batch) < 4096:
                try:
                    counts, end, total, q, m, r = queue.popleft()
                except IndexError:
                    break
                batch.append((counts.name, end, total / 1e9, q / 1e9, m / 1e9, r / 1e9))
            if not batch:
                break
            done += len(batch)
            for sink in (self._remember, *self.sinks):
                try:
                    sink(batch)
                except Exception as exc:
                    self._internal.report("requests", exc)
        return done

    def _remember(self, batch: list[RequestDone]) -> None:
        """The /stats rings: (end_ns, queue, model, rest, total) per model, bounded by max_samples."""
        rings = self._rings
        with self._rings_lock:
            for model, end, total, q, m, r in batch:
                ring = rings.get(model)
                if ring is None:
                    ring = rings[model] = collections.deque(maxlen=self.max_samples)
                ring.append((end, q, m, r, total))

    # -- reading ------------------------------------------------------------------------------

    @property
    def open_spans(self) -> int:
        """Spans open now in this process (this monitor's)."""
        return self._hub.requests

    def names(self) -> list[RequestCounts]:
        """Every ``model`` label's counts, in registration order."""
        return list(self._names.values())

    def recent(self, model: str, since_ns: int, until_ns: int | None = None) -> dict[str, dict[str, Any]]:
        """Per part (queue, model, rest) and total: count, mean, max, p50/p95/p99 (seconds) of ``model``'s requests
        that ended ok after model work with ``since_ns <= end <= until_ns`` (``perf_counter_ns``; until: now),
        among the latest ``stats_max_samples`` of the model. Pure: a read of the rings (resolved requests only)."""
        until = perf_counter_ns() if until_ns is None else until_ns
        with self._rings_lock:
            ring = self._rings.get(model)
            rows = [row for row in ring if since_ns <= row[0] <= until] if ring is not None else []
        return {part: summarize([row[i] for row in rows]) for i, part in enumerate((*PARTS, "total"), start=1)}

    def stats(self, now_ns: int | None = None, started_ns: int | None = None) -> dict[str, Any]:
        """For /stats: open spans, and per ``model`` label exact counts and the split over the stats window.

        Settles the record queue first (on the reading thread, each record once), so that the split covers every
        request the counts do: a page read between the resolver's drains would otherwise show counts with no
        split."""
        self.drain()
        now = perf_counter_ns() if now_ns is None else now_ns
        cutoff = now - self.window_ns if started_ns is None else max(now - self.window_ns, started_ns)
        models = {}
        for c in self.names():
            models[c.name] = {"requests": c.request_counts(), "dropped": count_value(c.dropped),
                              **self.recent(c.name, cutoff, now)}
        return {"open": self._hub.requests, "models": models}


class RequestApi:
    """The request-span part of ``Monitor``'s surface (kept here with the stage it drives; monitor.py wires)."""

    requests: RequestTracker

    def request(self, name: str | None = None, *, arrived_ns: int | None = None) -> RequestSpan:
        """A request span: ``with monitor.request(): ...`` from the request's arrival to its response.

        Inside it (its thread, threads that copy its context, ``run_in_threadpool``) the model work is stamped;
        ``span.enqueued()`` marks a queue; a batcher thread marks a batch with ``monitor.batch(spans)``.
        ``name`` fixes the ``model`` label (default: the first model work's). Definitions: ``perfmon.agent.requests``.
        """
        return self.requests.open(name, arrived_ns)

    def batch(self, spans: Iterable[RequestSpan | None], *, name: str | None = None) -> RequestBatch:
        """``with monitor.batch(spans): out = model(x)`` on a batcher thread: the block is each span's model part.
        ``name`` labels the spans that have none (default: the block's first wrapped call's model); it counts toward
        ``max_models`` as a span's name does, and one perfmon cannot take is an internal error, as in ``request``."""
        return RequestBatch(spans, self.requests.take_name(name))

    def current_request(self) -> RequestSpan | None:
        """The request span of the running context (a middleware's, or an enclosing ``monitor.request()``)."""
        span = current.get()
        return span if isinstance(span, RequestSpan) else None
