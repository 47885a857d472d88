"""The regression detector on synthetic sample streams (simulated clock, no threads)."""

from __future__ import annotations

import random
import time
from typing import Any

import pytest

import perfmon
from perfmon.captures.detector import Detector, RegressionPolicy

from .conftest import HandClock

S = 1_000_000_000  # ns per second


def feed(det: Detector, model: str, seconds_of_traffic: float, rate_hz: float, latency, start_s: float,
         rng: random.Random) -> list:
    """Feed ``rate_hz`` samples per second for ``seconds_of_traffic``; returns what fired."""
    fired = []
    n = int(seconds_of_traffic * rate_hz)
    for i in range(n):
        t = start_s + i / rate_hz
        fired += det.add(model, latency(rng), int(t * S))
    fired += det.tick(int((start_s + seconds_of_traffic) * S))
    return fired


def lognormal(median: float, sigma: float = 0.2):
    return lambda rng: median * rng.lognormvariate(0.0, sigma)


POLICY = RegressionPolicy(window_seconds=1, ratio=1.5, min_samples=20, consecutive=2, baseline_windows=4)


def test_fires_once_on_a_2x_step_within_the_configured_windows() -> None:
    """A 2x latency step fires exactly once, after `consecutive` regressed windows, with its figures."""
    det = Detector(POLICY, seed=1)
    rng = random.Random(1)
    assert feed(det, "m", 10, 100, lognormal(0.010), 0, rng) == []
    fired = feed(det, "m", 10, 100, lognormal(0.020), 10, rng)
    assert len(fired) == 1
    r = fired[0]
    assert r.model == "m" and len(r.windows) == 2 and set(r.exceeded) <= {"p50", "p99"}
    assert r.windows[-1].end_ns <= 12 * S  # caught within two windows of the step
    d = r.as_dict()
    assert d["observed_ratio"][r.exceeded[0]] > 1.5 and d["baseline_seconds"]["p50"] == pytest.approx(0.010, rel=0.1)
    # still regressed: no second firing; back to normal ends it; a new step fires again
    assert feed(det, "m", 5, 100, lognormal(0.010), 20, rng) == []
    assert [v[3] for v in det.views()] == [False]
    assert len(feed(det, "m", 5, 100, lognormal(0.030), 25, rng)) == 1


@pytest.mark.parametrize("seed", range(5))
def test_never_fires_on_stationary_lognormal_noise(seed: int) -> None:
    """Ten minutes of stationary lognormal noise (sigma 0.2) never fire, whatever the seed."""
    det = Detector(POLICY, seed=seed)
    assert feed(det, "m", 600, 50, lognormal(0.005, 0.2), 0, random.Random(seed)) == []


def test_needs_min_samples_and_a_learned_baseline() -> None:
    """Too few samples per window, or a baseline still learning, never fire."""
    det = Detector(POLICY, seed=0)
    rng = random.Random(0)
    # 2 samples/s: even a window stretched to its maximum (6 x 1 s) holds 12 < min_samples
    assert feed(det, "m", 60, 2, lognormal(0.010), 0, rng) == []
    assert det.baseline("m") is None
    det2 = Detector(POLICY, seed=0)
    assert feed(det2, "m", 3, 100, lognormal(0.010), 0, rng) == []  # 3 windows < baseline_windows
    assert feed(det2, "m", 1, 100, lognormal(0.040), 3, rng) == []  # still learning: never armed
    assert det2.baseline("m") is not None


def test_regressed_windows_do_not_poison_the_baseline() -> None:
    """During a long regression the baseline stays at the healthy level."""
    det = Detector(POLICY, seed=2)
    rng = random.Random(2)
    feed(det, "m", 8, 100, lognormal(0.010), 0, rng)
    before = det.baseline("m")
    feed(det, "m", 30, 100, lognormal(0.030), 8, rng)
    assert det.baseline("m") == before


def test_gap_in_traffic_breaks_a_streak() -> None:
    """One regressed window, silence, one regressed window: not consecutive, no firing."""
    det = Detector(POLICY, seed=3)
    rng = random.Random(3)
    feed(det, "m", 8, 100, lognormal(0.010), 0, rng)
    assert feed(det, "m", 1, 100, lognormal(0.030), 8, rng) == []
    assert feed(det, "m", 1, 100, lognormal(0.030), 15, rng) == []


def test_an_active_regression_ends_when_the_model_gets_no_calls_but_not_on_a_few() -> None:
    """A regressed model whose traffic goes (dropped for a new version) stops being active after
    IDLE_WINDOWS_TO_END windows without a call; windows with a few calls (under min_samples) keep it active."""
    from perfmon.captures.detector import IDLE_WINDOWS_TO_END, MAX_WINDOW_FACTOR

    det = Detector(POLICY, seed=4)
    rng = random.Random(4)
    feed(det, "m", 8, 100, lognormal(0.010), 0, rng)
    assert len(feed(det, "m", 2, 100, lognormal(0.030), 8, rng)) == 1

    def active() -> bool:
        return next(a for model, _, _, a, _ in det.views() if model == "m")

    longest = MAX_WINDOW_FACTOR * POLICY.window_seconds  # an empty window closes after this long
    t = 10.0
    for _ in range(IDLE_WINDOWS_TO_END + 2):  # a trickle: 3 calls a window, too few to judge
        feed(det, "m", longest, 3 / longest, lognormal(0.030), t, rng)
        t += longest
    assert active()
    for i in range(IDLE_WINDOWS_TO_END):
        assert active(), i
        t += longest + 0.01
        det.tick(int(t * S))
    assert not active()


def test_models_are_independent() -> None:
    """A regression of one model does not fire for another."""
    det = Detector(POLICY, seed=4)
    rng = random.Random(4)
    feed(det, "a", 8, 100, lognormal(0.010), 0, rng)
    feed(det, "b", 8, 100, lognormal(0.010), 0, rng)
    fired = feed(det, "a", 4, 100, lognormal(0.030), 8, rng) + feed(det, "b", 4, 100, lognormal(0.010), 8, rng)
    assert [r.model for r in fired] == ["a"]


@pytest.mark.parametrize(
    "kw", [{"ratio": 1.0}, {"window_seconds": 0}, {"min_samples": 0}, {"quantiles": ("p42",)},
           {"capture_steps": 101}, {"consecutive": True}])
def test_policy_validation(kw: dict) -> None:
    """Nonsense policies raise ConfigError; short windows such as 1 s are accepted."""
    with pytest.raises(perfmon.ConfigError):
        RegressionPolicy(**kw)
    assert RegressionPolicy(window_seconds=1).window_seconds == 1


class _State:
    """The parts of a ModelState the controller touches."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.device = "cpu"
        self.capture = None
        self.next_index = 10

    def members(self) -> list:
        return [self]  # one stage: the model itself


def test_automatic_captures_respect_cooldown_and_hourly_cap(tmp_path) -> None:
    """Within the cooldown a second automatic capture is suppressed; past it, the hourly cap applies."""
    from perfmon.captures.controller import CaptureController
    from perfmon.captures.records import CaptureOptions
    from perfmon.faults import InternalErrors
    from perfmon.store.traces import TraceStore

    clock = HandClock()
    ctl = CaptureController(TraceStore(tmp_path, max_files=5, max_bytes=10**9), internal=InternalErrors(),
                            cooldown_seconds=600, max_auto_per_hour=2, arm_timeout_seconds=1, clock=clock)
    st = _State("m")
    opts = CaptureOptions(steps=1)
    assert ctl.auto(st, opts, {}) is not None and st.capture is ctl and st.next_index == 0
    clock.t += 2
    ctl.tick()  # armed with no call: expires, slot free again
    assert ctl.state == "idle" and st.capture is None
    assert ctl.auto(st, opts, {}) is None and ctl.counts.suppressed["cooldown"] == 1
    clock.t += 601
    assert ctl.auto(st, opts, {}) is not None
    clock.t += 2
    ctl.tick()
    clock.t += 601
    assert ctl.auto(st, opts, {}) is None and ctl.counts.suppressed["rate_limit"] == 1  # 2 in the last hour
    clock.t += 3600
    assert ctl.auto(st, opts, {}) is not None
    assert ctl.auto(st, opts, {}) is None and ctl.counts.suppressed["busy"] == 1  # one capture at a time


def test_heavy_automatic_capture_options_warn() -> None:
    """Enabling with_stack or profile_memory for automatic captures warns."""
    with pytest.warns(UserWarning, match="heavier"):
        RegressionPolicy(capture_profile_memory=True)


def test_quiet_models_are_judged_on_longer_windows() -> None:
    """At 10 samples/s with min_samples 20 a window stretches to ~2 s and a step still fires."""
    det = Detector(POLICY, seed=5)
    rng = random.Random(5)
    assert feed(det, "m", 12, 10, lognormal(0.010), 0, rng) == []
    assert det.baseline("m") is not None
    fired = feed(det, "m", 10, 10, lognormal(0.030), 12, rng)
    assert len(fired) == 1 and all(w.count >= 20 for w in fired[0].windows)


def test_p99_is_judged_only_with_enough_samples() -> None:
    """With fewer than 100 samples per window a p99-only policy never fires (p99 would be the max)."""
    policy = RegressionPolicy(window_seconds=1, min_samples=20, baseline_windows=2, quantiles=("p99",))
    det = Detector(policy, seed=6)
    rng = random.Random(6)
    feed(det, "m", 5, 50, lognormal(0.010), 0, rng)
    assert feed(det, "m", 5, 50, lognormal(0.030), 5, rng) == []
    det2 = Detector(policy, seed=6)
    feed(det2, "m", 5, 200, lognormal(0.010), 0, rng)
    assert len(feed(det2, "m", 5, 200, lognormal(0.030), 5, rng)) == 1


# -- like with like: size classes ------------------------------------------------------------------

def feed_sized(det: Detector, model: str, seconds_of_traffic: float, rate_hz: float, latency, sizes,
               start_s: float, rng: random.Random, *, with_sizes: bool = True) -> list:
    """Like ``feed``, each sample with a size drawn by ``sizes(rng, t)`` and a latency ``latency(rng, size)``."""
    fired = []
    for i in range(int(seconds_of_traffic * rate_hz)):
        t = start_s + i / rate_hz
        size = sizes(rng, t)
        fired += det.add(model, latency(rng, size), int(t * S), size if with_sizes else None)
    fired += det.tick(int((start_s + seconds_of_traffic) * S))
    return fired


def per_item(overhead: float, each: float, *, slow: float = 1.0, slow_sizes: range | None = None, noise=None):
    """Latency with a fixed part and a per-item part (seconds); ``slow`` times slower for ``slow_sizes``."""
    noise = noise or (lambda rng: rng.lognormvariate(0.0, 0.2))

    def latency(rng: random.Random, size: int) -> float:
        factor = slow if slow_sizes is None or size in slow_sizes else 1.0
        return (overhead + each * size) * factor * noise(rng)

    return latency


def batches(*choices: int):
    return lambda rng, t: rng.choice(choices)


@pytest.mark.parametrize("before, after", [((4, 5, 6, 8), (128, 160, 200, 256)),  # small -> large batches
                                           ((16, 24, 48, 64), (512, 1024, 1500, 2048))])  # short -> long prompts
def test_a_traffic_mix_shift_with_unchanged_per_item_cost_never_fires(before, after) -> None:
    """Batches 4-8 -> 128-256 (or prompts of 16-64 -> 512-2048 tokens) at the same cost per item: no firing.
    Judged without sizes (one class, as before size classes), the same traffic fires."""
    latency = per_item(0.002, 0.0005)
    for with_sizes, want in ((True, 0), (False, 1)):
        det = Detector(POLICY, seed=7)
        rng = random.Random(7)
        assert feed_sized(det, "m", 20, 100, latency, batches(*before), 0, rng, with_sizes=with_sizes) == []
        fired = feed_sized(det, "m", 60, 100, latency, batches(*after), 20, rng, with_sizes=with_sizes)
        assert len(fired) == want, (with_sizes, fired)
    assert det.baseline("m") is not None


def test_a_2x_per_item_slowdown_at_an_unchanged_mix_fires_within_two_windows() -> None:
    """Every class twice as slow: fires after `consecutive` windows, as the single-class detector does."""
    det = Detector(POLICY, seed=8)
    rng = random.Random(8)
    mix = batches(4, 16, 64, 256)
    assert feed_sized(det, "m", 20, 100, per_item(0.002, 0.0005), mix, 0, rng) == []
    fired = feed_sized(det, "m", 10, 100, per_item(0.002, 0.0005, slow=2.0), mix, 20, rng)
    assert len(fired) == 1 and fired[0].windows[-1].end_ns <= 22 * S
    d = fired[0].as_dict()
    assert set(d["size_classes"]) <= {"4-7", "16-31", "64-127", "256-511"} and d["size_classes"]
    assert d["observed_ratio"]["p50"] > 1.5


def test_a_slowdown_confined_to_one_size_class_fires_and_names_it() -> None:
    """Batch 64 only (a quarter of traffic) twice as slow: the pooled p50 barely moves, the class fires
    under its own name, in the Regression and in the detector's per-class view."""
    det = Detector(POLICY, seed=9)
    rng = random.Random(9)
    mix = batches(4, 16, 64, 256)
    assert feed_sized(det, "m", 20, 100, per_item(0.002, 0.0005), mix, 0, rng) == []
    fired = feed_sized(det, "m", 10, 100, per_item(0.002, 0.0005, slow=2.0, slow_sizes=range(64, 65)), mix, 20, rng)
    assert len(fired) == 1
    assert fired[0].size_classes == ("64-127",)
    assert fired[0].windows[-1].classes["64-127"]["ratio_p50"] > 1.5
    assert det.classes("m") == {"4-7": False, "16-31": False, "64-127": True, "256-511": False}


@pytest.mark.parametrize("seed", range(4))
def test_ten_minutes_of_20pct_noise_with_a_drifting_mix_never_fire(seed: int) -> None:
    """±20% uniform noise, the batch mix drifting from 1-8 to 64-512 and back over ten minutes (classes
    appear, vanish and return): zero firings."""
    import math

    def drifting(rng: random.Random, t: float) -> int:
        centre = 3 + 6 * (0.5 - 0.5 * math.cos(2 * math.pi * t / 600))  # log2 of the batch: 3 -> 9 -> 3
        return max(1, int(2 ** rng.gauss(centre, 1.0)))

    det = Detector(POLICY, seed=seed)
    latency = per_item(0.002, 0.0002, noise=lambda rng: rng.uniform(0.8, 1.2))
    assert feed_sized(det, "m", 600, 100, latency, drifting, 0, random.Random(seed)) == []
    assert len(det.classes("m")) >= 6


def test_a_learned_baseline_takes_one_baseline_capture_that_later_captures_compare_with(make_monitor) -> None:
    """Once a model's baseline is learned, the monitor takes one short `baseline` capture by itself (not
    again while it is younger than its max age, even looked up at every tick); a manual capture then
    carries a comparison with it."""
    import torch

    from .conftest import wait_capture, wait_until

    policy = RegressionPolicy(window_seconds=0.2, min_samples=5, baseline_windows=2, capture_steps=3)
    mon = make_monitor(sample_rate=1.0, warmup_calls=1, regression=policy)
    mon.policy.baseline_check_seconds = 0.0
    mon.start()
    model = mon.wrap(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)),
                     name="mlp")
    x = torch.randn(4, 32)
    base = wait_until(lambda: mon.captures.latest_baseline("mlp"), timeout=60, what="a baseline capture",
                      between=lambda: model(x))
    assert base["trigger"] == "baseline" and base["outcome"] == "ok" and base["reason"]["baseline_seconds"]
    t_end = time.monotonic() + 1.5
    while time.monotonic() < t_end:  # several more windows close: no second one while the first is young
        model(x)
    mon.flush()
    assert [p["trigger"] for p in mon.profiles()].count("baseline") == 1
    wait_until(lambda: mon.captures.state == "idle", timeout=30, what="the baseline capture's export to end")
    cap = mon.capture("mlp", steps=3)
    meta = wait_capture(mon, cap["id"], drive=lambda: model(x))
    assert meta["outcome"] == "ok" and meta["comparison"]["baseline"] == base["id"]


def test_no_baseline_capture_when_switched_off(make_monitor) -> None:
    """``baseline_capture=False``: the baseline is learned and no capture is taken."""
    import torch

    from .conftest import wait_until

    policy = RegressionPolicy(window_seconds=0.2, min_samples=5, baseline_windows=2, baseline_capture=False)
    mon = make_monitor(sample_rate=1.0, warmup_calls=1, regression=policy).start()
    model = mon.wrap(torch.nn.Linear(8, 8), name="lin")
    wait_until(lambda: mon.detector.baseline("lin"), timeout=30, what="a learned baseline",
               between=lambda: model(torch.randn(2, 8)))
    for _ in range(20):
        model(torch.randn(2, 8))
    mon.flush()
    mon.policy.tick(time.perf_counter_ns())
    assert mon.captures.state == "idle" and mon.profiles() == []


def test_a_baseline_capture_older_than_its_max_age_is_taken_again(make_monitor) -> None:
    """`baseline_capture_max_age_seconds`: once the latest baseline capture is older, a new one is taken
    (the store is looked up every `policy.baseline_check_seconds`; zero here so the test need not wait 30 s)."""
    import torch

    from .conftest import wait_until

    # A ratio no noise reaches: a regression blocks baseline captures (only a healthy model gets one), and
    # 0.2 s windows of a 16x16 Linear on a loaded 2-core CI box once fired one. Regressions are not the point.
    policy = RegressionPolicy(window_seconds=0.2, min_samples=5, baseline_windows=2, capture_steps=2,
                              baseline_capture_max_age_seconds=0.5, ratio=1000.0)
    mon = make_monitor(sample_rate=1.0, warmup_calls=1, regression=policy)
    mon.policy.baseline_check_seconds = 0.0
    mon.start()
    model = mon.wrap(torch.nn.Linear(16, 16), name="lin")
    x = torch.randn(4, 16)

    def baselines() -> list[str]:
        return [p["id"] for p in mon.profiles() if p["trigger"] == "baseline" and p.get("outcome") == "ok"]

    try:
        wait_until(lambda: len(baselines()) >= 2, timeout=60, what="a second baseline capture",
                   between=lambda: model(x))
    except AssertionError as exc:  # say why: what was captured, what was suppressed, what the detector saw
        seen = [(p["trigger"], p.get("outcome"), p.get("ended_at")) for p in mon.profiles()]
        raise AssertionError(f"{exc}; captures {seen}; suppressed {dict(mon.captures.counts.suppressed)}; "
                             f"detector {list(mon.detector.views())}") from None
    first, second = sorted(mon.profile(i)["ended_at"] for i in baselines()[:2])
    assert first < second


def _three_healthy_windows_then_a_slow_one(det: Detector, t0: int) -> list:
    """Ten 1 ms calls in each of three 1 s windows (the baseline), then ten 4 ms ones: the one regression fired."""
    fired: list = []
    for w, latency in enumerate((0.001, 0.001, 0.001, 0.004)):
        for i in range(10):
            fired += det.add("m", latency, t0 + w * S + i * 1_000_000)
    fired += det.tick(t0 + 4 * S)
    assert len(fired) == 1
    return fired


def test_a_regression_that_finds_the_capture_slot_busy_is_captured_when_it_frees(make_monitor) -> None:
    """The detector fires once per regression: if another capture (a baseline, a manual one) holds the
    profiler then, the regression capture is kept and armed as soon as the slot is free."""
    import torch

    from .conftest import wait_until

    policy = RegressionPolicy(window_seconds=1, min_samples=5, baseline_windows=2, consecutive=1,
                              baseline_capture=False)
    mon = make_monitor(regression=policy)
    model = mon.wrap(torch.nn.Linear(4, 4), name="m")
    manual = mon.capture("m", steps=1)  # holds the slot until the model's next call
    det, t0 = mon.detector, time.perf_counter_ns()
    fired = _three_healthy_windows_then_a_slow_one(det, t0)
    mon.policy.fire(fired)
    assert mon.captures.counts.suppressed["busy"] == 1 and "m" in mon.policy.deferred
    model(torch.randn(1, 4))  # the manual capture records its step and exports
    wait_until(lambda: mon.captures.state == "idle", timeout=30, what="the manual capture to finish")
    mon.policy.tick(time.perf_counter_ns())
    assert mon.captures.current is not None and mon.captures.current.trigger == "regression"
    assert mon.captures.current.id != manual["id"] and not mon.policy.deferred


class _Model:
    capturable = True


class _Slot:
    """The capture controller as the policy sees it: a state, ``auto`` (which can lose the race for a freed slot to a
    manual capture), and the automatic cooldown's seconds left (``limits.cooldown_left``, on ``clock``)."""

    def __init__(self) -> None:
        self.state, self.armed, self.lose_race, self.left = "recording", [], True, 0.0
        self.limits = self

    def clock(self) -> float:
        return 0.0

    def cooldown_left(self, now: float) -> float:
        return self.left

    def auto(self, st: object, options: object, details: dict) -> object | None:
        if self.state != "idle" or self.lose_race or self.left:
            if self.state != "idle" or self.lose_race:
                self.state, self.lose_race = "armed", False  # a manual capture armed first
            return None
        self.state = "armed"
        self.armed.append(details)
        return object()


def _policy_on(slot: _Slot, models: tuple[str, ...] = ("m",)) -> Any:
    from perfmon.captures.policy import CapturePolicy
    from perfmon.faults import InternalErrors

    class Log:
        def warning(self, event: str, **kw: object) -> None:
            pass

    return CapturePolicy(RegressionPolicy(window_seconds=1, min_samples=5, baseline_windows=2, consecutive=1,
                                          baseline_capture=False),
                         models={m: _Model() for m in models}, captures=slot,  # type: ignore[arg-type]
                         internal=InternalErrors(), log=Log())


def test_a_deferred_regression_capture_outlives_a_manual_one_that_takes_the_slot_first() -> None:
    """The slot frees and, before the deferred regression capture is armed, a manual capture (the HTTP thread) takes
    it: the arm is refused as busy. The regression capture used to be dropped then, and the detector fires once per
    regression, so a regression that outlasted the manual captures was never captured (a thread-per-request server's
    test, loaded host). It is kept for when the slot frees again."""
    slot = _Slot()
    policy = _policy_on(slot)
    det, t0 = policy.detector, time.perf_counter_ns()
    assert det is not None
    fired = _three_healthy_windows_then_a_slow_one(det, t0)
    slot.lose_race = False
    policy.fire(fired)  # the slot is busy (a recording): kept
    assert "m" in policy.deferred and not slot.armed
    slot.state, slot.lose_race = "idle", True
    policy.tick(t0 + 4 * S + 1)  # free, but a manual capture takes it before the regression's arm
    assert "m" in policy.deferred and not slot.armed
    slot.state = "idle"
    policy.tick(t0 + 4 * S + 2)
    assert not policy.deferred and len(slot.armed) == 1


def test_a_regression_capture_is_kept_when_a_manual_one_takes_the_idle_slot_before_its_arm() -> None:
    """The slot is idle when the regression fires, but a manual capture (the HTTP thread) arms between the look at its
    state and the regression's own arm: refused as busy. It used to be dropped then (busy was read before the arm),
    and the regression, outlasting the manual capture, was never captured (a thread-per-request server's test on a
    loaded host). It is kept, and armed once the slot frees."""
    slot = _Slot()
    slot.state = "idle"
    policy = _policy_on(slot)
    det, t0 = policy.detector, time.perf_counter_ns()
    assert det is not None
    fired = _three_healthy_windows_then_a_slow_one(det, t0)
    policy.fire(fired)  # idle when looked at; the manual capture wins the race to the arm
    assert "m" in policy.deferred and not slot.armed and slot.state == "armed"
    slot.state = "idle"  # the manual capture ends
    policy.tick(t0 + 4 * S + 1)
    assert not policy.deferred and len(slot.armed) == 1


def test_a_regression_capture_is_kept_when_the_busy_slot_frees_just_before_its_arm_is_refused() -> None:
    """The other side of the race above: the slot is busy when looked at, and the capture holding it ends (its export,
    a DELETE) before the arm reads it, which is refused as busy. Read only after the arm, the slot looked idle and
    the regression was dropped; it is kept."""

    class Freeing(_Slot):
        def auto(self, st: object, options: object, details: dict) -> object | None:
            self.state = "idle"  # the holder ended between the look and the refusal
            return None

    slot = Freeing()
    policy = _policy_on(slot)
    det, t0 = policy.detector, time.perf_counter_ns()
    assert det is not None
    policy.fire(_three_healthy_windows_then_a_slow_one(det, t0))
    assert "m" in policy.deferred


def _two_models_regressing(det: Detector, t0: int) -> list:
    """``_three_healthy_windows_then_a_slow_one`` for two models, ``m`` and ``n``, at once: both regressions fired."""
    fired: list = []
    for w, latency in enumerate((0.001, 0.001, 0.001, 0.004)):
        for i in range(10):
            for name in ("m", "n"):
                fired += det.add(name, latency, t0 + w * S + i * 1_000_000)
    fired += det.tick(t0 + 4 * S)
    assert sorted(r.model for r in fired) == ["m", "n"]
    return fired


def test_two_models_regressing_at_once_are_both_captured_once_the_cooldown_lets_the_second_arm() -> None:
    """Two models regress in one pass (a pipeline and the model it calls): the first's capture takes the slot, the
    second's waits. The slot frees before the automatic cooldown ends: the second used to be refused (cooldown) and
    dropped. It waits out the cooldown when that ends before the deferral would; past the deferral it is dropped."""
    slot = _Slot()
    policy = _policy_on(slot, ("m", "n"))
    det, t0 = policy.detector, time.perf_counter_ns()
    assert det is not None
    fired = _two_models_regressing(det, t0)
    slot.state, slot.lose_race = "idle", False
    policy.fire(fired)  # the first arms; the second finds the slot armed: kept
    assert len(slot.armed) == 1 and len(policy.deferred) == 1
    slot.state, slot.left = "idle", 5.0  # its capture done; the cooldown it started has 5 s to run
    policy.tick(t0 + 4 * S + 1)
    assert len(policy.deferred) == 1 and len(slot.armed) == 1
    slot.left = 0.0
    policy.tick(t0 + 4 * S + 2)
    assert not policy.deferred and len(slot.armed) == 2
    assert {d["model"] for d in slot.armed} == {"m", "n"}
    # A cooldown longer than the deferral's 120 s: dropped (counted by the controller's refusal).
    slot2 = _Slot()
    policy2 = _policy_on(slot2, ("m", "n"))
    assert policy2.detector is not None
    fired = _two_models_regressing(policy2.detector, t0)
    slot2.state, slot2.lose_race = "idle", False
    policy2.fire(fired)
    slot2.state, slot2.left = "idle", 600.0
    policy2.tick(t0 + 4 * S + 1)
    assert not policy2.deferred and len(slot2.armed) == 1
    # Both fire with the slot free but inside a cooldown that ends soon (another model's capture armed a moment ago):
    # both kept, then armed one at a time.
    slot3 = _Slot()
    policy3 = _policy_on(slot3, ("m", "n"))
    assert policy3.detector is not None
    fired = _two_models_regressing(policy3.detector, t0)
    slot3.state, slot3.lose_race, slot3.left = "idle", False, 0.5
    policy3.fire(fired)
    assert len(policy3.deferred) == 2 and not slot3.armed
    slot3.left = 0.0
    policy3.tick(t0 + 4 * S + 1)
    assert len(policy3.deferred) == 1 and len(slot3.armed) == 1
    slot3.state = "idle"
    policy3.tick(t0 + 4 * S + 2)
    assert not policy3.deferred and {d["model"] for d in slot3.armed} == {"m", "n"}
