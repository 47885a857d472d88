"""The active OpenTelemetry span of a timed call, for exemplars: the only ``opentelemetry`` importer.

opentelemetry-api is optional (``pip install perfmon[otel]``): without it, or without a sampled
span around the call, a timed call carries no trace and nothing changes. The reader runs on the
timed (sampled) path only, after the call's end was stamped, so it is never in the measured time
and never on an unsampled call; what it returns is two ints (the hex strings are made by the
resolver thread).
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["OTEL", "TraceReader", "otel_reader"]

#: Returns (trace_id, span_id) of the calling context's span when one is valid and sampled, else None.
TraceReader = Callable[[], "tuple[int, int] | None"]
#: ``Monitor(trace_reader=...)``'s default: OpenTelemetry's current span when opentelemetry-api is installed.
OTEL: object = object()


def otel_reader() -> TraceReader | None:
    """A reader of the current OpenTelemetry span, or None when opentelemetry-api is not installed."""
    try:
        from opentelemetry.trace import INVALID_SPAN, get_current_span
    except ImportError:
        return None

    def read() -> tuple[int, int] | None:
        span = get_current_span()
        if span is INVALID_SPAN:  # no span around the call (the common case: ~180 against ~350 ns a timed call)
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

    return read
