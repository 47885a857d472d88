"""Streamed generation requests: an iterable's items, passed through unchanged, timed as one request.

``sync_stream``/``async_stream`` (what ``Monitor.stream`` returns) record a token as each item is
handed to the consumer (``tokens=`` counts an item as several, fail-soft: ``measuring``) and end the
request with its outcome: ``ok`` once the iterable is exhausted, ``error`` when it raises an
Exception, ``cancelled`` when the consumer stops early. The outcome vocabulary lives here, with the
adaptors that decide most outcomes; ``Generation``'s context manager uses the same rule (``outcome_of``).
"""

from __future__ import annotations

import operator
from collections.abc import AsyncGenerator, Callable, Generator, Iterator
from typing import Any, TypeVar

from ..faults import InternalErrors

__all__ = ["CANCELLED", "ERROR", "OK", "OUTCOMES", "Request", "async_stream", "measuring", "outcome_of", "sync_stream",
           "token_count"]

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
