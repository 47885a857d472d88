"""What the CLI prints of a capture's metadata, every field checked first: an agent's answer is not trusted.

A number that is text, null, NaN or a 400-digit integer, a list that is an object: ``ControlError`` naming the field,
before anything is printed or written (``perfmon profile``, ``profiles``, ``diff``). Text is cleaned and cut for the
terminal (``client.clean``).
"""

from __future__ import annotations

import math
from typing import Any

from .client import ControlError
from .client import clean as _clean
from .config import Config

__all__ = [
    "check_ops",
    "left_behind",
    "listing",
    "listing_or_none",
    "malformed",
    "number",
    "optional_number",
    "or_default",
    "report",
    "short_comparison",
    "step_counts",
]


def or_default(value: Any, default: str) -> Any:
    """``default`` for a missing or empty value (as ``value or default`` would), the value otherwise."""
    return value if value not in (None, "") else default


def malformed(what: str, field: str, value: Any) -> ControlError:
    return ControlError(f"{what}: {field} is malformed ({_clean(value, 60)}); the agent's answer is broken")


def number(value: Any, what: str, field: str, *, low: float = -math.inf, high: float = math.inf) -> float:
    """``value`` as a finite float within [low, high], or ``ControlError`` naming the field: JSON allows NaN,
    Infinity, strings, null, and 400-digit integers (whose float() overflows)."""
    try:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError
        number = float(value)
    except (ValueError, OverflowError):
        raise malformed(what, field, value) from None
    if not (math.isfinite(number) and low <= number <= high):
        raise malformed(what, field, value)
    return number


def optional_number(value: Any, what: str, field: str, *, low: float = -math.inf,
                     high: float = math.inf) -> float | None:
    """``number``, or None for a missing (null) value."""
    return None if value is None else number(value, what, field, low=low, high=high)


def report(meta: dict[str, Any], what: str) -> list[str]:
    """The lines `perfmon profile` prints after the trace: top ops, comparison, compute. ``ControlError`` naming
    the field when one has the wrong type (a number that is text, null or a list; a list that is an object)."""
    lines = _op_lines(meta.get("summary"), what)
    if lines:  # the table's calls and times span every recorded step; the per-step figures leave the first out
        recorded, used = meta.get("steps_recorded"), meta.get("steps")
        lines.insert(0, f"\ntop ops: totals over the {_clean(recorded, 12)} steps recorded" + (
            f"; per-step figures (diff, vs baseline) use {used}: the first step, the profiler's warm-up, is left out"
            if type(recorded) is int and type(used) is int and 0 < used < recorded else ""))
    comparison = meta.get("comparison")
    if isinstance(comparison, dict):
        lines.append(f"\nvs baseline {_clean(comparison.get('baseline'), 40)}: "
                     f"{_clean(comparison.get('summary'), 500)}")
    compute = meta.get("compute")
    if compute is not None and not isinstance(compute, dict):
        raise malformed(what, "compute", compute)
    achieved = optional_number((compute or {}).get("achieved_flops_per_second"), what,
                                "compute.achieved_flops_per_second")
    if achieved:
        assert compute is not None
        mfu = optional_number(compute.get("mfu_ratio"), what, "compute.mfu_ratio")
        lines.append(f"\nwindow: {achieved / 1e9:.2f} GFLOP/s achieved{'' if mfu is None else f', MFU {mfu:.1%}'} "
                     f"(peak: {_clean(compute.get('peak_source'), 60)})")
    return lines


def _op_lines(ops: Any, what: str) -> list[str]:
    """The top-ops table (the first 15 of the capture's summary)."""
    if ops is None or ops == []:
        return []
    if not isinstance(ops, list):
        raise malformed(what, "summary", ops)
    ops = ops[:15]
    for i, op in enumerate(ops):
        if not isinstance(op, dict):
            raise malformed(what, f"summary[{i}]", op)
    device = any(op.get("self_device_time_total_seconds") for op in ops)
    key = "self_device_time_total_seconds" if device else "self_cpu_time_total_seconds"
    shapes = [_shapes(op.get("input_shapes"), what, f"summary[{i}].input_shapes") for i, op in enumerate(ops)]
    # A row per (op, input shapes) (captures.trace_summary): without the shapes aten::mm shows up three times over.
    shown = any(shapes)
    lines = [f"{'op':<34} {'calls':>6} {'self ' + ('device' if device else 'CPU') + ' ms':>13} {'total CPU ms':>12} "
             f"{'GFLOP':>8} {'GFLOP/s':>8}  {'bound':<12}" + ("  input shapes" if shown else "")]
    for i, op in enumerate(ops):
        at = f"summary[{i}]"
        calls, self_s = number(op.get("calls"), what, f"{at}.calls"), number(op.get(key), what, f"{at}.{key}")
        cpu_s = number(op.get("cpu_time_total_seconds"), what, f"{at}.cpu_time_total_seconds")
        flops = optional_number(op.get("flops"), what, f"{at}.flops")
        rate = optional_number(op.get("achieved_flops_per_second"), what, f"{at}.achieved_flops_per_second")
        lines.append(f"{_clean(op.get('name'), 34):<34} {calls:>6g} {self_s * 1e3:>13.3f} {cpu_s * 1e3:>12.3f} "
                     f"{(flops or 0) / 1e9:>8.3f} {'-' if rate is None else f'{rate / 1e9:.1f}':>8}  "
                     f"{_clean(op.get('bound') or '-', 20):<12}" + (f"  {shapes[i] or '-'}" if shown else ""))
    return [line.rstrip() for line in lines]


def _shapes(value: Any, what: str, field: str) -> str:
    """A row's input shapes (``["[8, 256]", "[256, 256]"]``) as one cell, "" without them."""
    if value is None or value == []:
        return ""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise malformed(what, field, value)
    return _clean(", ".join(value), 60)


def step_counts(meta: dict[str, Any]) -> str:
    """``used/recorded``: the steps a capture's per-step op table averages over (what diff and the comparison read;
    the first, the profiler's warm-up, is left out of two or more) of the steps it recorded; "-" used until done."""
    used = or_default(meta.get("steps"), "-") if meta.get("outcome") else "-"
    return f"{_clean(used, 12)}/{_clean(or_default(meta.get('steps_recorded'), '0'), 12)}"


def listing_or_none(profiles: list[dict[str, Any]], *, fleet: bool) -> list[str]:
    """The lines the CLI prints for these captures (``listing``), or "no captures"."""
    return listing(profiles, fleet=fleet) if profiles else ["no captures"]


def listing(profiles: list[dict[str, Any]], *, fleet: bool) -> list[str]:
    """The lines of `perfmon profiles`: one agent's captures, or (``fleet``) the store's, with their host."""
    middle = f"{'host':<20} {'trigger':<11}" if fleet else f"{'trigger':<11} {'status':<10}"
    lines = [f"{'id':<24} {'model':<16} {middle} {'outcome':<8} {'used/recorded':>13}  "
             f"{'ended at' if fleet else 'armed at':<29}  vs baseline"]
    for p in profiles:  # every field cleaned (and cut) for the terminal: the agent is not trusted to be honest
        head = f"{_clean(p.get('id', ''), 64):<24} {_clean(or_default(p.get('model'), ''), 16):<16} "
        trigger, outcome = _clean(or_default(p.get("trigger"), ""), 32), _clean(or_default(p.get("outcome"), "-"), 32)
        if fleet:
            key = str(p.get("key", "")).split("/")  # {model}/{host}/{worker}/{time}-{id}
            head += f"{_clean(key[1] if len(key) > 1 else '', 20):<20} {trigger:<11} "
        else:
            head += f"{trigger:<11} {_clean(p.get('status', ''), 32):<10} "
        lines.append(f"{head}{outcome:<8} {step_counts(p):>13}  "
                     f"{_clean(or_default(p.get('ended_at' if fleet else 'armed_at'), ''), 64):<29}  "
                     f"{short_comparison(p)}")
    return lines


def left_behind(meta: dict[str, Any], capture_id: str, url: str, *, armed_seconds_ago: float) -> str:
    """What a capture the CLI stopped waiting for (``--timeout``, Ctrl-C) and could not cancel (an agent without
    DELETE /profiles/{id}, one recording already) goes on doing on the agent, and when it stops refusing other
    captures; ``armed_seconds_ago``: seconds since the agent answered the POST that armed it."""
    fetch = f"`perfmon profiles --url {url} --download {capture_id}` fetches it once it is done"
    status = meta.get("status")
    if status not in (None, "armed"):  # recording or exporting: it ends on its own, by steps or max_seconds
        return f"it is {_clean(status, 40)} on the agent and ends on its own; {fetch}"
    # The agent's setting is not in its answers: the default is the best the CLI knows.
    left = Config.capture_arm_timeout_seconds - armed_seconds_ago
    when = f"in about {left:.0f} s" if left >= 1 else "by now"
    return ("it stays armed on the agent (it could not be cancelled), and every other capture there is refused "
            "(409 \"a capture is armed\"), until a call of the model starts it or capture_arm_timeout_seconds expire "
            f"it ({when}, with the default {Config.capture_arm_timeout_seconds:g} s); {fetch}")


def short_comparison(meta: dict[str, Any], width: int = 60) -> str:
    """The comparison sentence of a listed capture, cut to ``width`` characters; "-" without one."""
    comparison = meta.get("comparison")
    if not isinstance(comparison, dict):
        return "-"
    text = _clean(comparison.get("error") or comparison.get("summary") or "-", width * 4)
    return text if len(text) <= width else text[: width - 1] + "…"


#: The per-step op table's numeric fields ``captures.compare`` reads (``captures.trace_summary.step_table``).
_OP_FIELDS = ("seconds_per_step", "seconds_per_step_stdev", "seconds_per_step_median", "seconds_per_step_mad",
              "calls_per_step", "share_of_steps")
#: The largest per-step figure (seconds, calls) taken from an agent, and the largest step count: far past any real
#: capture (a model call of 30 years), far below where the comparison's arithmetic overflows (it squares a standard
#: deviation: 1e308 raised OverflowError) or a float() of a 400-digit JSON integer does.
_PER_STEP_MAX = 1e9


def check_ops(meta: dict[str, Any], capture_id: str) -> None:
    """``ControlError`` unless every entry of the capture's op table is an object whose numeric fields are
    numbers in [0, _PER_STEP_MAX] (or absent), its step count too, and its device text: ``compare`` would
    otherwise fail with a ``ValueError`` from ``float("abc")``, an ``OverflowError``, or print nonsense from
    NaN. Only a broken or hostile agent sends such a table."""
    what = f"capture {capture_id}"
    if not isinstance(meta.get("device"), (str, type(None))):
        raise malformed(what, "device", meta.get("device"))
    if meta.get("steps") is not None and not isinstance(meta.get("steps"), int):
        raise malformed(what, "steps", meta.get("steps"))
    optional_number(meta.get("steps"), what, "steps", low=0, high=_PER_STEP_MAX)
    ops = meta.get("ops")
    if not isinstance(ops, dict):
        return  # no table: compare says the captures are not comparable
    _check_table(ops, what, "op table")
    top = meta.get("top_ops")
    if isinstance(top, dict):  # compare reads it (and each entry's breakdown) when it is a non-empty object
        _check_table(top, what, "top-level op table")
        for name, entry in top.items():
            inner = entry.get("breakdown")
            if inner is not None:
                if not isinstance(inner, dict):
                    raise ControlError(f"{what}: op {_clean(name, 60)!r}'s breakdown is not an object")
                _check_table(inner, what, f"breakdown of {_clean(name, 60)!r}")


def _check_table(table: dict[str, Any], what: str, which: str) -> None:
    for name, entry in table.items():
        if not isinstance(entry, dict):
            raise ControlError(f"{what}: op {_clean(name, 60)!r} is not an object in its {which}")
        for field in _OP_FIELDS:
            optional_number(entry.get(field), what, f"op {_clean(name, 60)!r} ({which}): {field}", low=0,
                            high=_PER_STEP_MAX)
