"""What a capture is: its options (validated where they are born), its metadata record, its vocabulary.

``CaptureOptions`` refuses a bad option with ``perfmon.exceptions.ConfigError`` whoever builds it (the
manual API, HTTP, the regression policy, a baseline capture); ``Capture`` is what ``/profiles/{id}``
shows. The states, triggers and bounds named here are shared by the controller, the exporter and the
metrics collector.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..exceptions import ConfigError

__all__ = [
    "ARMED", "COMPARED_TRIGGERS", "EXPORTING", "IDLE", "MAX_SECONDS", "MAX_STEPS", "RECORDING", "SUPPRESS_REASONS",
    "TOP_OPS", "TRIGGERS", "Capture", "CaptureOptions",
]

IDLE, ARMED, RECORDING, EXPORTING = "idle", "armed", "recording", "exporting"

SUPPRESS_REASONS = ("cooldown", "rate_limit", "busy")
TRIGGERS = ("regression", "manual", "baseline")
#: Captures of these triggers are compared with their model's latest baseline when they finish.
COMPARED_TRIGGERS = ("regression", "manual")
MAX_STEPS = 100
MAX_SECONDS = 60.0
TOP_OPS = 25


@dataclass(frozen=True, kw_only=True)
class CaptureOptions:
    """How long a capture records and what it records; checked here, so every caller gets one message."""

    steps: int = 5
    max_seconds: float = 10.0
    record_shapes: bool = True
    with_stack: bool = False
    profile_memory: bool = False

    def __post_init__(self) -> None:
        steps, max_seconds = self.steps, self.max_seconds
        if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS:
            raise ConfigError(f"steps={steps!r}: expected an integer 1..{MAX_STEPS}")
        if isinstance(max_seconds, bool) or not isinstance(max_seconds, (int, float)) \
                or not 0 < max_seconds <= MAX_SECONDS:
            raise ConfigError(f"max_seconds={max_seconds!r}: expected a number in (0, {MAX_SECONDS:g}]")
        for flag in ("record_shapes", "with_stack", "profile_memory"):
            v = getattr(self, flag)
            if not isinstance(v, bool):
                raise ConfigError(f"{flag}={v!r}: expected true or false")
        object.__setattr__(self, "max_seconds", float(max_seconds))  # an int is a number of seconds too


@dataclass
class Capture:
    """One capture's metadata (what ``/profiles/{id}`` shows). Times are UTC ISO 8601."""

    id: str
    model: str
    trigger: str  # "regression" | "manual" | "baseline"
    reason: dict[str, Any]
    options: CaptureOptions
    device: str
    status: str = ARMED
    outcome: str | None = None  # "ok" | "failed" | "aborted"
    error: str | None = None
    armed_at: str = ""
    started_at: str | None = None
    ended_at: str | None = None
    duration_seconds: float | None = None
    steps_recorded: int = 0
    #: What ended the recording: "steps", "max_seconds", "max_bytes" (memory bound) or "stopped".
    ended_by: str | None = None
    #: Growth of this process's resident memory while the profiler recorded, bytes (None: unknown).
    memory_growth_bytes: int | None = None
    thread: str | None = None
    summary: list[dict[str, Any]] = field(default_factory=list)
    #: Window totals: FLOPs, achieved FLOP/s, the peaks used and where they came from, MFU on GPU.
    compute: dict[str, Any] = field(default_factory=dict)
    #: The export: host events in the trace, seconds from recording end to files in place, the
    #: child's CPU seconds and peak RSS bytes.
    export: dict[str, Any] = field(default_factory=dict)
    #: Per op name, per recorded step (one model call): ``calls_per_step``, ``seconds_per_step`` (self
    #: device seconds on CUDA, self CPU seconds on CPU), ``seconds_per_step_stdev``, ``_median`` and ``_mad`` over
    #: the steps; at most 200 names, the rest as ``[other]`` (``perfmon.captures.trace_summary.step_table``).
    ops: dict[str, dict[str, float]] = field(default_factory=dict)
    #: Per top-level op (one the model's code called, with the ops inside it folded in), the same statistics of
    #: its total seconds, and its ``breakdown``: the self seconds of the ops inside it (``trace_summary``).
    top_ops: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: Each recorded step's work (``Sample.size``: items, or the elements of its first input; None when unknown),
    #: in order: a comparison lines captures up by it (``compare.compare_basis``).
    step_sizes: list[int | None] = field(default_factory=list)
    #: Steps the ``ops`` table averages over (the first recorded step is left out when there are two or more).
    steps: int = 0
    #: ``perfmon.captures.compare.compare(latest baseline, this capture)`` for a regression or manual capture of a
    #: model that had a baseline capture; None otherwise.
    comparison: dict[str, Any] | None = None
    #: On CUDA: the device's occupancy in the recorded steps, busy (kernel intervals' union) over each step's
    #: device span, with its parts per step (``trace_summary.step_occupancy``); None on CPU or without kernels.
    occupancy: dict[str, Any] | None = None

    def public(self) -> dict[str, Any]:
        d = asdict(self)
        d["options"] = asdict(self.options)
        return d
