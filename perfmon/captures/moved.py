"""What moved when a regression fired: size class, queue, GC, host vs device, ops — one entry each, one sentence.

A regression capture's ``reason`` carries ``moved``: what an operator checks first, each part measured apart
from the others, so "p99 doubled" comes with "and 7 of the 9 slowest calls overlapped a gen-2 pause" or "the
traffic moved to batches of 128-255" or "the device time did not move, the host's did". The parts come from
their owners (the detector's windows, ``stats/gc.py``, the request spans, the /stats windows) as the entries
of the regression's reason; ``summarise`` reads them, and ``add_ops`` adds the comparison's headline once the
capture is compared with its baseline. Pure functions on dicts; no torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..stats.windows import quantile

__all__ = ["MOVED_RATIO", "add_ops", "host_device", "queue_moved", "summarise"]

#: A part counts as moved when its median grew by at least this factor between before and during.
MOVED_RATIO = 1.2


def host_device(before: Sequence[tuple[float, float]], during: Sequence[tuple[float, float]], *,
                device_clock: bool) -> dict[str, Any] | None:
    """Host vs device from (duration seconds, host seconds) samples before and during the regressed windows.

    ``device_clock``: the durations are device time (CUDA events); else they are the host's wall time and only
    the host is reported. Returns the medians (s), their ratios and ``moved``: ``"device"``, ``"host"``,
    ``"both"`` or ``"neither"`` (a median counts as moved at ``MOVED_RATIO``), or None without samples on
    both sides."""
    if not before or not during:
        return None
    med = {side: (quantile(sorted(d for d, _ in xs), 0.5), quantile(sorted(h for _, h in xs), 0.5))
           for side, xs in (("before", before), ("during", during))}
    host_ratio = med["during"][1] / med["before"][1] if med["before"][1] > 0 else None
    out: dict[str, Any] = {"host_p50_seconds_before": med["before"][1], "host_p50_seconds_during": med["during"][1],
                           "host_ratio": host_ratio, "samples_before": len(before), "samples_during": len(during)}
    host = host_ratio is not None and host_ratio >= MOVED_RATIO
    if not device_clock:
        out["moved"] = "host" if host else "neither"
        return out
    device_ratio = med["during"][0] / med["before"][0] if med["before"][0] > 0 else None
    device = device_ratio is not None and device_ratio >= MOVED_RATIO
    out.update({"device_p50_seconds_before": med["before"][0], "device_p50_seconds_during": med["during"][0],
                "device_ratio": device_ratio})
    out["moved"] = "both" if host and device else "device" if device else "host" if host else "neither"
    return out


def queue_moved(before: Mapping[str, Any], during: Mapping[str, Any]) -> dict[str, Any] | None:
    """The queue part from request spans (``RequestTracker.recent`` before and during the regressed windows):
    each part's p50 (s) on both sides, and ``moved`` when the queue's p50 grew by ``MOVED_RATIO`` while carrying
    at least a tenth of the request's time. None without requests during the windows (no spans opened)."""
    parts = ("queue", "model", "rest")
    if not (during.get("total") or {}).get("count"):
        return None
    p50 = {side: {part: (src.get(part) or {}).get("p50_seconds") for part in (*parts, "total")}
           for side, src in (("before", before), ("during", during))}
    q_before, q_during, total = p50["before"]["queue"], p50["during"]["queue"], p50["during"]["total"]
    moved = bool(q_during and total and q_during >= 0.1 * total
                 and (not q_before or q_during >= MOVED_RATIO * float(q_before)))
    out: dict[str, Any] = {"p50_seconds_before": p50["before"], "p50_seconds_during": p50["during"], "moved": moved,
                           "requests_during": during["total"]["count"]}
    if moved:
        out["summary"] = (f"requests queued {float(q_during or 0) * 1e3:.1f} ms (p50) before the model"
                          + (f", {float(q_before or 0) * 1e3:.1f} ms before the regression" if q_before else ""))
    return out


def summarise(details: Mapping[str, Any], *, before_classes: Mapping[str, Any] | None) -> dict[str, Any]:
    """The ``moved`` entry of a regression's reason from its other entries (``Regression.as_dict`` plus the
    ``gc``, ``queue`` and ``host_device`` entries where present) and the last healthy window's classes."""
    parts: dict[str, Any] = {}
    words: list[str] = []
    now = _dominant(details.get("classes"))
    before = _dominant(before_classes)
    named = list(details.get("size_classes") or ())
    parts["size"] = {"dominant_before": before, "dominant_during": now, "regressed_classes": named,
                     "mix_moved": bool(now and before and now != before)}
    if parts["size"]["mix_moved"]:
        words.append(f"traffic moved from size {before} to {now}")
    if named:
        words.append(f"slower at size {', '.join(named)}")
    gc = details.get("gc")
    if isinstance(gc, Mapping):
        parts["gc"] = {k: gc.get(k) for k in ("p99_overlapped_gc", "slowest_generation", "summary") if k in gc}
        share = gc.get("p99_overlapped_gc")
        if isinstance(share, (int, float)) and share > 0 and gc.get("summary"):
            words.append(str(gc["summary"]))
    queue = details.get("queue")
    if isinstance(queue, Mapping):
        parts["queue"] = dict(queue)
        if queue.get("moved") and queue.get("summary"):
            words.append(str(queue["summary"]))
    hd = details.get("host_device")
    if isinstance(hd, Mapping):
        parts["host_device"] = {"moved": hd.get("moved"), "host_ratio": hd.get("host_ratio"),
                                "device_ratio": hd.get("device_ratio")}
        words.append(_host_device_words(hd))
    parts["summary"] = "; ".join(w for w in words if w) or "nothing outside the model's ops moved"
    return parts


def add_ops(moved: dict[str, Any], comparison: Mapping[str, Any] | None, headline: Mapping[str, Any] | None) -> None:
    """Add the ops part (the comparison's headline change, or why there is none) to a ``moved`` entry."""
    if comparison is None:
        moved["ops"] = {"compared": False}
        return
    ops: dict[str, Any] = {"compared": "error" not in comparison, "baseline": comparison.get("baseline"),
                           "basis": (comparison.get("basis") or {}).get("sizes")}
    if headline is not None:
        ops.update({"op": headline.get("op"), "status": headline.get("status"),
                    "added_seconds_per_call": headline.get("added_seconds_per_call")})
        moved["summary"] = f"{moved.get('summary', '')}; ops: {headline.get('status')} {headline.get('op')}"
    moved["ops"] = ops


def _dominant(classes: Any) -> str | None:
    """The size class label holding the most samples of a window's ``classes`` entry."""
    if not isinstance(classes, Mapping) or not classes:
        return None
    counts = {label: c.get("samples", 0) for label, c in classes.items() if isinstance(c, Mapping)}
    return max(counts, key=lambda k: counts[k]) if counts else None


def _host_device_words(hd: Mapping[str, Any]) -> str:
    moved = hd.get("moved")
    host, device = hd.get("host_ratio"), hd.get("device_ratio")
    if moved == "device":
        return f"device time {device:.2f}x, host time not"
    if moved == "host":
        return (f"host time {host:.2f}x" + (", device time not" if device is not None else " (a host-timed model)"))
    if moved == "both":
        return f"host time {host:.2f}x and device time {device:.2f}x"
    return "median host and device time did not move (the tail did)"
