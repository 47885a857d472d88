"""``Span``: ``with monitor.track(name):`` counts and sample-times a block of code like a call.

``Untracked`` is what ``track`` gives for a name perfmon cannot take (invalid, or past ``max_models``):
the block runs as if perfmon were not there; the refusal is counted, not raised into the request.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine
from time import perf_counter_ns
from typing import Any

from .requests import current
from .state import ModelState, Token

__all__ = ["Span", "Untracked", "monitored_coroutine"]


class Span:
    """``with monitor.track(name):`` — count and sample-time a block of code like a call."""

    __slots__ = ("_index", "_request", "_st", "_start_ns", "_token")

    def __init__(self, state: ModelState) -> None:
        self._st = state
        self._token: Token | None = None
        self._request: Any = None

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
        # A request span in this context (requests.py): the block is model work of that request.
        self._request = current.get() if st.hub.requests else None
        self._start_ns = perf_counter_ns()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        end_ns = perf_counter_ns()
        st = self._st
        request = self._request
        if request is not None:
            self._request = None
            try:
                request.model_call(self._start_ns, end_ns, st.name)
            except Exception as inner:
                st.hub.internal.report("requests", inner)
        if exc is not None:
            st.abort(self._token)
            st.error(exc)
        elif self._token is not None:
            st.finish(self._token, self._index, self._start_ns, end_ns)


class Untracked:
    """A block perfmon does not count (its name was refused): runs it, lets its exceptions through."""

    __slots__ = ()

    def __enter__(self) -> Untracked:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        return None


UNTRACKED = Untracked()


def monitored_coroutine(fn: Callable[..., Coroutine[Any, Any, Any]], state: ModelState) -> Callable[..., Any]:
    """``Monitor.instrument`` of an ``async def``: a call is its awaiting, from the call to the coroutine's end (a
    plain wrapper would time the coroutine's creation, microseconds, and never see its exceptions). Counted,
    sample-timed and its exceptions counted by class like a call (a ``Span`` around the await); items only from an
    ``items`` callable (counted at the call), as no signature is kept. Calls are not captured: a capture profiles
    a stretch of steps on one thread, and an awaiting interleaves with the event loop's other tasks."""
    count_items = state.item_counts.count if state.items_fn is not None else None

    @functools.wraps(fn)
    async def call(*args: Any, **kwargs: Any) -> Any:
        if count_items is not None:
            count_items(args, kwargs)  # never raises
        with Span(state):
            return await fn(*args, **kwargs)

    call.perfmon_state = state  # type: ignore[attr-defined]  # what marks it monitored (instrument refuses it again)
    return call
