"""What GC pauses did to a model's calls and generation requests: the /stats sections, the generation sink, and
the ``gc`` entry of a regression capture's reason.

Reads what the resolver marked (``Sample.gc_generation``, kept in the /stats windows) and the pauses
``telemetry/gcpauses.py`` keeps; the generation sink marks TTFTs and requests itself when the resolver's tick
drains them. "The slowest" are a set's samples at or above its p99 (the top 1%, at least one): a p99 spike made
by a gen-2 collection shows here as the slowest calls having overlapped one.
"""

from __future__ import annotations

import collections
import math
import threading
from collections.abc import Iterable
from time import perf_counter_ns
from typing import Any

from ..agent.gen_events import GenerationEvent, RequestDone, TokenTiming
from ..agent.records import STEADY
from ..telemetry.gcpauses import GcPauses
from .windows import Windows

__all__ = ["GcView", "overlap_stats", "sentence"]


def overlap_stats(values: Iterable[tuple[float, int]], what: str = "calls") -> dict[str, Any]:
    """How many of ``values`` (seconds, GC generation overlapped or -1) overlapped a pause, and of the slowest.

    ``slowest``: the values at or above the p99 (the top ``ceil(1%)``, at least one); ``p99_overlapped_gc``:
    the share of them that overlapped a pause (None without values); ``slowest_generation``: the highest
    generation among those (None: none did); ``summary``: one sentence (``sentence``).
    """
    ordered = sorted(values, key=lambda v: v[0], reverse=True)
    n = len(ordered)
    k = max(1, math.ceil(n * 0.01)) if n else 0
    slow = [g for _, g in ordered[:k] if g >= 0]
    by_gen: dict[str, int] = {}
    slow_by_gen: dict[str, int] = {}
    for counts, gens in ((by_gen, [g for _, g in ordered if g >= 0]), (slow_by_gen, slow)):
        for g in gens:
            counts[str(g)] = counts.get(str(g), 0) + 1
    out = {"samples": n, "overlapped": sum(by_gen.values()), "overlapped_by_generation": by_gen,
           "slowest": k, "slowest_overlapped": len(slow), "slowest_overlapped_by_generation": slow_by_gen,
           "p99_overlapped_gc": len(slow) / k if k else None, "slowest_generation": max(slow) if slow else None}
    out["summary"] = sentence(out, what)
    return out


def sentence(stats: dict[str, Any], what: str = "calls") -> str:
    """One line from ``overlap_stats``: "gen-2 GC pauses overlapped 7 of the 9 slowest calls"."""
    k, gen = stats["slowest"], stats["slowest_generation"]
    if not k:
        return f"no {what} in the window"
    slowest = f"the slowest of {stats['samples']} {what}" if k == 1 else f"the {k} slowest {what}"
    if gen is None:
        return f"no GC pause overlapped {slowest}"
    top = stats["slowest_overlapped_by_generation"][str(gen)]
    line = f"gen-{gen} GC pauses overlapped {top} of {slowest}"
    if stats["slowest_overlapped"] > top:
        line += f" ({stats['slowest_overlapped']} of them overlapped a pause of any generation)"
    return line


class GcView:
    """The GC sections of /stats, the generation sink and the regression reason of one monitor."""

    def __init__(self, pauses: GcPauses, windows: Windows, *, window_seconds: float, max_samples: int) -> None:
        self.pauses = pauses
        self._windows = windows
        self.window_ns = int(window_seconds * 1e9)
        self.max_samples = max_samples
        #: generation name -> (end_ns, kind "ttft" | "request", seconds, gc_generation)
        self._requests: dict[str, collections.deque[tuple[int, str, float, int]]] = {}
        self._lock = threading.Lock()

    def reset_after_fork(self) -> None:
        self._requests = {}
        self._lock = threading.Lock()

    def generation_sink(self, events: list[GenerationEvent]) -> None:
        """Mark each TTFT and each ended request that overlapped a pause (resolver thread, at its tick)."""
        self.pauses.drain()  # the pauses of requests the tracker drained in this same tick
        rows: list[tuple[str, tuple[int, str, float, int]]] = []
        for ev in events:
            if isinstance(ev, TokenTiming):
                if ev.kind != "ttft":
                    continue
                kind, seconds = "ttft", ev.seconds
            elif isinstance(ev, RequestDone):
                kind, seconds = "request", ev.duration_seconds
            else:  # a request's inter-token gaps (TokenRun): only TTFTs and requests are marked
                continue
            _, gen = self.pauses.overlap(ev.end_ns - round(seconds * 1e9), ev.end_ns)
            rows.append((ev.model, (ev.end_ns, kind, seconds, gen)))
        if not rows:
            return
        with self._lock:
            for name, row in rows:
                ring = self._requests.get(name)
                if ring is None:
                    ring = self._requests[name] = collections.deque(maxlen=self.max_samples)
                ring.append(row)

    def stats(self, now_ns: int | None = None) -> dict[str, Any]:
        """/stats' top-level ``gc``: the pauses of the stats window, per generation."""
        now = perf_counter_ns() if now_ns is None else now_ns
        return {"window_seconds": self.window_ns / 1e9, **self.pauses.summary(now - self.window_ns, now)}

    def model(self, model: str, stage: str, now_ns: int) -> dict[str, Any]:
        """A series' steady samples of the stats window: how many overlapped a pause, and of the slowest."""
        return overlap_stats(self._windows.marks(model, STEADY, now_ns - self.window_ns, now_ns, stage))

    def generation(self, name: str, now_ns: int) -> dict[str, Any] | None:
        """A generation name's TTFTs and requests of the stats window that overlapped a pause (None: none yet)."""
        with self._lock:
            ring = self._requests.get(name)
            rows = [r for r in ring if r[0] > now_ns - self.window_ns] if ring is not None else None
        if rows is None:
            return None
        return {"time_to_first_token": overlap_stats(((s, g) for _, k, s, g in rows if k == "ttft"), "TTFTs"),
                "requests": overlap_stats(((s, g) for _, k, s, g in rows if k == "request"), "requests")}

    def regression(self, model: str, stage: str, since_ns: int, until_ns: int) -> dict[str, Any]:
        """The ``gc`` entry of a regression capture's reason: the regressed windows' pauses per generation and
        how many of their (steady) samples, and of the slowest, overlapped one, with its one-line summary."""
        out = overlap_stats(self._windows.marks(model, STEADY, since_ns, until_ns, stage))
        out["pauses"] = self.pauses.summary(since_ns, until_ns)
        return out
