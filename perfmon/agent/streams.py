"""Streamed generation requests: an iterable's items, passed through unchanged, timed as one request.

``sync_stream``/``async_stream`` (what ``Monitor.stream`` returns) record a token as each item is
handed to the consumer (``tokens=`` counts an item as several, fail-soft: ``measuring``) and end the
request with its outcome: ``ok`` once the iterable is exhausted, ``error`` when it raises an
Exception, ``cancelled`` when the consumer stops early. The outcome vocabulary lives here, with the
adaptors that decide most outcomes; ``Generation``'s context manager uses the same rule (``outcome_of``).
"""

from __future__ import annotations

import operator
import threading
import weakref
from collections.abc import AsyncGenerator, Callable, Generator, Iterator
from time import perf_counter_ns
from typing import Any, TypeVar

from ..exceptions import ConfigError
from ..faults import InternalErrors

__all__ = ["CANCELLED", "ERROR", "OK", "OUTCOMES", "Consumer", "Request", "async_stream", "is_streamer",
           "measuring", "outcome_of", "stream", "sync_stream", "token_count", "watch_consumer"]

T = TypeVar("T")

OK = "ok"  # the request ran to its end (a stream was exhausted, a block exited normally)
ERROR = "error"  # an Exception passed through (re-raised unchanged)
CANCELLED = "cancelled"  # the consumer stopped early: close(), break + garbage collection, GeneratorExit,
# asyncio.CancelledError or any other BaseException that is not an Exception, or an unfinished
# Generation garbage-collected
OUTCOMES = (OK, ERROR, CANCELLED)

#: What a stream adaptor drives: a ``Generation`` (its ``token`` and ``finish``). ``Any``, not a
#: ``Protocol``: a Protocol class carries typing's own functions, which mark_for_dynamo would then mark.
Request = Any


def stream(start: Callable[[str, int | None], Request], internal: InternalErrors, iterable: Any, *, name: str,
           prompt_tokens: int | None = None, tokens: Callable[[Any], int] | None = None) -> Any:
    """Yield ``iterable``'s items unchanged, timing them as one generation request (``Monitor.stream``), which
    ``start(name, prompt_tokens)`` opens (``GenerationTracker.start``).

    The request starts now; each item is one token, or ``tokens(item)`` tokens (text chunks; 0 records
    nothing; a failing callable is an internal error and counts 1). Exhaustion ends it ``ok``, an
    exception from the iterable ``error`` (re-raised unchanged), ``close()``, a consumer that breaks out,
    or garbage collection before the end ``cancelled``. An async iterable gives an async generator
    (``async for``; task cancellation counts as ``cancelled``). Times are seconds of host time at which
    each item is handed to the consumer. Over a streamer its caller iterates (``TextIteratorStreamer``),
    the stream and a tracked ``generate()`` feeding that streamer are one request, whichever starts
    first (``watch_consumer``): the generate() call counts its tokens, the stream its outcome.
    """
    if tokens is not None and not callable(tokens):
        raise ConfigError(f"tokens={tokens!r}: expected a callable item -> int, or None (one token per item)")
    sync = hasattr(iterable, "__iter__")
    if not sync and not hasattr(iterable, "__aiter__"):
        raise ConfigError(f"cannot stream {type(iterable).__name__!r}: it is neither iterable nor async iterable")
    request: Any = None
    if is_streamer(iterable):
        # The request a tracked generate() over this streamer opened, or a new one it will feed if it
        # starts after this (in its thread): counted once either way.
        request = watch_consumer(iterable, lambda: Consumer(start(name, prompt_tokens)))
    if request is None:
        request = start(name, prompt_tokens)
    measure = measuring(tokens, internal)
    if sync:
        return sync_stream(iter(iterable), request, measure)
    return async_stream(iterable.__aiter__(), request, measure)


def sync_stream(it: Iterator[T], g: Request, measure: Callable[[T], int] | None) -> Generator[T, None, None]:
    """Yield ``it``'s items unchanged, a token of ``g`` each, and end ``g`` with the stream's outcome."""
    try:
        for item in it:
            # Stamped just before the item is handed over: the time the caller gets it.
            g.token(1 if measure is None else measure(item))
            yield item
    except GeneratorExit:  # close(), or a consumer that broke out and dropped the generator
        g.finish(CANCELLED)
        close = getattr(it, "close", None)
        if close is not None:
            close()  # the wrapped generator's own cleanup runs now, not whenever it is collected
        raise
    except BaseException as exc:
        g.finish(outcome_of(exc))
        raise
    g.finish(OK)


async def async_stream(ait: Any, g: Request, measure: Callable[[Any], int] | None) -> AsyncGenerator[Any, None]:
    """``sync_stream`` for an async iterator."""
    try:
        async for item in ait:
            g.token(1 if measure is None else measure(item))
            yield item
    except GeneratorExit:  # aclose(), or the event loop finalizing a dropped generator
        g.finish(CANCELLED)
        aclose = getattr(ait, "aclose", None)
        if aclose is not None:
            await aclose()
        raise
    except BaseException as exc:  # asyncio.CancelledError (client went away) is cancelled, not error
        g.finish(outcome_of(exc))
        raise
    g.finish(OK)


def token_count(n: Any) -> int:
    """``n`` as a token count (an int >= 0, not a bool); raises TypeError/ValueError otherwise."""
    if isinstance(n, bool):
        raise TypeError("bool is not a token count")
    v = operator.index(n)
    if v < 0:
        raise ValueError(f"negative token count {v}")
    return v


def outcome_of(exc: BaseException | None) -> str:
    """The outcome of a request that ended with ``exc`` (None: it ran to its end)."""
    if exc is None:
        return OK
    return ERROR if isinstance(exc, Exception) else CANCELLED


def measuring(tokens: Callable[[Any], int] | None, internal: InternalErrors) -> Callable[[Any], int] | None:
    """The item -> token count function, made fail-soft (an error counts the item as 1 token)."""
    if tokens is None:
        return None

    def measure(item: Any) -> int:
        try:
            n = tokens(item)
            if n.__class__ is int and n >= 0:
                return n
            return token_count(n)
        except Exception as exc:
            internal.report("generation_tokens", exc)
            return 1

    return measure


# -- a streamer's consumer -----------------------------------------------------------------------

class Consumer:
    """One request fed by a producer (a tracked ``generate()`` putting tokens into a streamer) and ended by
    the streamer's consumer: ``ok`` when the consumer reads to the end, ``cancelled`` when it stops early
    (the ``Monitor.stream`` wrapper closed, the streamer garbage-collected unread).

    The request ends once both sides are done: the producer's tokens are settled (``produced``) and the
    consumer's outcome is known (``finish``), at the consumer's time. A producer that fails ends it at once
    (``error``). With no producer (a stream over a streamer nobody tracks), items are counted as tokens, as
    any ``Monitor.stream``. It is also the ``Request`` a stream adaptor drives (``token``/``finish``).
    """

    __slots__ = ("_lock", "consumed", "consumed_ns", "fed", "g", "produced_outcome")

    def __init__(self, g: Any, *, fed: bool = False) -> None:
        self.g = g
        self.fed = fed  # a producer delivers the tokens
        self.produced_outcome: str | None = None
        self.consumed: str | None = None
        self.consumed_ns = 0
        self._lock = threading.Lock()

    def token(self, n: int = 1) -> None:
        if not self.fed:
            self.g.token(n)

    def finish(self, outcome: str = OK) -> None:
        """The consumer side ended with ``outcome`` (first one wins)."""
        now = perf_counter_ns()
        with self._lock:
            if self.consumed is not None:
                return
            self.consumed, self.consumed_ns = outcome, now
            ready = self.produced_outcome is not None or not self.fed
        if ready:
            self.g._tracker.finish_at(self.g, outcome, now)

    def produced(self, outcome: str, now: int) -> None:
        """The producer ended (its tokens settled) with ``outcome``."""
        with self._lock:
            self.produced_outcome = outcome
            consumed, at = self.consumed, self.consumed_ns
        if outcome != OK:
            self.g._tracker.finish_at(self.g, outcome, now)
        elif consumed is not None:
            self.g._tracker.finish_at(self.g, consumed, max(at, now))


def is_streamer(obj: Any) -> bool:
    """A Hugging Face-style streamer (``put``/``end``) that its caller iterates (TextIteratorStreamer and kin)."""
    return (callable(getattr(obj, "put", None)) and callable(getattr(obj, "end", None))
            and (hasattr(obj, "__next__") or hasattr(obj, "__anext__")))


_watched: dict[type, type] = {}
_watched_lock = threading.Lock()


def watch_consumer(streamer: Any, make: Callable[[], Consumer]) -> Consumer | None:
    """The request tied to an iterator streamer: the one already tied (a tracked ``generate()`` and a
    ``Monitor.stream`` over the same streamer meet here, whichever comes first, atomically), else
    ``make()``'s, tied now. None if the streamer cannot be watched.

    Tied, its consumer's end (``StopIteration``) ends the request ``ok``; the streamer collected before that
    ends it ``cancelled``. The streamer's class is swapped, in place, for a subclass made once per class
    whose ``__next__`` (or ``__anext__``) notes the end: the caller keeps iterating the object it made,
    nothing is proxied.
    """
    cls = type(streamer)
    try:
        attrs = vars(streamer)
    except TypeError:
        return None
    with _attach_lock:
        found = attrs.get("_perfmon_consumer")
        if found is not None:
            return found  # type: ignore[no-any-return]
        sub = cls if getattr(cls, "_perfmon_watched", False) else _watched_class(cls)
        if sub is None:
            return None
        try:
            streamer.__class__ = sub
        except TypeError:
            return None
        consumer = attrs["_perfmon_consumer"] = make()
    weakref.finalize(streamer, consumer.finish, CANCELLED)
    return consumer


_attach_lock = threading.Lock()


def _watched_class(cls: type) -> type | None:
    with _watched_lock:
        sub = _watched.get(cls)
        if sub is not None or len(_watched) >= 64:  # bounded: one class per streamer class
            return sub
        ns: dict[str, Any] = {"_perfmon_watched": True, "__module__": cls.__module__, "__qualname__": cls.__qualname__}
        if hasattr(cls, "__next__"):
            base_next = cls.__next__  # type: ignore[attr-defined]

            def __next__(self: Any) -> Any:
                try:
                    return base_next(self)
                except StopIteration:
                    c = self.__dict__.get("_perfmon_consumer")
                    if c is not None:
                        c.finish(OK)
                    raise

            ns["__next__"] = __next__
        if hasattr(cls, "__anext__"):
            base_anext = cls.__anext__  # type: ignore[attr-defined]

            async def __anext__(self: Any) -> Any:
                try:
                    return await base_anext(self)
                except StopAsyncIteration:
                    c = self.__dict__.get("_perfmon_consumer")
                    if c is not None:
                        c.finish(OK)
                    raise

            ns["__anext__"] = __anext__
        sub = _watched[cls] = type(cls.__name__, (cls,), ns)
        return sub
