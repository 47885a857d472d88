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

from collections.abc import Callable, Hashable
from time import perf_counter_ns
from typing import Any

import torch

from .phases import Signature, batch_of, nested_key, signature, work_of
from .requests import current
from .state import ModelState, Token

__all__ = ["due_step", "hot_path", "sampled_path"]

_Tensor = torch.Tensor
#: The hot path's first positional parameter when a call has none.
_NO: Any = object()


def hot_path(st: ModelState, fn: Callable[..., Any], *,
             signature_of: Callable[[tuple[Any, ...], dict[str, Any]], Hashable] = signature) -> Callable[..., Any]:
    """Build the ``__call__`` of one monitored object: the per-call hot path.

    ``fn(self, *args, **kwargs)`` runs the call itself: for a module, its class's own ``__call__``
    (``nn.Module.__call__``: hooks, then ``forward``); for a function, the function. A closure rather
    than a method: the state, the target and the constants are closure cells, read without an
    attribute lookup. On an unsampled call it does: one ``next()``, one comparison and, with signature
    tracking, the signature's dict lookup and one ``next()`` on its counter (which is also how items
    are counted). Everything else is on the rare paths.

    ``signature_of`` computes a call's signature when it is not the one-tensor case (``phases.signature``; the
    decode steps of a model's own ``generate()`` take it from the step before: ``stages.step_signature``).

    Request spans (requests.py): while none is open in the process the call pays one attribute read
    (``hub.requests``); with one open, the context variable's read and, inside a span, ``in_request``'s
    two clock reads and compares (timed and captured calls stamp from their own clock reads).
    """
    tensor = _Tensor
    general_signature = signature_of
    clock = perf_counter_ns
    items_fn = st.items_fn
    counted = st.item_counts  # reset in place after fork(): a closure cell
    hub = st.hub
    name = st.name
    span_of = current.get
    sampled = sampled_path(st, fn)
    # The warm signatures (SignatureTable.warm): one dict for the state's life, so a closure cell. Its table never fills
    # it for a model with an ``items`` callable, which counts its items a call (``general``).
    warm = st.warm

    def in_request(span: Any, self: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """An unsampled call in a request span's context: the call, with the span's model stamps around it.

        Only the first start and the last end matter to a span, so a call stamps its start only when the span
        has none, and its end when it is later than the span's. A monitored model called inside this one
        stamps inside this call's interval, which holds it: nothing to clear or restore.
        """
        t0 = clock()
        if span.model_start_ns is None:
            span.model_start_ns = t0
            span.model = name
        try:
            return fn(self, *args, **kwargs)
        except BaseException as exc:
            st.error(exc)
            raise
        finally:
            t1 = clock()
            last = span.model_end_ns
            if last is None or t1 > last:
                span.model_end_ns = t1

    def due_one(self: Any, x: Any, n: int, entry: Signature) -> Any:
        """A call of one tensor of a warm signature that reached ``st.next_index``: a sample, a capture pending or the
        floor's call (the fast path below counted it). A frame apart: 1 call in 1/sample_rate pays it."""
        try:
            token = st.due(n)  # (its dtype is checked after the call: ModelState.finish)
        except Exception as exc:
            hub.internal.report("instrument", exc)
            token = None
        if token is None:
            try:
                return fn(self, x)
            except BaseException as exc:
                st.error(exc)
                raise
        return sampled(self, (x,), {}, n, token, entry, None, None)

    def general(self: Any, x: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Every call the fast path below does not take: keywords, several or no positional arguments, a new or
        warming shape, churned signatures, an ``items`` callable, a request span open. Not yet counted."""
        # A request span is open somewhere in the process (Hub.requests): is this call in one?
        span = span_of() if hub.requests else None
        items = entry = None
        try:
            # st.calls, not a captured counter: after fork() the child gets fresh counters (reset_after_fork).
            n = next(st.calls)
            sigs = st.sigs
            token: Token | Any | None
            if sigs is not None:
                if type(x) is tensor and not args and not kwargs:
                    # The shape alone (a torch.Size hashes ~3x faster than a (shape, dtype) tuple, and
                    # reading dtype costs ~50 ns more): the dtype is checked on timed calls (ModelState.finish).
                    try:
                        key: Hashable = x.shape
                    except RuntimeError:  # a strided nested tensor has none
                        key = nested_key(x)
                    entry = sigs.get(key)
                    if entry is None or entry.warm_left:
                        token = st.new_signature(n, key, (x,), kwargs)
                    else:
                        next(entry.calls)
                        token = st.due(n) if n >= st.next_index else None
                else:
                    full = args if x is _NO else (x, *args)
                    key = general_signature(full, kwargs)
                    entry = sigs.get(key)
                    if entry is None or entry.warm_left:
                        token = st.new_signature(n, key, full, kwargs)
                    else:
                        next(entry.calls)
                        token = st.due(n) if n >= st.next_index else None
            else:
                q = counted.q
                if q is not None and items_fn is None:  # signatures churned: count items directly
                    q.append(batch_of(args if x is _NO else (x, *args), kwargs))
                token = st.due(n) if n >= st.next_index else None
            if items_fn is not None:
                items = counted.count(args if x is _NO else (x, *args), kwargs)
        except Exception as exc:
            hub.internal.report("instrument", exc)
            token = None
        if token is None and span is None:
            try:
                # A plain call, not ``fn(self, x, *args, **kwargs)``: Python 3.11+ runs a call of a Python function
                # with positional arguments in the same interpreter loop, and a ``*``/``**`` call through the C
                # API, ~150-230 ns more on Linear(64, 64) (docs/design.md, "The hot path").
                if args or kwargs:
                    return fn(self, *args, **kwargs) if x is _NO else fn(self, x, *args, **kwargs)
                return fn(self) if x is _NO else fn(self, x)
            except BaseException as exc:
                st.error(exc)
                raise
        if x is not _NO:
            args = (x, *args)
        if token is None:
            return in_request(span, self, args, kwargs)
        return sampled(self, args, kwargs, n, token, entry, items, span)

    def __call__(self: Any, x: Any = _NO, /, *args: Any, **kwargs: Any) -> Any:
        # ``x`` is the first positional argument, apart from the rest: most calls are one tensor, read then without
        # packing or indexing a tuple (~60 ns a call). ``_NO`` when the call has none (keywords only).
        if not kwargs and not args and type(x) is tensor and not hub.requests:
            # The common call, in as few lines as it takes (~45 bytecodes against ~90 through ``general``): one tensor
            # of a warm signature, no request span open, no ``items`` callable. Nothing here can raise but the call
            # itself and a strided nested tensor's ``shape`` (it has none: ``general`` keys it). Anything else (a new or
            # warming shape, churned signatures, an ``items`` callable) goes to ``general``, not yet counted; a call
            # due for a sample is counted here (``due_one``).
            # The shape alone (a torch.Size hashes ~3x faster than a (shape, dtype) tuple, and reading dtype costs
            # ~50 ns more): the dtype is checked on timed calls, after the call (``ModelState.finish``). Making and
            # looking up the torch.Size is most of this path's cost (~260 of ~430 ns over a do-nothing wrapper), and
            # what tells a new shape's cold call apart (docs/design.md, "Warm signatures apart").
            try:
                entry = warm.get(x.shape)
            except RuntimeError:  # a strided nested tensor has no shape (the try is free until it raises)
                entry = None
            if entry is not None:
                # st.calls, not a captured counter: after fork() the child gets fresh ones (reset_after_fork).
                n = next(st.calls)
                next(entry.calls)
                if n < st.next_index:
                    try:
                        return fn(self, x)
                    except BaseException as exc:
                        st.error(exc)
                        raise
                return due_one(self, x, n, entry)
        return general(self, x, args, kwargs)

    return __call__


def _work(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    try:
        return work_of(args, kwargs)
    except Exception:
        return None


def sampled_path(st: ModelState, fn: Callable[..., Any]) -> Callable[..., Any]:
    """Build the rest of a call the hot path decided to time or to hand to a pending capture.

    ``sampled(self, args, kwargs, n, token, entry, items, span)`` runs call ``n`` with ``token`` (``st.due(n)``: a
    ``Token``, or the capture controller), ``entry`` its ``Signature`` or None, ``items`` what the user's ``items``
    callable gave or None, ``span`` the request span it runs in or None. A frame apart from ``hot_path``'s ``__call__``:
    the 1 call in 1/sample_rate pays it; the decode steps of a model's own ``generate()`` come here too (stages.py).
    """
    clock = perf_counter_ns
    items_fn = st.items_fn
    hub = st.hub
    name = st.name

    def stamp(span: Any, t0: int, t1: int) -> None:
        """A timed or captured call in a request span: the span's model stamps, from the call's own clock reads."""
        try:
            span.model_call(t0, t1, name)
        except Exception as exc:
            hub.internal.report("requests", exc)

    def sampled(self: Any, args: tuple[Any, ...], kwargs: dict[str, Any], n: int, token: Any, entry: Signature | None,
                items: int | None, span: Any) -> Any:
        if token.__class__ is not tuple:  # a capture is pending: the controller runs the call
            t0 = clock()
            try:
                # The call's work goes with it: a comparison lines captures up by size (compare_basis).
                work = items if items_fn is not None else entry.work if entry is not None else _work(args, kwargs)
                return token.call(st, fn, (self, *args), kwargs, work)
            except BaseException as exc:
                st.error(exc)
                raise
            finally:
                if span is not None:
                    stamp(span, t0, clock())
        # Nothing between the decision and the start stamp but the stamp: under GIL contention, work done there slows
        # the timed call itself (BENCHMARKS §3b, "Before the start stamp"). What describes the call (items, size
        # class, a dtype not seen with its shape) is read after the end stamp (ModelState.finish). A call of one
        # positional argument is made as the unsampled path makes it (``fn(self, x)``: a ``*args`` call costs
        # ~150-230 ns more, which the timed window would hold).
        one = args[0] if len(args) == 1 and not kwargs else _NO
        t0 = clock()
        try:
            out = fn(self, *args, **kwargs) if one is _NO else fn(self, one)
        except BaseException as exc:
            st.abort(token)
            st.error(exc)
            if span is not None:
                stamp(span, t0, clock())
            raise
        t1 = clock()
        st.finish(token, n, t0, t1, items, entry, args, kwargs)
        if span is not None:
            stamp(span, t0, t1)
        return out

    return sampled


def due_step(st: ModelState, fn: Callable[..., Any], sampled: Callable[..., Any], n: int, entry: Signature, self: Any,
             args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A call on a short path that reached the sampling index (a decode step of ``stages.staged_path``'s, a no-cache
    step of ``reruns.Reruns``'): time it (or hand it to a pending capture) through ``sampled``, its stage's
    ``sampled_path``, as the hot path would."""
    try:
        token = st.due(n)
    except Exception as exc:
        st.hub.internal.report("instrument", exc)
        token = None
    if token is not None:
        return sampled(self, args, kwargs, n, token, entry, None, None)
    try:
        return fn(self, *args, **kwargs)
    except BaseException as exc:
        st.error(exc)
        raise
