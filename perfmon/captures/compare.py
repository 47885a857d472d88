"""Which ops changed between two captures of a model: a noise-aware diff of their per-step op tables.

Each capture stores ``ops`` (see ``perfmon.captures.trace_summary.step_table``): per op name, its mean calls
and self seconds per recorded step (one step = one call of the model; self *device* time on a CUDA
capture, self CPU time on CPU) and the standard deviation of those seconds over the steps. ``compare``
lines the two tables up by op name and says, per op, how many seconds a model call gained or lost.

The noise rule. Steps of one capture differ from each other (scheduling, caches, clocks), so two
captures of an unchanged model never agree exactly. A change ``Δ = after - before`` (seconds per call)
counts only when it is larger than the *noise bound*::

    noise = max(SIGMAS · sqrt(sd_b² / n_b + sd_a² / n_a),   # 3 standard errors of the difference of the means
                REL_FLOOR · before,                         # 25 % of the op's own time before
                SHARE_FLOOR · call_before,                  # 2 % of the whole call's op time before
                ABS_FLOOR)                                  # 2 µs a call

``sd`` are the per-step standard deviations (seconds), ``n`` the steps each capture used and
``call_before`` the sum of every op's self seconds per call in the baseline (each op's as below: a
median or a mean). The first term is the
spread the captures themselves measured (a Welch-style test at about 3 sigma). It is not enough on its
own: the steps of one capture are consecutive calls a few milliseconds apart, while the two captures
are minutes or hours apart, and what drifts in between (another tenant, clocks, a warmer cache, the
profiler's own first session) moves every op at once. Measured on a shared 2-core CPU, six captures
of an unchanged 768-wide MLP (30 steps each): its matmul moved -6 % to +26 % against the baseline
while its per-step spread allowed ±3 %; in captures of a 2 ms call, its 5-50 µs ops moved by up to
3x (+34 µs, 1.7 % of the call) while their per-step spread allowed ±2 µs. Hence the floors: a change
under a quarter of the op's own time (``REL_FLOOR``), or under 2 % of the whole call (``SHARE_FLOOR``:
too small to explain a regression of the call), or under 2 µs (``ABS_FLOOR``: dispatch jitter) is
not reported. All four are keyword arguments of ``compare``. Statuses:

* ``slower`` / ``faster``: in both tables, ``|Δ| > noise``;
* ``new``: absent before (or called 0 times a step), and its time after is above the noise bound
  (computed with ``before = 0``); ``gone``: the reverse. An op called in every step used on the side
  where it exists (``share_of_steps`` 1) is there systematically, not by chance: its spread says how much
  time it adds, not whether it exists, so only the floors apply to it (2 % of the call, 2 µs); not when
  the other side's table summed names into ``[other]`` (the op may hide there). Found on a loaded CPU: a
  3 ms op added to every call, one of four steps preempted, had a spread that hid it as ``same``. An op
  called in some steps only (a burst in one step: allocator, lazy init) still has to clear its spread;
* ``same``: everything else, tiny ops that appear or disappear included.

An op's seconds per call on a side is its *median* over the steps when it was called in every step
there (``share_of_steps`` 1, the table recording ``seconds_per_step_median``), else its mean. On a loaded
host the scheduler preempts the serving thread for 5-30 ms inside whichever op is running; averaged over
five steps, one such preemption added milliseconds to one op. Found under load: a planted 0.6 ms cdist
ranked below the 35 µs ``min`` that took the preemption (``min`` named as the regression), and a
baseline whose linear read 19.7 ms instead of 0.5 ms raised the 2 %-of-the-call floor over the cdist
(``same``). The median of an op in every step ignores up to half of them; an op called in some steps
only keeps its mean (its median may be 0). The spread that goes with a median is the median absolute
deviation (``seconds_per_step_mad``, times ``MAD_TO_SD``): until session 41 it was the standard deviation, and
one preempted step of eight (a loaded CPU) put an encoder layer's noise bound at 3.0 ms, above its whole 1.6 ms
before: a model doing twice the work a call (each op called twice as often, 1.6 -> 2.6 ms) read "no op changed"
(a helper's run, and both of its ``perfmon demo --slow-after`` runs). Captures stored before have no MAD and keep
the standard deviation, and so does an op judged by its mean; the floors apply to all.

Rows are ranked by added seconds per call, largest first (the ops that cost the most extra time lead;
``faster``/``gone`` rows, which save time, come after the ``slower``/``new`` ones), with ``same`` rows
after all of them. Two captures of different device kinds (``cpu`` vs ``cuda``) measure different
times (host vs device) and are not compared: the result carries an ``error`` instead.

Pure functions on metadata dicts; no torch, no I/O.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from typing import Any

from .sizes import class_label, size_class
from .trace_summary import OTHER  # the op table's bucket of the names past its cap

__all__ = ["ABS_FLOOR", "REL_FLOOR", "SHARE_FLOOR", "SIGMAS", "STATUSES", "compare", "compare_basis", "headline",
           "noise_bound", "step_work", "uniform_ratio"]

#: Standard errors of the difference of two means beyond which a change is not run-to-run spread.
SIGMAS = 3.0
#: A change under this fraction of the op's own time before is never reported.
REL_FLOOR = 0.25
#: A change under this fraction of the baseline call's op time (all ops' self seconds a call) is never reported.
SHARE_FLOOR = 0.02
#: Seconds per model call under which a change (or an op appearing, disappearing) is never reported.
ABS_FLOOR = 2e-6
STATUSES = ("slower", "faster", "new", "gone", "same")
NO_CHANGE = "no op changed beyond run-to-run spread"
TIMES = "\N{MULTIPLICATION SIGN}"  # as in "2.1x slower", with the typographic sign


def noise_bound(before: float, sd_before: float, n_before: int, sd_after: float, n_after: int, *,
                call_before: float = 0.0, sigmas: float = SIGMAS, rel_floor: float = REL_FLOOR,
                share_floor: float = SHARE_FLOOR, abs_floor: float = ABS_FLOOR) -> float:
    """Seconds per call a change must exceed to count (the module docstring's rule).

    ``before`` is the op's mean seconds per call before; ``sd_*`` the per-step standard deviations in
    seconds; ``n_*`` the steps each capture used (a count under 1 is taken as 1); ``call_before`` all
    ops' self seconds per call in the baseline.
    """
    spread = math.sqrt(sd_before ** 2 / max(n_before, 1) + sd_after ** 2 / max(n_after, 1))
    return max(sigmas * spread, rel_floor * before, share_floor * call_before, abs_floor)


def compare(before_meta: Mapping[str, Any], after_meta: Mapping[str, Any], *, sigmas: float = SIGMAS,
            rel_floor: float = REL_FLOOR, share_floor: float = SHARE_FLOOR,
            abs_floor: float = ABS_FLOOR) -> dict[str, Any]:
    """The op-by-op change from ``before_meta`` (the baseline capture) to ``after_meta``.

    Both are capture metadata as ``/profiles/{id}`` returns them (``id``, ``device``, ``ops``, ``steps``,
    and where recorded ``top_ops`` and ``step_sizes``). Returns ``{"baseline": before id, "capture":
    after id, "ops": [rows], "leaf_ops": [rows], "basis": {...}, "summary": sentence,
    "seconds_per_call_before", "seconds_per_call_after"}`` (the totals: the ranked ops' seconds per
    call), or the same keys with ``"error"`` set and no rows when the captures cannot be compared
    (different device kinds, no op table).

    ``ops`` ranks the ops the model's own code called (``top_ops``: each with the time of the ops inside
    it folded in, and a ``breakdown`` of rows for those inside ops, compared alike); ``leaf_ops`` is
    the same diff by self time per op name. Captures without a top-level table (taken before it
    existed) are ranked by self time (``ops`` = ``leaf_ops``). ``basis`` says how (``compare_basis``):
    like for like when both captures ran the same size class, else normalised per unit of work.

    Each row: ``op``; ``seconds_per_call_before`` / ``_after`` (the op's seconds per model call, its median
    or mean as the module docstring says; the baseline's scaled by ``basis["scale"]``);
    ``calls_per_call_before`` / ``_after``;
    ``added_seconds_per_call`` (after - before); ``ratio`` (after / before, None when before is 0);
    ``noise_seconds_per_call`` (the bound the change was judged against); ``status``. ``uniform_ratio``
    is the factor by which all large ops moved together (``uniform_ratio()``), or None; when set, the
    summary starts by saying so.
    """
    out: dict[str, Any] = {"baseline": before_meta.get("id"), "capture": after_meta.get("id"), "ops": [],
                           "summary": ""}
    kind_b, kind_a = _device_kind(before_meta.get("device")), _device_kind(after_meta.get("device"))
    if kind_b != kind_a:
        out["error"] = (f"not comparable: the baseline ran on {kind_b or 'an unknown device'}, this capture on "
                        f"{kind_a or 'an unknown device'} (device time vs host time)")
        out["summary"] = out["error"]
        return out
    table_b, n_b = _table(before_meta)
    table_a, n_a = _table(after_meta)
    missing = [what for what, (table, n) in (("baseline", (table_b, n_b)), ("capture", (table_a, n_a)))
               if table is None or n < 1]
    if missing:
        out["error"] = f"not comparable: the {' and the '.join(missing)} has no per-step op table"
        out["summary"] = out["error"]
        return out
    assert table_b is not None and table_a is not None
    basis = compare_basis(before_meta, after_meta)
    scale = basis["scale"]
    floors = {"sigmas": sigmas, "rel_floor": rel_floor, "share_floor": share_floor, "abs_floor": abs_floor}
    # The noise floors relative to the call: the baseline call's op time, on the same basis.
    call_before = scale * sum(_stats(e)[0] for e in table_b.values())
    leaf = _rows(table_b, n_b, table_a, n_a, scale, call_before, floors)
    top_b, top_a = _top(before_meta), _top(after_meta)
    if top_b is not None and top_a is not None:
        basis["level"] = "top"
        rows = _rows(top_b, n_b, top_a, n_a, scale, call_before, floors)
        for row in rows:
            row["breakdown"] = _rows(_breakdown(top_b, row["op"]), n_b, _breakdown(top_a, row["op"]), n_a, scale,
                                     call_before, floors)
    else:
        basis["level"] = "op"
        rows = leaf
    out["ops"], out["leaf_ops"], out["basis"] = rows, leaf, basis
    out["seconds_per_call_before"] = sum(r["seconds_per_call_before"] for r in rows)
    out["seconds_per_call_after"] = sum(r["seconds_per_call_after"] for r in rows)
    out["summary"] = _sentence(rows, out["seconds_per_call_before"], out["seconds_per_call_after"])
    uniform = uniform_ratio(rows)
    out["uniform_ratio"] = uniform
    if uniform is not None and out["summary"] != NO_CHANGE:
        factor, way = (uniform, "slower") if uniform > 1 else (1 / uniform, "faster")  # uniform > 0: no 1/0
        out["summary"] = (f"every large op ~{_factor(factor)}{TIMES} {way} alike: the machine or runtime more likely "
                          f"than one op (CPU contention, clocks, threads, a library); {out['summary']}")
    if basis["sizes"] == "normalised":
        out["summary"] = (f"per unit of work (baseline at size {basis['size_class_before']}, this capture at "
                          f"{basis['size_class_after']}; no baseline of this size yet): {out['summary']}")
    return out


def compare_basis(before_meta: Mapping[str, Any], after_meta: Mapping[str, Any]) -> dict[str, Any]:
    """How two captures' tables are lined up, from the work of the steps each table averages.

    ``sizes``: ``"same_size_class"`` when most steps of both fell in one size class
    (``perfmon.captures.detector.size_class``): compared per call, as they are; ``"normalised"`` when they
    did not: the baseline's seconds are scaled by ``scale`` = the capture's mean work per step over the
    baseline's, so a call is compared with what the baseline would have spent on the same work at its cost
    per unit (exact for ops whose time grows with the work, as the large ones do; an overstatement for the
    fixed cost of small ops, which read as ``faster``); ``"unknown"`` when a capture has no recorded step
    work (``scale`` 1). ``size_class_before`` / ``_after`` are the majority classes' labels,
    ``work_per_call_before`` / ``_after`` the mean work of the steps used (None when unknown)."""
    work_b, class_b = step_work(before_meta)
    work_a, class_a = step_work(after_meta)
    out: dict[str, Any] = {"size_class_before": class_b, "size_class_after": class_a,
                           "work_per_call_before": work_b, "work_per_call_after": work_a, "scale": 1.0}
    if work_b is None or work_a is None or class_b is None or class_a is None:
        out["sizes"] = "unknown"
    elif class_b == class_a:
        out["sizes"] = "same_size_class"
    else:
        out["sizes"] = "normalised"
        out["scale"] = work_a / work_b
    return out


def step_work(meta: Mapping[str, Any]) -> tuple[float | None, str | None]:
    """(mean work per step, the majority size class's label) over the steps a capture's table averages
    (the last ``steps`` of its ``step_sizes``), or (None, None) when any of them is unknown."""
    sizes, steps = meta.get("step_sizes"), meta.get("steps")
    if not isinstance(sizes, list) or not isinstance(steps, int) or isinstance(steps, bool) or steps < 1 \
            or len(sizes) < steps:
        return None, None
    used = sizes[len(sizes) - steps:]
    if not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in used):
        return None, None
    counts = Counter(size_class(s) for s in used)
    majority = max(counts, key=lambda c: (counts[c], c))
    return sum(used) / len(used), class_label(majority)


def _rows(table_b: Mapping[str, Any], n_b: int, table_a: Mapping[str, Any], n_a: int, scale: float,
          call_before: float, floors: Mapping[str, float]) -> list[dict[str, Any]]:
    """One row per op name of either table, judged against the noise bound, ranked."""
    rows: list[dict[str, Any]] = []
    for name in sorted(table_b.keys() | table_a.keys()):
        b, a = table_b.get(name), table_a.get(name)
        sec_b, sd_b, calls_b = _stats(b)
        sec_b, sd_b = sec_b * scale, sd_b * scale
        sec_a, sd_a, calls_a = _stats(a)
        noise = noise_bound(sec_b, sd_b, n_b, sd_a, n_a, call_before=call_before, **floors)
        delta = sec_a - sec_b
        if bool(calls_b) != bool(calls_a):  # on one side only
            if _systematic(name, a if calls_a else b, table_b if calls_a else table_a):
                noise = max(floors["share_floor"] * call_before, floors["abs_floor"])
            present, side = (sec_a, "new") if calls_a else (sec_b, "gone")
            status = side if present > noise else "same"
        else:
            if _calls_moved(calls_b, calls_a, delta, b, a):
                noise = max(floors["rel_floor"] * sec_b, floors["share_floor"] * call_before, floors["abs_floor"])
            status = ("slower" if delta > 0 else "faster") if abs(delta) > noise else "same"
        rows.append({"op": name, "seconds_per_call_before": sec_b, "seconds_per_call_after": sec_a,
                     "calls_per_call_before": calls_b, "calls_per_call_after": calls_a,
                     "added_seconds_per_call": delta, "ratio": sec_a / sec_b if sec_b > 0 else None,
                     "noise_seconds_per_call": noise, "status": status})
    rows.sort(key=lambda r: (r["status"] == "same", -r["added_seconds_per_call"], r["op"]))
    return rows


#: uniform_ratio(): the whole call moved by at least this factor (either way) ...
UNIFORM_MIN_RATIO = 1.25
#: ... and each op of the top UNIFORM_COVERAGE of the baseline's time moved within this factor of it ...
UNIFORM_SPREAD = 1.3
UNIFORM_COVERAGE = 0.8
#: ... with at least this many such ops (one dominant op that moved is that op's change).
UNIFORM_MIN_OPS = 3


def uniform_ratio(rows: list[dict[str, Any]]) -> float | None:
    """The factor (positive, finite) by which the ops in both captures moved together, or None.

    A whole machine or runtime that got slower (CPU contention on a shared host, a lower clock, fewer
    threads, another library build) moves every op by about the same factor; a model change moves some
    ops. The call's common ops must have moved by at least ``UNIFORM_MIN_RATIO`` in all, and each of
    the largest ops carrying ``UNIFORM_COVERAGE`` of the baseline's time (at least ``UNIFORM_MIN_OPS``
    of them) within ``UNIFORM_SPREAD`` of that factor. A hint for the reader, not a status: the rows
    are judged as before. Measured where it came from: under CPU contention, an unchanged model's
    comparison otherwise names whichever op is largest as ``slower``."""
    common = [r for r in rows if r["seconds_per_call_before"] > 0 and r["seconds_per_call_after"] > 0
              and r["calls_per_call_before"] and r["calls_per_call_after"]]
    before = sum(r["seconds_per_call_before"] for r in common)
    after = sum(r["seconds_per_call_after"] for r in common)
    if before <= 0 or after <= 0:
        return None
    ratio = after / before
    if not 0 < ratio < math.inf or 1 / UNIFORM_MIN_RATIO < ratio < UNIFORM_MIN_RATIO:
        return None  # a ratio that under- or overflowed a float (every op 1e-300 of what it was) says nothing
    covered, large = 0.0, []
    for r in sorted(common, key=lambda r: -r["seconds_per_call_before"]):
        if covered >= UNIFORM_COVERAGE * before:
            break
        large.append(r)
        covered += r["seconds_per_call_before"]
    if len(large) < UNIFORM_MIN_OPS:
        return None
    for r in large:
        moved = r["seconds_per_call_after"] / r["seconds_per_call_before"]
        if not ratio / UNIFORM_SPREAD <= moved <= ratio * UNIFORM_SPREAD:
            return None
    # Three decimals, or three significant digits below 0.1: round(1e-4, 3) is 0.0, and every op 10,000x faster
    # is a ratio of 0.0001, not 0 (the summary divides by it).
    return float(round(ratio, 3)) if ratio >= 0.1 else float(f"{ratio:.3g}")


def headline(comparison: Mapping[str, Any]) -> dict[str, Any] | None:
    """The change that explains the most added time (``_ranked``: the ``slower``/``new`` row adding the most,
    else the ``faster``/``gone`` row saving the most), or None when no row changed."""
    changed = _ranked(comparison.get("ops") or ())
    return changed[0] if changed else None


def _ranked(rows: Any) -> list[dict[str, Any]]:
    """Changed rows, those that add time first (most added first), then those that save it (most saved first):
    a regression is explained by what got slower, and a capture normalised across sizes makes small fixed-cost
    ops read faster."""
    changed = [r for r in rows if r.get("status") != "same"]
    return sorted(changed, key=lambda r: (r["added_seconds_per_call"] <= 0, -abs(r["added_seconds_per_call"])))


def _device_kind(device: Any) -> str | None:
    """``cpu`` / ``cuda`` / ... from ``cuda:0``; None when unknown."""
    if not device:
        return None
    return str(device).partition(":")[0] or None


def _table(meta: Mapping[str, Any]) -> tuple[dict[str, Any] | None, int]:
    ops, steps = meta.get("ops"), meta.get("steps")
    if not isinstance(ops, Mapping) or not isinstance(steps, int) or isinstance(steps, bool):
        return None, 0
    return dict(ops), steps


def _top(meta: Mapping[str, Any]) -> dict[str, Any] | None:
    """The capture's top-level op table, or None when it has none (taken before there was one)."""
    top = meta.get("top_ops")
    return dict(top) if isinstance(top, Mapping) and top else None


def _breakdown(top: Mapping[str, Any], name: str) -> dict[str, Any]:
    entry = top.get(name)
    inner = entry.get("breakdown") if isinstance(entry, Mapping) else None
    return dict(inner) if isinstance(inner, Mapping) else {}


#: An op called this factor as often a model call (or more; or 1/it) on both sides of a like-for-like comparison
#: does different work, which is no run-to-run spread (``_calls_moved``).
CALLS_MOVED = 1.25


def _calls_moved(calls_b: float, calls_a: float, delta: float, b: Any, a: Any) -> bool:
    """Whether an op in both tables is called ``CALLS_MOVED`` times as often (or as rarely) a call after as before,
    in every step on both sides (``share_of_steps`` 1), its time moved the same way: the model's work changed (a
    layer run twice, a loop longer), so only the floors judge its time, as for an op new in every step. The
    spread would not: one preempted step of eight hid an encoder layer called twice as often as ``same``."""
    if calls_b <= 0 or calls_a <= 0 or not (_every_step(b) and _every_step(a)):
        return False
    factor = calls_a / calls_b
    return (factor >= CALLS_MOVED and delta > 0) or (factor <= 1 / CALLS_MOVED and delta < 0)


def _every_step(entry: Any) -> bool:
    share = entry.get("share_of_steps") if isinstance(entry, Mapping) else None
    return _number(share) and share == 1.0


def _systematic(name: str, present: Any, other_table: Mapping[str, Any]) -> bool:
    """An op on one side only that is there in every step used (``share_of_steps`` 1; captures without
    that field never qualify), when the other side's table is complete (no ``[other]`` row, into which
    the op could have been summed) and it is not ``[other]`` itself."""
    if name == OTHER or OTHER in other_table or not isinstance(present, Mapping):
        return False
    # Exactly 1 (n/n, rounded): anything above is a broken table, not "more than every step".
    return _every_step(present)


#: The median absolute deviation times this estimates a normal spread's standard deviation.
MAD_TO_SD = 1.4826


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _stats(entry: Any) -> tuple[float, float, float]:
    """(typical seconds, spread seconds, mean calls) per step of one table entry; zeros when absent.

    Typical: the median over the steps for an op called in every step (``share_of_steps`` 1) when the table
    has it, else the mean (an op called in some steps only is judged by what it adds on average; the median
    of a burst in one step of five is 0). Spread: with the median, the median absolute deviation as a standard
    deviation (``MAD_TO_SD``) when the table has it, else the standard deviation."""
    if not isinstance(entry, Mapping):
        return 0.0, 0.0, 0.0
    seconds = entry.get("seconds_per_step")
    spread = float(entry.get("seconds_per_step_stdev") or 0.0)
    median, mad = entry.get("seconds_per_step_median"), entry.get("seconds_per_step_mad")
    if _every_step(entry) and _number(median):
        seconds = median
        if _number(mad):
            spread = MAD_TO_SD * float(mad or 0.0)
    return float(seconds or 0.0), spread, float(entry.get("calls_per_step") or 0.0)


def _ms(seconds: float) -> str:
    """A duration for a sentence: ms with two significant decimals, µs below 0.1 ms, seconds from 1000 s."""
    if abs(seconds) >= 1e3:  # not a real model call; still one short figure, not 300 digits
        return f"{seconds:.3g} s"
    if abs(seconds) < 1e-4:
        return f"{seconds * 1e6:.0f} µs"
    return f"{seconds * 1e3:.2g} ms" if abs(seconds) < 1e-3 else f"{seconds * 1e3:.1f} ms"


def _factor(times: float) -> str:
    """A factor for a sentence: "1.8", "10,000"; past a million (or infinite: an op now taking no time) a bound."""
    if times < 1e3:
        return f"{times:.1f}"
    return f"{times:,.0f}" if times < 1e6 else "over 1,000,000"


def _signed(seconds: float) -> str:
    return ("+" if seconds >= 0 else "-") + _ms(abs(seconds))


def _phrase(row: Mapping[str, Any]) -> str:
    op, status, added = row["op"], row["status"], row["added_seconds_per_call"]
    if status == "new":
        return f"new {op} adds {_ms(added)} a call"
    if status == "gone":
        return f"{op} gone ({_signed(added)} a call)"
    ratio = row.get("ratio")
    if ratio is None:
        return f"{op} {status} ({_signed(added)} a call)"
    times = ratio if status == "slower" else 1.0 / ratio if ratio > 0 else math.inf
    calls_b, calls_a = row.get("calls_per_call_before") or 0, row.get("calls_per_call_after") or 0
    often = ""
    if calls_b > 0 and calls_a > 0 and max(calls_a / calls_b, calls_b / calls_a) >= CALLS_MOVED:
        often = f", called {calls_b:g} -> {calls_a:g} times a call"
    return f"{op} {_factor(times)}{TIMES} {status} ({_signed(added)} a call{often})"


def _sentence(rows: list[dict[str, Any]], total_before: float, total_after: float, top: int = 3) -> str:
    """One sentence: the (up to ``top``) changes that moved a call's time the most, then the totals."""
    changed = _ranked(rows)
    if not changed:
        return NO_CHANGE
    text = "; ".join(_phrase(r) for r in changed[:top])
    if len(changed) > top:
        text += f"; {len(changed) - top} more changed"
    return f"{text} (ops {_ms(total_before)} → {_ms(total_after)} a call)"
