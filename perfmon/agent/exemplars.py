"""The active OpenTelemetry span of a timed call, for exemplars: the only ``opentelemetry`` importer.

opentelemetry-api is optional (``pip install perfmon[otel]``): without it, or without a sampled
span around the call, a timed call carries no trace and nothing changes. The span is looked up for
timed (sampled) calls only, after the call's end was stamped, so it is never in the measured time
and never on an unsampled call; what it gives is two ints (the hex strings are made by the
resolver thread).

By default the lookup is split (``otel_deferred``): the request thread takes opentelemetry's current
context (``opentelemetry.context.get_current()``: its own mapping, spans and baggage, nothing of the
application's) and the resolver thread reads the span from it. The whole lookup is five Python frames,
~0.2 µs warm but ~8 µs on a server's request thread, where a timed call's code runs once in a hundred
calls with the caches cold (docs/design.md, "Exemplars"). A user's ``TraceReader`` runs on the request
thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = ["OTEL", "Deferred", "TraceReader", "otel_deferred", "otel_reader"]

#: Returns (trace_id, span_id) of the calling context's span when one is valid and sampled, else None.
TraceReader = Callable[[], "tuple[int, int] | None"]
#: ``Monitor(trace_reader=...)``'s default: OpenTelemetry's current span when opentelemetry-api is installed.
OTEL: object = object()


class Deferred(NamedTuple):
    """A trace reader in two halves: ``take()`` on the request thread (what the second half needs, cheaply),
    ``read(taken)`` on the resolver thread: (trace_id, span_id) or None, as a ``TraceReader`` returns."""

    take: Callable[[], Any]
    read: Callable[[Any], tuple[int, int] | None]


def otel_deferred() -> Deferred | None:
    """OpenTelemetry's span lookup split at its context: ``take`` is ``opentelemetry.context.get_current`` (two
    frames, under any runtime context), ``read`` finds the span in what it gave. None without opentelemetry-api."""
    try:
        from opentelemetry.context import get_current
        from opentelemetry.trace import INVALID_SPAN, get_current_span
    except ImportError:
        return None

    def read(taken: Any) -> tuple[int, int] | None:
        return _sampled_ids(get_current_span(taken), INVALID_SPAN)

    return Deferred(get_current, read)


def otel_reader() -> TraceReader | None:
    """The whole lookup of the current OpenTelemetry span, on the calling thread; None without opentelemetry-api."""
    try:
        from opentelemetry.trace import INVALID_SPAN, get_current_span
    except ImportError:
        return None

    def read() -> tuple[int, int] | None:
        return _sampled_ids(get_current_span(), INVALID_SPAN)

    return read


def _sampled_ids(span: Any, invalid: Any) -> tuple[int, int] | None:
    """(trace_id, span_id) of ``span`` when it is valid and sampled, else None (``invalid``: OTel's INVALID_SPAN)."""
    if span is invalid:  # no span around the call (the common case: ~180 against ~350 ns a timed call)
        return None
    ctx = span.get_span_context()
    # A span that is not sampled has no trace to link to in the tracing backend: no exemplar. Ids
    # are checked as W3C trace context defines them (a non-SDK tracer may hand anything): a 128-bit
    # trace id and a 64-bit span id, neither zero; anything else would make labels no parser accepts.
    trace_id, span_id = ctx.trace_id, ctx.span_id
    if (type(trace_id) is int and type(span_id) is int and 0 < trace_id < 1 << 128 and 0 < span_id < 1 << 64
            and ctx.trace_flags.sampled):
        return (trace_id, span_id)
    return None
