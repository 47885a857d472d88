"""Explaining a regression like for like: top-level op tables, comparisons by size class or per unit of work,
a baseline capture per size class, and tail percentiles that a traffic mix shift does not move."""

from __future__ import annotations

import io
import json
import random
import time
from typing import Any

import pytest
import torch

from benchmarks.mix_shift import Net  # the model: three 256-wide layers, cdist when planted
from perfmon import RegressionPolicy
from perfmon.captures.compare import compare, compare_basis, headline
from perfmon.captures.detector import Detector
from perfmon.captures.export import latest_baseline
from perfmon.captures.trace_summary import STEP_ANNOTATION, summarise

from .conftest import wait_until

S = 1_000_000_000


def _x(cat: str, name: str, ts: float, dur: float, ext: int | None = None) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "pid": 1 if cat != "kernel" else 0, "tid": 1, "ts": ts,
            "dur": dur, "args": {} if ext is None else {"External id": ext}}


def _step(t0: float, *, cdist: bool, ext: int) -> list[dict[str, Any]]:
    """One recorded call: a Python frame (with_stack) holding linear > addmm and, when planted,
    cdist > _euclidean_dist > (mm, cat); each leaf launches a kernel."""
    ev = [_x("user_annotation", STEP_ANNOTATION, t0, 900, ext=ext),
          _x("python_function", "nn.Module: Net_0", t0 + 1, 890),
          _x("cpu_op", "aten::linear", t0 + 10, 200, ext=ext + 1),
          _x("cpu_op", "aten::addmm", t0 + 20, 150, ext=ext + 2),
          _x("kernel", "gemm", t0 + 30, 300, ext=ext + 2)]
    if cdist:
        ev += [_x("cpu_op", "aten::cdist", t0 + 300, 400, ext=ext + 3),
               _x("cpu_op", "aten::_euclidean_dist", t0 + 310, 380, ext=ext + 4),
               _x("cpu_op", "aten::mm", t0 + 320, 200, ext=ext + 5),
               _x("cpu_op", "aten::cat", t0 + 530, 100, ext=ext + 6),
               _x("kernel", "gemm", t0 + 400, 120, ext=ext + 5)]
    return ev


def test_trace_summary_top_level_ops_fold_in_their_children_and_break_down_one_level() -> None:
    """Under the step (and through Python frames) the ops the model's code called are the top level: each
    carries its whole subtree's time (host, or device from its kernels), and a breakdown of the self time
    of the ops inside it that sums to it."""
    ev = [e for i in range(4) for e in _step(i * 1000.0, cdist=True, ext=100 * i)]
    got = summarise(io.BytesIO(json.dumps({"traceEvents": ev}).encode()).read)
    top = got["top_ops"]
    assert set(top) == {"aten::linear", "aten::cdist"}  # not the Python frame, not mm or cat
    cdist = top["aten::cdist"]
    assert cdist["calls_per_step"] == 1 and cdist["seconds_per_step"] == pytest.approx(400e-6)
    assert cdist["breakdown"]["aten::mm"]["seconds_per_step"] == pytest.approx(200e-6)
    assert cdist["breakdown"]["aten::cat"]["seconds_per_step"] == pytest.approx(100e-6)
    assert sum(e["seconds_per_step"] for e in cdist["breakdown"].values()) == pytest.approx(400e-6)
    assert "aten::cdist" not in got["ops"] or got["ops"]["aten::cdist"]["seconds_per_step"] < 1e-4  # leaf: self only
    device = summarise(io.BytesIO(json.dumps({"traceEvents": ev}).encode()).read, device_time=True)["top_ops"]
    assert device["aten::cdist"]["seconds_per_step"] == pytest.approx(120e-6)  # its mm's kernel
    assert device["aten::linear"]["seconds_per_step"] == pytest.approx(300e-6)


def _meta(cid: str, *, cdist: bool, sizes: list[int], scale: float = 1.0) -> dict[str, Any]:
    """Capture metadata from a synthetic trace whose op times grow by ``scale``."""
    ev = []
    for i in range(len(sizes)):
        for e in _step(i * 1000.0 * scale, cdist=cdist, ext=100 * i):
            e["ts"] = i * 1000.0 * scale + (e["ts"] - i * 1000.0) * scale
            e["dur"] *= scale
            ev.append(e)
    got = summarise(io.BytesIO(json.dumps({"traceEvents": ev}).encode()).read)
    return {"id": cid, "device": "cpu", "ops": got["ops"], "top_ops": got["top_ops"], "steps": got["steps"],
            "step_sizes": sizes}


def test_the_op_the_model_added_ranks_first_not_its_children() -> None:
    """Per op name, an added cdist shows as new mm and cat (its children); at the user's level it is one new
    cdist, first, with its breakdown one level down; the headline names it."""
    got = compare(_meta("b", cdist=False, sizes=[200] * 5), _meta("a", cdist=True, sizes=[210] * 5))
    assert got["basis"]["level"] == "top" and got["basis"]["sizes"] == "same_size_class"
    first = got["ops"][0]
    assert (first["op"], first["status"]) == ("aten::cdist", "new")
    assert {r["op"] for r in first["breakdown"] if r["status"] == "new"} >= {"aten::mm", "aten::cat"}
    assert got["leaf_ops"][0]["op"] != "aten::cdist"  # the leaf diff would have named a child
    assert headline(got)["op"] == "aten::cdist" and got["summary"].startswith("new aten::cdist adds")


def test_captures_of_different_sizes_are_compared_per_unit_of_work_and_say_so() -> None:
    """A baseline at batch 4-7 vs a capture at 128-255 whose ops cost the same per item (32x the time for 32x
    the work): normalised per unit of work nothing moved but the added op; the summary says so. With no sizes
    the basis is unknown."""
    before = _meta("b", cdist=False, sizes=[6] * 5)
    after = _meta("a", cdist=True, sizes=[192] * 5, scale=32.0)
    basis = compare_basis(before, after)
    assert basis["sizes"] == "normalised" and basis["scale"] == pytest.approx(32.0)
    assert (basis["size_class_before"], basis["size_class_after"]) == ("4-7", "128-255")
    got = compare(before, after)
    assert [(r["op"], r["status"]) for r in got["ops"]] == [("aten::cdist", "new"), ("aten::linear", "same")]
    assert got["summary"].startswith("per unit of work (baseline at size 4-7, this capture at 128-255")
    plain = compare({**before, "step_sizes": []}, after)
    linear = next(r for r in plain["ops"] if r["op"] == "aten::linear")
    assert plain["basis"]["sizes"] == "unknown" and linear["status"] == "slower"  # per call: 32x "slower"
    assert linear["ratio"] == pytest.approx(32.0)


class _Store:
    """The trace store's listing (newest first), as ``latest_baseline`` reads it."""

    def __init__(self, metas: list[dict[str, Any]]) -> None:
        self.metas = metas

    def list(self) -> list[dict[str, Any]]:
        return self.metas


def test_a_capture_is_compared_with_the_baseline_of_its_size_class_else_the_nearest() -> None:
    """Same size class first (even when older), else the nearest in work per call, else the newest."""
    def base(cid: str, size: int) -> dict[str, Any]:
        return {"id": cid, "model": "m", "trigger": "baseline", "outcome": "ok", "ops": {"x": {}}, "steps": 4,
                "step_sizes": [size] * 5}

    store = _Store([base("new-small", 5), base("mid", 40), base("old-large", 200)])
    assert latest_baseline(store, "m", like=base("c", 180))["id"] == "old-large"  # type: ignore[arg-type]
    assert latest_baseline(store, "m", like=base("c", 1000))["id"] == "old-large"  # type: ignore[arg-type]
    assert latest_baseline(store, "m", like=base("c", 20))["id"] == "mid"  # type: ignore[arg-type]
    assert latest_baseline(store, "m", like={"steps": 4})["id"] == "new-small"  # type: ignore[arg-type]
    assert latest_baseline(store, "m", size_class="128-255")["id"] == "old-large"  # type: ignore[arg-type]
    assert latest_baseline(store, "m", size_class="8-15") is None  # type: ignore[arg-type]


# -- the detector: a mix shift moves the tail, not the model -------------------------------------------------

POLICY = RegressionPolicy(window_seconds=1, ratio=1.5, min_samples=20, consecutive=2, baseline_windows=3)


def _traffic(det: Detector, rng: random.Random, seconds: float, start_s: float, batch: tuple[int, int], *,
             per_item: float = 5e-6, stall_hz: float = 12.0, tail: float = 0.0) -> list:
    """200 sampled calls a second of 1 ms + ``per_item`` a row. Stalls from outside the model (a preempted
    thread: 5 ms) arrive at ``stall_hz``, so they hit a call with a probability that grows with its length;
    ``tail`` is the share of calls the model itself makes 4x slower."""
    fired = []
    for i in range(int(seconds * 200)):
        t = start_s + i / 200
        size = rng.randint(*batch) * 256
        seconds_ = (5e-5 + per_item * size / 256) * rng.lognormvariate(0.0, 0.05)
        if rng.random() < stall_hz * seconds_:
            seconds_ += 0.005
        if rng.random() < tail:
            seconds_ *= 4
        fired += det.add("m", seconds_, int(t * S), size)
    return fired + det.tick(int((start_s + seconds) * S))


@pytest.mark.parametrize("seed", range(6))
def test_a_mix_shift_does_not_fire_on_stalls_that_hit_longer_calls_more(seed: int) -> None:
    """Batches 4-8 to 128-256 at the same cost per item, with outside stalls at a steady rate: they hit
    ~0.1% of the small calls and ~1.3% of the large, so the pooled p99 ratio jumps ~5x. Judged against
    the small mix's tail it fired; against windows of its own dominant class, and needing 5 calls beyond
    the limit, it does not. p50 still judges the new class from its first windows."""
    rng = random.Random(seed)
    det = Detector(POLICY, seed=seed)
    assert _traffic(det, rng, 10, 0, (4, 8)) == []
    assert _traffic(det, rng, 60, 10, (128, 256)) == []
    last = next(view for view in det.views())[1]
    assert last is not None and last.ratios is not None


def test_a_tail_that_really_moves_still_fires_and_a_p50_step_fires_on_the_new_mix() -> None:
    """After the shift is learned, 5% of calls 4x slower fires on p99 (stalls rarer than 1%: above 1% they
    are the p99, and a 4x tail under 6x stalls moves no p99); separately a 2x step fires on p50."""
    rng = random.Random(1)
    det = Detector(POLICY, seed=1)
    _traffic(det, rng, 10, 0, (4, 8), stall_hz=2)
    assert _traffic(det, rng, 10, 10, (128, 256), stall_hz=2) == []
    fired = _traffic(det, rng, 6, 20, (128, 256), stall_hz=2, tail=0.05)
    assert len(fired) == 1 and "p99" in fired[0].exceeded and "p50" not in fired[0].exceeded
    det2 = Detector(POLICY, seed=2)
    _traffic(det2, rng, 10, 0, (4, 8))
    assert _traffic(det2, rng, 10, 10, (128, 256)) == []
    fired = _traffic(det2, rng, 6, 20, (128, 256), per_item=10e-6)
    assert len(fired) == 1 and "p50" in fired[0].exceeded


def test_two_stalled_calls_in_a_window_are_not_a_tail_regression() -> None:
    """A learned mix whose windows hold 200 samples: two calls 10x slower in each of two windows make the
    window's p99 ~10x its baseline, and still fire nothing (5 calls beyond the limit are needed); six fire."""
    for stalled, want in ((2, 0), (6, 1)):
        det = Detector(POLICY, seed=3)
        rng = random.Random(3)
        assert _traffic(det, rng, 10, 0, (64, 64), stall_hz=0) == []
        fired: list = []
        for w in range(2):
            for i in range(200):
                t = 10 + w + i / 200
                seconds_ = 5e-5 + 5e-6 * 64
                fired += det.add("m", seconds_ * (10 if i < stalled else 1), int(t * S), 64 * 256)
        fired += det.tick(12 * S)
        assert len(fired) == want, stalled


# -- end to end: the scenario on a real model, profiler and monitor -------------------------------------

@pytest.mark.parametrize("seed", range(2))
def test_mix_shift_then_a_planted_op_captures_once_and_names_the_op_against_a_same_size_baseline(
        make_monitor, seed: int) -> None:
    """The issue's scenario: batches 4-8, then 128-256 at the same cost per item (no regression capture; a
    second baseline capture at the new size), then the model gains a cdist: one regression capture, compared
    with the baseline of its own size class, that ranks aten::cdist first."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    # Three windows over x1.5 in a row: two 1 s windows of a shared 2-core host's noise once fired a capture in the
    # "nothing fires" phase below (a fresh clone's full run, session 30); the planted cdist moves every window.
    policy = RegressionPolicy(window_seconds=1, ratio=1.5, min_samples=20, consecutive=3, baseline_windows=3,
                              capture_steps=5)
    mon = make_monitor(sample_rate=0.2, warmup_calls=1, regression=policy)
    mon.policy.baseline_check_seconds = 0.0
    mon.start()
    net = Net()
    model = mon.wrap(net, name="m")
    xs = {b: torch.randn(b, 256) for b in [*range(4, 9), *range(128, 257)]}
    small, large = list(range(4, 9)), list(range(128, 257))

    def drive(sizes: list[int]):
        def call() -> None:
            with torch.no_grad():
                for _ in range(20):
                    model(xs[rng.choice(sizes)])
        return call

    def baselines() -> dict[str, str]:
        return {str(p["reason"].get("size_class")): p["id"] for p in mon.profiles()
                if p["trigger"] == "baseline" and p.get("outcome") == "ok"}

    wait_until(lambda: baselines(), timeout=60, what="a baseline capture at batches 4-8", between=drive(small))
    wait_until(lambda: "32768-65535" in baselines(), timeout=90, what="a baseline capture at batches 128-255",
               between=drive(large))
    end = time.monotonic() + 6  # several more windows of the new mix: nothing fires
    while time.monotonic() < end:
        drive(large)()
    mon.flush()
    assert [p for p in mon.profiles() if p["trigger"] == "regression"] == []
    net.extra = True
    try:
        cap = wait_until(lambda: next((p for p in mon.profiles() if p["trigger"] == "regression"
                                       and p.get("status") == "done"), None),
                         timeout=90, what="a regression capture", between=drive(large))
    except AssertionError as exc:  # once on a fresh clone's run (session 37): say where it stood
        seen = [(p["trigger"], p.get("status"), p.get("outcome"), p.get("error")) for p in mon.profiles()]
        regression = mon.stats()["models"].get("m", {}).get("regression")
        raise AssertionError(f"{exc}; captures {seen}; the model's regression state {regression}") from exc
    meta = mon.profile(cap["id"])
    assert meta is not None and meta["outcome"] == "ok"
    comparison = meta["comparison"]
    assert comparison["baseline"] == baselines()["32768-65535"]
    assert comparison["basis"]["sizes"] == "same_size_class" and comparison["basis"]["level"] == "top"
    assert (comparison["ops"][0]["op"], comparison["ops"][0]["status"]) == ("aten::cdist", "new")
    assert "aten::cdist" in comparison["summary"].split(";")[0]
    moved = meta["reason"]["moved"]  # what moved: the size part and the ops part, from the capture's own reason
    assert moved["ops"]["op"] == "aten::cdist" and moved["size"]["dominant_during"] == "32768-65535"


# -- what moved ------------------------------------------------------------------------------------------------

def test_what_moved_puts_size_gc_queue_host_device_and_ops_side_by_side() -> None:
    """From a regression's entries: the mix moved, the slowest calls overlapped a gen-2 pause, the queue grew,
    the device time (not the host's) moved; the ops part is added once compared. Host-timed models say host."""
    from perfmon.captures.moved import add_ops, host_device, queue_moved, summarise

    hd = host_device([(1e-3, 2e-4)] * 10, [(2e-3, 2.1e-4)] * 10, device_clock=True)
    assert hd is not None and hd["moved"] == "device" and hd["device_ratio"] == pytest.approx(2.0)
    cpu = host_device([(1e-3, 1e-3)] * 10, [(2e-3, 2e-3)] * 10, device_clock=False)
    assert cpu is not None and cpu["moved"] == "host" and "device_ratio" not in cpu
    assert host_device([], [(1e-3, 1e-3)], device_clock=False) is None
    part = {"count": 10, "p50_seconds": 0.0}
    queue = queue_moved({"queue": {**part, "p50_seconds": 0.002}, "total": {**part, "p50_seconds": 0.01}},
                        {"queue": {**part, "p50_seconds": 0.02}, "total": {**part, "p50_seconds": 0.03}})
    assert queue is not None and queue["moved"] and "queued 20.0 ms" in queue["summary"]
    assert queue_moved({}, {"total": {"count": 0}}) is None
    details = {"classes": {"32768-65535": {"samples": 90}, "1024-2047": {"samples": 3}},
               "size_classes": ["32768-65535"], "host_device": hd, "queue": queue,
               "gc": {"p99_overlapped_gc": 1.0, "summary": "gen-2 GC pauses overlapped 2 of the 2 slowest calls"}}
    moved = summarise(details, before_classes={"1024-2047": {"samples": 80}})
    assert moved["size"]["mix_moved"] and moved["size"]["dominant_before"] == "1024-2047"
    for words in ("traffic moved from size 1024-2047 to 32768-65535", "gen-2 GC pauses overlapped",
                  "requests queued", "device time 2.00x, host time not"):
        assert words in moved["summary"]
    add_ops(moved, {"baseline": "b", "basis": {"sizes": "same_size_class"}},
            {"op": "aten::cdist", "status": "new", "added_seconds_per_call": 1e-3})
    assert moved["ops"]["op"] == "aten::cdist" and moved["summary"].endswith("ops: new aten::cdist")
    quiet = summarise({"classes": {"4-7": {"samples": 5}}}, before_classes={"4-7": {"samples": 5}})
    assert quiet["summary"] == "nothing outside the model's ops moved"
