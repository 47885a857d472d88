"""GC pauses on the record: the hook, the marks on calls and generation requests, /stats and a regression's reason."""

from __future__ import annotations

import collections
import gc
import os
import threading
from collections.abc import Callable, Iterator
from time import perf_counter_ns
from typing import Any

import pytest
import torch

from perfmon.agent.records import STEADY, Sample
from perfmon.captures.detector import Regression, RegressionPolicy, WindowStats
from perfmon.captures.policy import CapturePolicy
from perfmon.faults import InternalErrors
from perfmon.stats.gc import GcView, overlap_stats
from perfmon.stats.windows import Windows
from perfmon.telemetry import gcpauses
from perfmon.telemetry.gcpauses import GcPauses, ThreadGc

from .conftest import in_forked_child, value

MS = 1_000_000


def _sample(end_ns: int, host_ms: float, model: str = "m", seconds: float | None = None) -> Sample:
    host = host_ms / 1e3
    return Sample(model, "cpu", STEADY, 0, host if seconds is None else seconds, host, end_ns)


def _hooks() -> int:
    return sum(cb is gcpauses._on_gc for cb in gc.callbacks)


@pytest.fixture
def recorder() -> Iterator[list[tuple[int, int, int]]]:
    """The test's own record of every collection, (start_ns, end_ns, generation), from a callback placed first in
    gc.callbacks: its stamps come before perfmon's at start and after them at stop, so each of perfmon's pauses
    lies inside one of these."""
    pauses: list[tuple[int, int, int]] = []
    started = [0]

    def record(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = perf_counter_ns()
        elif started[0]:
            pauses.append((started[0], perf_counter_ns(), info["generation"]))

    gc.callbacks.insert(0, record)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(record)


def _cyclic_heap(n: int) -> list[list[Any]]:
    """n self-referencing lists: a gen-2 collection has to traverse them all (tens of ms)."""
    heap: list[list[Any]] = [[] for _ in range(n)]
    for item in heap:
        item.append(item)
    return heap


# -- the overlap logic, with made-up stamps --------------------------------------------------------------


def test_mark_sets_overlapped_seconds_and_the_highest_generation_by_interval() -> None:
    """A call is marked with the pause time inside its interval and the highest generation it overlapped; a pause
    that ended when the call began, or began when it ended, is not an overlap."""
    p = GcPauses(internal=InternalErrors())
    t = 1_000 * MS
    p.ring.extend([(t, t + 2 * MS, 0, 5), (t + 10 * MS, t + 40 * MS, 2, 100), (t + 45 * MS, t + 46 * MS, 1, 0)])
    samples = [
        _sample(t, 1.0),  # ends when the first pause begins: none
        _sample(t + 1 * MS, 1.0),  # [t, t+1ms]: 1 ms of the gen-0 pause
        _sample(t + 50 * MS, 45.0),  # [t+5, t+50]: the whole gen-2 and gen-1 pauses
        _sample(t + 20 * MS, 2.0),  # inside the gen-2 pause
        _sample(t + 10 * MS, 8.0),  # [t+2, t+10]: between pauses, touching both
        _sample(t + 100 * MS, 10.0),  # after every pause
    ]
    marked = p.mark(samples)
    assert [(round(s.gc_seconds * 1e3, 6), s.gc_generation) for s in marked] == [
        (0.0, -1), (1.0, 0), (31.0, 2), (2.0, 2), (0.0, -1), (0.0, -1)]
    assert p.overlap(t + 30 * MS, t + 45 * MS + MS // 2) == (0.0105, 2)


def test_summary_counts_pauses_per_generation_and_says_when_older_ones_were_dropped() -> None:
    """summary(since, until) counts the pauses that ended in the span per generation (count, seconds, max); once
    pauses of the span were dropped (past max_kept) it says complete=False. It never drains."""
    p = GcPauses(internal=InternalErrors(), max_kept=3)
    t = 1_000 * MS
    p.ring.extend([(t, t + 1 * MS, 0, 0), (t + 5 * MS, t + 8 * MS, 0, 0), (t + 10 * MS, t + 30 * MS, 2, 0)])
    p.drain()
    s = p.summary(t + 1 * MS, t + 30 * MS)  # (since, until]: the first pause ended at since
    assert s["complete"] is True
    assert s["generations"]["0"] == {"count": 1, "seconds": 0.003, "max_seconds": 0.003}
    assert s["generations"]["2"] == {"count": 1, "seconds": 0.02, "max_seconds": 0.02}
    assert s["generations"]["1"]["count"] == 0
    p.ring.append((t + 40 * MS, t + 41 * MS, 1, 0))  # one more: the oldest of the kept three goes
    assert p.summary(t - MS, t + 50 * MS)["generations"]["1"]["count"] == 0  # not drained yet: pure read
    p.drain()
    late = p.summary(t - MS, t + 50 * MS)
    assert late["complete"] is False and late["generations"]["0"]["count"] == 1
    assert p.summary(t + 2 * MS, t + 50 * MS)["complete"] is True


def test_overlap_stats_and_its_sentence_name_the_slowest_calls_and_their_generation() -> None:
    """Of 900 calls the 9 slowest are the top 1%: 5 overlapped a gen-2 pause and 2 a gen-0 one; the sentence says
    so; with no overlap, or no values, it says that."""
    values = [(0.001, -1)] * 880 + [(0.001, 0)] * 11 + [(0.05, 2)] * 5 + [(0.04, 0)] * 2 + [(0.03, -1)] * 2
    s = overlap_stats(values)
    assert (s["samples"], s["overlapped"], s["slowest"], s["slowest_overlapped"]) == (900, 18, 9, 7)
    assert s["slowest_overlapped_by_generation"] == {"2": 5, "0": 2} and s["slowest_generation"] == 2
    assert s["p99_overlapped_gc"] == pytest.approx(7 / 9)
    assert s["summary"] == ("gen-2 GC pauses overlapped 5 of the 9 slowest calls "
                            "(7 of them overlapped a pause of any generation)")
    assert overlap_stats([(0.01, 2)] * 7 + [(0.001, -1)] * 893)["summary"] == \
        "gen-2 GC pauses overlapped 7 of the 9 slowest calls"
    assert overlap_stats([(0.001, -1)] * 50)["summary"] == "no GC pause overlapped the slowest of 50 calls"
    assert overlap_stats([])["summary"] == "no calls in the window" and overlap_stats([])["p99_overlapped_gc"] is None


def test_regression_reason_gets_a_gc_entry_for_the_regressed_windows() -> None:
    """When the detector fires, the reason the capture policy logs (and arms the capture with) carries `gc`: the
    windows' pauses per generation and how many of their slowest steady samples overlapped one."""
    internal = InternalErrors()
    pauses = GcPauses(internal=internal)
    windows = Windows(60.0, 10_000)
    view = GcView(pauses, windows, window_seconds=60.0, max_samples=10_000)
    t = 10_000 * MS
    pauses.ring.extend([(t + i * 100 * MS, t + i * 100 * MS + 30 * MS, 2, 1000) for i in range(7)])
    marked = pauses.mark([_sample(t + i * 100 * MS + 31 * MS, 40.0) for i in range(7)]
                         + [_sample(t + 800 * MS + i * MS, 0.5) for i in range(891)]
                         + [_sample(t + 2_000 * MS, 35.0), _sample(t + 2_100 * MS, 33.0)])
    windows.add(marked)
    logged: list[dict[str, Any]] = []

    class Log:
        def warning(self, event: str, **kw: Any) -> None:
            logged.append(kw)

    class NoModels:
        def get(self, name: str) -> None:
            return None

    policy = CapturePolicy(RegressionPolicy(), models=NoModels(), captures=None, internal=internal,  # type: ignore[arg-type]
                           log=Log())
    policy.explainers.append(lambda model, stage, since, until: ("gc", view.regression(model, stage, since, until)))
    windows_stats = (WindowStats(t + 1_000 * MS, 450, {"p99": 0.04}, start_ns=t - MS),
                     WindowStats(t + 3_000 * MS, 450, {"p99": 0.04}, start_ns=t + 1_000 * MS))
    policy.fire([Regression("m", windows_stats, {"p50": 0.001, "p99": 0.002}, 1.5, ("p99",))])
    entry = logged[0]["gc"]
    assert entry["summary"] == "gen-2 GC pauses overlapped 7 of the 9 slowest calls"
    assert entry["pauses"]["generations"]["2"]["count"] == 7 and entry["samples"] == 900
    assert entry["pauses"]["generations"]["2"]["seconds"] == pytest.approx(0.21)
    assert dict(internal.counts()) == {}


def test_a_regression_spans_its_windows_from_the_first_ones_start() -> None:
    """The detector's Regression says when its regressed windows began and ended (what the gc entry is read over):
    two consecutive 1 s windows of a 2x step, the first starting where the healthy one before it ended."""
    import random

    from perfmon.captures.detector import Detector

    det = Detector(RegressionPolicy(window_seconds=1, ratio=1.5, min_samples=20, consecutive=2, baseline_windows=4),
                   seed=1)
    rng = random.Random(1)
    fired: list[Regression] = []
    for i in range(2000):  # 10 s at 0.01 s, then 10 s twice as slow
        fired += det.add("m", (0.010 if i < 1000 else 0.020) * rng.lognormvariate(0.0, 0.2), i * 10 * MS)
    assert len(fired) == 1
    start, end = fired[0].span_ns
    first, last = fired[0].windows
    assert start == first.start_ns and first.end_ns == last.start_ns and end == last.end_ns
    assert 9_900 * MS <= start < end <= 13_000 * MS and end - start >= 2_000 * MS


# -- the hook ---------------------------------------------------------------------------------------------


def test_install_is_idempotent_and_the_hook_is_in_gc_callbacks_once_for_two_rings() -> None:
    """Installing twice, or two GcPauses, puts one hook in gc.callbacks; it leaves with the last ring; a real
    collection reaches every installed ring."""
    before = _hooks()
    a, b = GcPauses(internal=InternalErrors()), GcPauses(internal=InternalErrors())
    try:
        a.install()
        a.install()
        b.install()
        assert _hooks() == 1 and a.installed and b.installed
        gc.collect(0)
        assert any(g == 0 for _, _, g, _ in a.ring) and any(g == 0 for _, _, g, _ in b.ring)
        a.uninstall()
        a.uninstall()
        assert _hooks() == 1 and not a.installed and b.installed
    finally:
        a.uninstall()
        b.uninstall()
    assert _hooks() == before  # gone unless another monitor of this process still runs


def test_a_thread_gc_clock_sums_the_collections_of_its_own_thread_only() -> None:
    """ThreadGc bound on a thread sums the full collections that run there, not young ones, not another thread's;
    binding puts the one hook in gc.callbacks with no ring installed, and it leaves with the last binding."""
    before = _hooks()
    clock = ThreadGc()
    bound, collected, done = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, float] = {}

    def owner() -> None:
        clock.bind()
        bound.set()
        try:
            assert collected.wait(30)
            seen["after_other"] = clock.seconds()
            gc.collect(0)
            gc.collect(1)
            seen["after_young"] = clock.seconds()  # young collections: the thread's own allocations, not summed
            gc.collect(2)
            seen["after_own"] = clock.seconds()
        finally:
            clock.unbind()
            done.set()

    t = threading.Thread(target=owner)
    t.start()
    try:
        assert bound.wait(30)
        assert _hooks() == 1
        gc.collect(2)  # on this thread: not the clock's
        collected.set()
        assert done.wait(30)
    finally:
        collected.set()
        t.join(30)
    assert seen["after_other"] == 0.0 and seen["after_young"] == 0.0
    assert seen["after_own"] > 0.0
    assert clock.seconds() == seen["after_own"]  # kept after unbind, and nothing added since
    gc.collect(0)
    assert clock.seconds() == seen["after_own"]
    assert _hooks() == before


def test_the_hook_never_raises_into_the_collector_and_its_fault_is_counted() -> None:
    """A ring that fails on append: the collection runs as ever, nothing reaches sys.unraisablehook, and the
    next drain counts the fault as internal_errors{stage="gc"}."""

    class Broken(collections.deque):  # type: ignore[type-arg]
        def append(self, item: Any) -> None:
            raise RuntimeError("ring is broken")

    internal = InternalErrors()
    p = GcPauses(internal=internal)
    p.ring = Broken()
    unraisable: list[Any] = []
    import sys

    old = sys.unraisablehook
    sys.unraisablehook = unraisable.append
    try:
        p.install()
        gc.collect(0)
        gc.collect(1)
    finally:
        p.uninstall()
        sys.unraisablehook = old
    assert unraisable == []
    p.drain()
    assert dict(internal.counts()).get("gc", 0) >= 2


# -- a monitor: must-show ---------------------------------------------------------------------------------


class HoldsTheGil(torch.nn.Module):
    """A tiny model; the call after ``hold`` is set runs it (a collection on another thread) and waits for it,
    so that call's interval contains the whole collection by construction."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.hold: Callable[[], None] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hold, self.hold = self.hold, None
        if hold is not None:
            hold()
        return self.lin(x)


def test_a_forced_gen2_collection_during_traffic_is_timed_and_marks_exactly_the_calls_it_overlapped(
        make_monitor, recorder) -> None:
    """A gen-2 collection of a large cyclic heap, on a side thread, while the serving thread calls a wrapped model
    (every call timed): the histogram holds a gen-2 pause of tens of ms inside the interval the side thread timed
    around gc.collect(); the call that overlapped it is marked gen-2 with at least that pause's seconds, counted,
    and /stats names gen-2 among the slowest calls; every marked call overlapped a collection the test recorded
    itself, so calls away from every pause stay unmarked."""
    mon = make_monitor(sample_rate=1.0).start()
    samples: list[Sample] = []
    mon.resolver.sinks.append(samples.extend)
    model = mon.wrap(HoldsTheGil(), name="tiny")
    heap = _cyclic_heap(500_000)
    go, done = threading.Event(), threading.Event()
    timed: list[int] = []

    def collector() -> None:
        if go.wait(60):
            timed.append(perf_counter_ns())
            gc.collect(2)
            timed.append(perf_counter_ns())
        done.set()

    side = threading.Thread(target=collector)
    side.start()

    def hold() -> None:
        go.set()
        assert done.wait(60)

    x = torch.randn(2, 8)
    try:
        for i in range(600):
            if i == 300:
                model.hold = hold
            model(x)
    finally:
        go.set()
        side.join(60)
        del heap
    assert mon.flush(timeout=10)
    t0, t1 = timed
    # The histogram: one gen-2 pause inside [t0, t1] of the right magnitude (the heap makes it tens of ms).
    inside = mon.gc_pauses.summary(t0, t1)["generations"]["2"]
    assert inside["count"] == 1
    pause = inside["seconds"]
    assert 0.005 < pause <= (t1 - t0) / 1e9
    assert mon.gc_pauses.overlap(t0, t1) == (pytest.approx(pause, abs=1e-9), 2)  # wholly inside [t0, t1]
    count = value(mon, "perfmon_gc_pause_seconds_count", generation="2")
    fast = value(mon, "perfmon_gc_pause_seconds_bucket", generation="2", le="0.005")
    assert count is not None and fast is not None and count - fast >= 1
    # The call that waited for it is marked gen-2, with at least the pause's seconds.
    held = [s for s in samples if s.end_ns - round(s.host_seconds * 1e9) <= t0 and s.end_ns >= t1]
    assert len(held) == 1 and held[0].gc_generation == 2 and held[0].gc_seconds >= pause
    assert (value(mon, "perfmon_samples_gc_overlap_total", model="tiny") or 0) >= 1
    stats = mon.stats()
    tiny = stats["models"]["tiny"]["gc"]
    assert tiny["overlapped_by_generation"].get("2", 0) >= 1 and tiny["slowest_generation"] == 2
    assert tiny["summary"].startswith("gen-2 GC pauses overlapped")
    assert stats["gc"]["generations"]["2"]["count"] >= 1
    # Every marked call overlapped a collection the test's own callback saw; most calls overlapped none.
    assert len(samples) >= 600

    def overlaps_recorded(s: Sample) -> int:
        start = s.end_ns - round(s.host_seconds * 1e9)
        return max((g for a, b, g in recorder if a < s.end_ns and b > start), default=-1)

    for s in samples:
        if s.gc_generation >= 0:
            assert overlaps_recorded(s) >= s.gc_generation, s
    clear = [s for s in samples if overlaps_recorded(s) < 0]
    assert len(clear) > len(samples) // 2 and all(s.gc_generation == -1 for s in clear)


def test_a_call_that_returns_while_another_threads_collection_is_still_open_is_marked(make_monitor) -> None:
    """A gc.callbacks entry ahead of perfmon's that waits at stop (another library's work there) hands the GIL to the
    serving thread before perfmon's hook records the pause: the call that waited for the collection returns and is
    resolved first. Found by a helper (16-20 of 20 such calls marked, with a callback spending 100 ms). The
    collection still open marks it, gen-2, from its start to the call's end."""
    opened, release = threading.Event(), threading.Event()
    side: list[int] = []

    def another_librarys(phase: str, info: dict[str, int]) -> None:
        if threading.get_ident() in side:
            if phase == "start":
                opened.set()
            else:
                release.wait(30)  # its work at stop: the GIL goes to the serving thread meanwhile

    gc.callbacks.insert(0, another_librarys)
    try:
        mon = make_monitor(sample_rate=1.0).start()
        samples: list[Sample] = []
        mon.resolver.sinks.append(samples.extend)
        model = mon.wrap(HoldsTheGil(), name="tiny")
        x = torch.randn(2, 8)
        for _ in range(5):
            model(x)
        assert mon.flush(timeout=10)
        before = value(mon, "perfmon_samples_gc_overlap_total", model="tiny") or 0

        def collect() -> None:
            side.append(threading.get_ident())
            gc.collect(2)

        thread = threading.Thread(target=collect)
        model.hold = lambda: thread.start() or opened.wait(30)
        try:
            seen = len(samples)
            model(x)
            assert mon.flush(timeout=10)
            assert len(samples) == seen + 1
            marked = samples[-1]
        finally:
            release.set()
            thread.join(30)
    finally:
        gc.callbacks.remove(another_librarys)
    assert marked.gc_generation == 2 and marked.gc_seconds > 0
    assert value(mon, "perfmon_samples_gc_overlap_total", model="tiny") == before + 1
    assert mon.flush(timeout=10)  # the collection, closed since, is one gen-2 pause on the record
    assert value(mon, "perfmon_gc_pause_seconds_count", generation="2") >= 1


def test_a_generation_request_whose_ttft_overlapped_a_gen2_pause_is_marked_in_stats(make_monitor) -> None:
    """A request whose first token came after a gen-2 collection: /stats' generation entry says its TTFT and the
    request overlapped a gen-2 pause; a request with none is not marked."""
    mon = make_monitor().start()
    with mon.generation("chat") as g:
        gc.collect(2)
        g.token()
    assert mon.flush()
    entry = mon.stats()["generation"]["chat"]["gc"]
    assert entry["time_to_first_token"]["overlapped_by_generation"] == {"2": 1}
    assert entry["time_to_first_token"]["slowest_generation"] == 2
    assert entry["requests"]["overlapped_by_generation"] == {"2": 1}


def test_two_monitors_each_time_every_pause_with_one_hook(make_monitor) -> None:
    """Two running monitors share one hook and both see a collection; stopping one leaves the other timing."""
    a, b = make_monitor().start(), make_monitor().start()
    assert _hooks() == 1
    gc.collect(2)
    a.flush()
    b.flush()
    for mon in (a, b):
        assert (value(mon, "perfmon_gc_pause_seconds_count", generation="2") or 0) >= 1
    a.stop()
    assert _hooks() == 1 and not a.gc_pauses.installed and b.gc_pauses.installed
    before = value(b, "perfmon_gc_pause_seconds_count", generation="1") or 0
    gc.collect(1)
    b.flush()
    assert (value(b, "perfmon_gc_pause_seconds_count", generation="1") or 0) == before + 1
    b.stop()
    assert not b.gc_pauses.installed


def test_gc_pauses_off_installs_nothing_and_exports_nothing(make_monitor) -> None:
    """gc_pauses=False: no hook, no GC families, no gc sections."""
    mon = make_monitor(gc_pauses=False).start()
    assert mon.gc_pauses is None
    gc.collect(0)
    assert mon.flush()
    assert value(mon, "perfmon_gc_pause_seconds_count", generation="0") is None
    assert mon.stats()["gc"] is None


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_starts_from_no_pause_and_times_its_own(make_monitor) -> None:
    """After os.fork() a running monitor's child has the hook once, none of the parent's pauses, and times its
    own collections."""
    mon = make_monitor().start()
    gc.collect(2)
    assert mon.flush()
    assert (value(mon, "perfmon_gc_pause_seconds_count", generation="2") or 0) >= 1
    def child_body() -> dict[str, Any]:
        fresh = value(mon, "perfmon_gc_pause_seconds_count", generation="2")
        gc.collect(2)
        mon.flush(timeout=5)
        result = {"fresh": fresh, "after": value(mon, "perfmon_gc_pause_seconds_count", generation="2"),
                  "hooks": _hooks(), "installed": mon.gc_pauses.installed}
        mon.stop()
        return result

    child = in_forked_child(child_body)
    assert child == {"fresh": 0.0, "after": 1.0, "hooks": 1, "installed": True}


def test_a_ring_overflowed_between_drains_is_warned_once_and_not_counted_as_a_fault() -> None:
    """More collections between two drains than the ring holds: the oldest are gone, and the drain says so, once
    (a warning about the workload, not a fault of perfmon's); a ring that never filled says nothing."""
    import io
    import json

    from perfmon.logs import make_logger

    internal, roomy_internal = InternalErrors(), InternalErrors()
    small, roomy = GcPauses(internal=internal, ring_size=4), GcPauses(internal=roomy_internal, ring_size=64)
    small.install()
    roomy.install()
    try:
        for _ in range(10):
            gc.collect(0)
        assert small.drain() == 4
        assert roomy.drain() >= 10
        for _ in range(10):
            gc.collect(0)
        assert small.drain() == 4
    finally:
        small.uninstall()
        roomy.uninstall()
    out = io.StringIO()
    internal.log_new(make_logger("json", "info", component="resolver", stream=out))
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(e["event"], e["level"], e["ring"]) for e in events] == [("gc_pauses_dropped", "warning", 4)]
    assert internal.total() == 0
    out = io.StringIO()
    roomy_internal.log_new(make_logger("json", "info", component="resolver", stream=out))
    assert out.getvalue() == ""
