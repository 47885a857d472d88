"""Immutable records passed between stages. Units are in the field names.

``Pending`` is what the request thread enqueues: raw nanosecond stamps and, on CUDA, the event
pair still in flight. ``Sample`` is what the resolver makes of it once the device time is known.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from .clocks import EventPair

__all__ = ["COLD", "DROP_REASONS", "STEADY", "Pending", "Sample", "series_key", "split_key"]

COLD = "cold"
STEADY = "steady"

#: Why a timed sample never reached the histograms (the ``reason`` label; every reason is exported).
DROP_REASONS = (
    "queue_full",  # the resolver fell behind; the request thread never blocks on the queue
    "pool_exhausted",  # every CUDA event pair of the device is still in flight
    "graph_capture",  # the stream is being captured into a CUDA graph: timing events are illegal there
    "timing_failed",  # elapsed_time() refused a completed pair (driver error)
    "shutdown",  # the monitor stopped before the device finished the work
)


class Pending(NamedTuple):
    """A timed call as the request thread saw it; built on the hot path, so a plain tuple."""

    probe: Any  # the Probe that made it (gives model name, device label, first-call bookkeeping)
    seq: int  # the call's index for its model, from 0
    cold: bool
    start_ns: int  # perf_counter_ns() just before the call
    end_ns: int  # perf_counter_ns() just after the call returned
    events: EventPair | None  # CUDA start/end events recorded around the call, else None
    device: str  # the device label at the time of the call ("cpu", "cuda:0")
    items: int | None = None  # items (batch size by default) the call carried, when known
    size: int | None = None  # the call's work for like-for-like detection (see Sample.size)
    # (trace_id, span_id) of the caller's sampled OpenTelemetry span, or what the deferred reader took for the resolver
    # to read it from (Hub.trace_read; exemplars.otel_deferred), or None
    trace: Any = None
    sig: Any = None  # the call's phases.Signature (its FLOPs and bytes, once counted), None when not tracked


class Sample(NamedTuple):
    """A resolved timed call."""

    model: str
    device: str
    phase: str  # COLD or STEADY
    seq: int
    duration_seconds: float  # device time on CUDA (events), wall time otherwise
    host_seconds: float  # time the calling thread spent inside the call
    end_ns: int  # perf_counter_ns() when the call returned (a monotonic clock)
    items: int | None = None  # items (batch size by default) the call carried, when known
    stage: str = ""  # "prefill" / "decode" (or a stage= callable's label) for a staged model; "" otherwise
    #: The call's work, to compare latency like with like (regression.size_class): the ``items``
    #: callable's effective items where one is given, else the element count of the first tensor
    #: argument (``input_ids`` when passed: batch x tokens for a prefill, batch for a decode step).
    size: int | None = None
    #: (trace_id, span_id) of the OpenTelemetry span the call ran in (sampled spans only; exemplars.py).
    trace: tuple[int, int] | None = None
    #: Seconds of garbage-collection pauses inside the call's host interval, and the highest generation among
    #: them (-1: none); set by the resolver from telemetry/gcpauses.py before the sinks see the sample.
    gc_seconds: float = 0.0
    gc_generation: int = -1
    #: The call's input signature (phases.Signature: its counted FLOPs and bytes), None when signatures are off.
    sig: Any = None


def series_key(model: str, stage: str) -> str:
    """One string for (model, stage): the model itself when it has one stage."""
    return f"{model}\x00{stage}" if stage else model


def split_key(key: str) -> tuple[str, str]:
    """(model, stage) back from ``series_key`` (model names cannot hold NUL: they are printable)."""
    model, _, stage = key.partition("\x00")
    return model, stage
