"""Garbage-collection pauses of this process: stamped by a ``gc.callbacks`` hook, read on the resolver's tick.

    any thread, GIL held   _on_gc(phase, info): "start" stamps perf_counter_ns; "stop" appends
                           (start_ns, end_ns, generation, collected) to each installed GcPauses' ring,
                           and adds a full (gen-2) one to a bound ThreadGc when it ran on that one's thread
    resolver thread        GcPauses.drain() ─► sinks (the pause histogram, collected objects) and the kept
                           pauses (sorted by time) that mark() and summary() read

A collection runs on whichever thread allocated past the threshold, holding the GIL, for every collection
(gen-0 ones come tens to hundreds of times a second in a torch loop), so the hook does two clock reads, one
tuple and one ``deque.append`` per installed monitor (and one dict lookup while a thread is bound), nothing
else: no lock, no counter, no wake. It never raises (a fault is counted in a module counter and reported as
``internal_errors{stage="gc"}`` by the resolver's next drain; reporting from the hook could take a lock the
collecting thread already holds).

One hook per process whatever the number of monitors: ``install()`` adds this monitor's ring to the hook's
tuple and puts the hook in ``gc.callbacks`` once; ``uninstall()`` takes the ring out, and the hook with the
last one (unless a ``ThreadGc`` still sums a thread's full collections: the HTTP loop's budget leaves them out).
A forked child keeps both (``gc.callbacks`` and this module's state are copied), so a monitor that restarts
there finds itself installed; ``reset_after_fork`` empties what the parent recorded.

Pauses of a call finish before the call's record reaches the resolver (the collector holds the GIL, and the
call's end stamp needs it), and the resolver drains this ring after it takes the records of its pass, so the
pauses that overlapped a call are kept when its sample is marked. A ring holds ``RING_SIZE`` pauses between
two drains: the resolver's passes are a second apart while the process collects, but collections that begin while
it dozes (agent/doze.py: up to 8 s, and the hook cannot wake it, as it can take no lock) wait for its next pass, so
the ring holds 8 s at 4,096 a second (~150 bytes a pause, allocated only as it fills); more than that is a process
doing little but collecting, and the oldest go: a drain that finds the ring full says so once, a warning
(``gc_pauses_dropped``), since the pause series then undercount that stretch.
"""

from __future__ import annotations

import collections
import gc
import itertools
import os
import threading
from _thread import get_ident
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Callable
from time import perf_counter_ns
from typing import Any

from ..agent.records import Sample
from ..faults import InternalErrors, count_value

__all__ = ["GENERATIONS", "RING_SIZE", "GcPauses", "Pause", "PauseSink", "ThreadGc"]

#: CPython's collector generations (the ``generation`` label).
GENERATIONS = (0, 1, 2)
#: Pauses a ring holds between two drains.
RING_SIZE = 32_768
#: Pauses kept for overlap and summaries (the oldest go first), and for how long.
MAX_KEPT = 16_384

#: The ``gc_pauses_dropped`` warning's note.
_OVERFLOWED = ("the ring of GC pauses filled between two of the resolver's passes: collections past it pushed the "
               "oldest out unrecorded, so perfmon_gc_pause_seconds may undercount that stretch (warned once)")
#: (start_ns, end_ns, generation, collected objects): one collection, on perf_counter_ns.
Pause = tuple[int, int, int, int]
#: A stage fed each drained batch of pauses (resolver thread).
PauseSink = Callable[[list[Pause]], None]

# The hook's state: module globals, the cheapest reads from the callback.
_start_ns = 0
#: The generation of the collection ``_start_ns`` stamped (read with it: a collection still open).
_start_gen = -1
_rings: tuple[collections.deque[Pause], ...] = ()
#: Threads whose full (generation-2) collections are summed (``ThreadGc``): thread ident -> [nanoseconds].
_threads: dict[int, list[int]] = {}
_errors = itertools.count()
_last_error: BaseException | None = None
_lock = threading.Lock()  # install/uninstall only; never taken by the hook


def _on_gc(phase: str, info: dict[str, int]) -> None:
    """The ``gc.callbacks`` hook: stamp, append, nothing else (runs in every collection, on any thread)."""
    global _start_ns, _start_gen, _last_error
    try:
        if phase == "start":
            _start_gen = info["generation"]
            _start_ns = perf_counter_ns()
            return
        start, _start_ns = _start_ns, 0
        if start:  # 0: installed while a collection was running; its start was not seen
            end = perf_counter_ns()
            if _rings:
                pause = (start, end, info["generation"], info["collected"])
                for ring in _rings:
                    ring.append(pause)
            if _threads and info["generation"] == 2:
                spent = _threads.get(get_ident())
                if spent is not None:
                    spent[0] += end - start
    except Exception as exc:  # never into the collector (it would print an "Exception ignored" line)
        next(_errors)
        _last_error = exc


def _open() -> tuple[int, int]:
    """(start_ns, generation) of a collection under way on another thread, or (0, -1).

    Read on the resolver's pass: it runs while a collection is still open only when a ``gc.callbacks`` entry
    ahead of this hook handed the GIL over at stop (Python work, a wait), and the call that waited for the
    collection may have returned and been queued meanwhile (a helper's run: 16-20 of 20 such calls marked)."""
    start, gen = _start_ns, _start_gen
    return (start, gen) if start and gen >= 0 else (0, -1)


def _after_fork_in_child() -> None:
    global _lock, _start_ns
    _lock = threading.Lock()  # a thread of the parent may have held it at fork()
    _start_ns = 0
    _threads.clear()  # the parent's threads are not the child's (an ident may come round again)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _hook_needed() -> None:
    """Put the hook in ``gc.callbacks`` while a ring or a thread is fed, take it out after (under ``_lock``)."""
    global _start_ns
    wanted = bool(_rings or _threads)
    if wanted and _on_gc not in gc.callbacks:
        gc.callbacks.append(_on_gc)
    elif not wanted and _on_gc in gc.callbacks:
        gc.callbacks.remove(_on_gc)
        _start_ns = 0  # taken out mid-collection (a callback's stop handed the GIL over): no stop will clear it


class ThreadGc:
    """Seconds of full garbage collections that ran on one thread: what the agent's HTTP loop leaves out of its budgets.

    A collection runs on whichever thread allocates past the threshold. A full (generation-2) one's work is the whole
    heap's, not that thread's: in a server holding a few million objects it takes 0.3-1 s. Charged to the HTTP loop's
    1%-of-a-core budget, one that happened to land there put the budget 30-100 s in debt, and the next scrapes missed
    Prometheus' timeout. Young collections (generations 0 and 1) stay charged: their work is the recent allocations,
    which the thread's own work drives (a flood of requests must not buy itself collections the budget does not see).
    ``bind()`` on the thread itself (the hook goes into ``gc.callbacks`` while a thread is bound), ``seconds()`` from
    that thread, ``unbind()`` when it ends.
    """

    def __init__(self) -> None:
        self._spent = [0]
        self._ident: int | None = None

    def bind(self) -> None:
        """Sum the full collections that run on the calling thread from now on. Idempotent on that thread."""
        with _lock:
            self._ident = get_ident()
            _threads[self._ident] = self._spent
            _hook_needed()

    def unbind(self) -> None:
        """Stop summing (the sum is kept). Idempotent."""
        with _lock:
            if self._ident is not None and _threads.get(self._ident) is self._spent:
                del _threads[self._ident]
            self._ident = None
            _hook_needed()

    def seconds(self) -> float:
        """Seconds of full collections on the bound thread since it was first bound (0.0 while none ran)."""
        return self._spent[0] / 1e9


class GcPauses:
    """One monitor's view of the process's GC pauses: its ring, the pauses it keeps, the sinks it feeds.

    ``keep_seconds``: how long pauses are kept for ``mark``, ``overlap`` and ``summary`` (at most
    ``MAX_KEPT`` of them). Drained and read on the resolver thread; ``summary`` from any thread.
    """

    def __init__(self, *, internal: InternalErrors, keep_seconds: float = 120.0, ring_size: int = RING_SIZE,
                 max_kept: int = MAX_KEPT) -> None:
        self._internal = internal
        self.keep_ns = int(keep_seconds * 1e9)
        self.max_kept = max_kept
        self.ring: collections.deque[Pause] = collections.deque(maxlen=ring_size)
        self.sinks: list[PauseSink] = []
        self._drained = 0  # pauses drained since ``take_drained`` last read them
        self._overflowed = False  # the ring was found full once (warned)
        self._errors_seen = count_value(_errors)
        self._reset()

    def _reset(self) -> None:
        self._starts = array("q")
        self._ends = array("q")
        self._gens = array("b")
        self._kept_lock = threading.Lock()
        #: perf_counter_ns of the oldest pause ever dropped from the kept ones (summaries before it are partial).
        self._trimmed_ns = 0

    @property
    def installed(self) -> bool:
        """Whether this monitor's ring is fed by the hook now."""
        return any(r is self.ring for r in _rings)

    def install(self) -> None:
        """Feed this monitor's ring from the hook; the hook goes into ``gc.callbacks`` once. Idempotent."""
        global _rings
        with _lock:
            if not any(r is self.ring for r in _rings):
                _rings = (*_rings, self.ring)
            _hook_needed()

    def uninstall(self) -> None:
        """Stop feeding this ring; the hook leaves ``gc.callbacks`` with the last ring and thread. Idempotent."""
        global _rings
        with _lock:
            _rings = tuple(r for r in _rings if r is not self.ring)
            _hook_needed()

    def start(self) -> None:
        """``install()``: the monitor starts it with its other parts."""
        self.install()

    def stop(self, timeout_seconds: float | None = None) -> None:
        """``uninstall()``, before the resolver's last pass drains the ring (nothing to wait for)."""
        self.uninstall()

    def reset_after_fork(self) -> None:
        """In a forked child: the parent's pauses are the parent's (the installation itself is inherited)."""
        self.ring.clear()
        self._errors_seen = count_value(_errors)
        self._reset()

    # -- resolver thread ----------------------------------------------------------------------

    def drain(self) -> int:
        """Move the ring's pauses to the kept ones and the sinks; returns how many. Never raises."""
        ring = self.ring
        if not self._overflowed and len(ring) >= (ring.maxlen or 0):
            # Full: the hook may have pushed the oldest out (it cannot count them: no counter in a collection).
            self._overflowed = True
            self._internal.notice("gc_pauses_dropped", ring=ring.maxlen, note=_OVERFLOWED)
        batch: list[Pause] = []
        while ring:
            try:
                batch.append(ring.popleft())
            except IndexError:  # pragma: no cover - only the resolver pops
                break
        self._report_errors()
        if not batch:
            return 0
        self._drained += len(batch)
        try:
            self._keep(batch)
        except Exception as exc:  # pragma: no cover - arrays of ints
            self._internal.report("gc", exc)
        for sink in self.sinks:
            try:
                sink(batch)
            except Exception as exc:
                self._internal.report("gc", exc)
        return len(batch)

    def take_drained(self) -> int:
        """Pauses drained since the last call: a resolver pass that drained some is not quiet (agent/doze.py)."""
        n, self._drained = self._drained, 0
        return n

    def _report_errors(self) -> None:
        """The hook's faults since the last drain, into the internal error counter (exactly, in order)."""
        seen, now = self._errors_seen, count_value(_errors)
        if now > seen:
            self._errors_seen = now
            exc = _last_error or RuntimeError("gc callback failed")
            for _ in range(now - seen):
                self._internal.report("gc", exc)

    def _keep(self, batch: list[Pause]) -> None:
        with self._kept_lock:
            starts, ends, gens = self._starts, self._ends, self._gens
            for start, end, gen, _ in batch:
                if ends and end < ends[-1]:  # pragma: no cover - collections never overlap; keep the order anyway
                    continue
                starts.append(start)
                ends.append(end)
                gens.append(min(max(gen, 0), 2))
            cut = max(bisect_left(ends, ends[-1] - self.keep_ns), len(ends) - self.max_kept) if ends else 0
            if cut > 0:
                self._trimmed_ns = ends[cut - 1]
                del starts[:cut], ends[:cut], gens[:cut]

    def mark(self, samples: list[Sample]) -> list[Sample]:
        """Drain, then mark each sample whose call overlapped a pause (``gc_seconds``, ``gc_generation``).

        The resolver's hook between taking a pass's records and handing them to the sinks. A call spans
        ``[end_ns - host_seconds, end_ns]`` on perf_counter_ns; most calls overlap nothing and cost one compare.
        """
        self.drain()
        ends = self._ends
        opened, _ = _open()
        if not samples or not (ends or opened):
            return samples
        newest = ends[-1] if ends else 0
        for i, s in enumerate(samples):
            start = s.end_ns - round(s.host_seconds * 1e9)
            if start >= newest and not 0 < opened < s.end_ns:  # no pause ended after this call began, none open
                continue
            seconds, gen = self.overlap(start, s.end_ns)
            if gen >= 0:
                samples[i] = s._replace(gc_seconds=seconds, gc_generation=gen)
        return samples

    # -- queries ------------------------------------------------------------------------------

    def overlap(self, start_ns: int, end_ns: int) -> tuple[float, int]:
        """(seconds of pauses inside ``[start_ns, end_ns]``, the highest generation among them or -1).

        A collection still open (``_open``) that began before ``end_ns`` counts from its start: it ran through the
        rest of the interval."""
        with self._kept_lock:
            starts, ends, gens = self._starts, self._ends, self._gens
            i = bisect_right(ends, start_ns)  # the first pause that ended after the interval began
            seconds, gen = 0, -1
            while i < len(ends) and starts[i] < end_ns:
                seconds += min(ends[i], end_ns) - max(starts[i], start_ns)
                gen = max(gen, gens[i])
                i += 1
        opened, open_gen = _open()
        if 0 < opened < end_ns:  # not in the table yet: the hook clears the start before it appends the pause
            seconds += end_ns - max(opened, start_ns)
            gen = max(gen, open_gen)
        return seconds / 1e9, gen

    def summary(self, since_ns: int, until_ns: int) -> dict[str, Any]:
        """The pauses that ended in ``(since_ns, until_ns]`` (perf_counter_ns), per generation.

        ``{"generations": {"0": {"count", "seconds", "max_seconds"}, "1": ..., "2": ...}, "complete": bool}``:
        seconds are whole pauses; ``complete`` is False when pauses of that span were already dropped (older
        than ``keep_seconds``, or past ``max_kept``). Pure: it reads, never drains.
        """
        with self._kept_lock:
            lo, hi = bisect_right(self._ends, since_ns), bisect_right(self._ends, until_ns)
            rows = list(zip(self._starts[lo:hi], self._ends[lo:hi], self._gens[lo:hi], strict=True))
            complete = self._trimmed_ns <= since_ns
        out: dict[str, dict[str, Any]] = {str(g): {"count": 0, "seconds": 0.0, "max_seconds": 0.0} for g in GENERATIONS}
        for start, end, gen in rows:
            row = out[str(gen)]
            seconds = (end - start) / 1e9
            row["count"] += 1
            row["seconds"] += seconds
            row["max_seconds"] = max(row["max_seconds"], seconds)
        return {"generations": out, "complete": complete}
