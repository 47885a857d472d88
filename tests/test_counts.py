"""Counting, sampling and the cold/steady split."""

from __future__ import annotations

import statistics
import threading
from typing import Any

import pytest
import torch

from .conftest import buckets, hist_count, value


def _lin() -> torch.nn.Module:
    return torch.nn.Linear(8, 8)


def test_calls_counted_exactly_and_histograms_match_samples(make_monitor) -> None:
    """After N calls the counter is exactly N and histogram counts equal sampled minus dropped."""
    mon = make_monitor(sample_rate=0.05).start()
    model = mon.wrap(_lin(), name="lin")
    x = torch.randn(4, 8)
    n = 3001
    for _ in range(n):
        model(x)
    assert mon.flush()
    assert value(mon, "perfmon_forward_calls_total", model="lin") == n
    sampled = value(mon, "perfmon_forward_sampled_total", model="lin")
    timed = hist_count(mon, "lin", "cold") + hist_count(mon, "lin", "steady")
    assert timed == sampled
    assert hist_count(mon, "lin", "cold") == 3
    # on a wall clock host time is the same measurement: no duplicate host histogram on CPU
    assert hist_count(mon, "lin", "cold", name="perfmon_forward_host_duration_seconds") == 0
    # 1-in-20 with jitter: the expected number of steady samples is ~150
    assert 80 <= hist_count(mon, "lin", "steady") <= 240
    stats = mon.stats()["models"]["lin"]
    assert stats["calls"] == n and stats["sampled"] == sampled


def test_counts_exact_under_concurrent_threads(make_monitor) -> None:
    """Eight threads calling one wrapped model lose no call and no error; a timed call that raised is sampled
    but kept out of the latency histograms."""
    per_thread, threads = 2500, 8
    calls, raised = per_thread * threads, threads * (per_thread // 10)
    # More warm-up calls than calls made, and a queue that cannot fill: every call is timed, so the sampled calls
    # that raised are exactly the calls that raised. (Not sample_rate=1.0: a thread whose call index fell behind
    # the next_index another thread just moved can skip its sample; warm-up never moves next_index off 0.)
    mon = make_monitor(sample_rate=0.02, warmup_calls=calls + 1, queue_size=32_768).start()

    class Flaky(torch.nn.Module):
        def forward(self, x: torch.Tensor, fail: bool = False) -> torch.Tensor:
            if fail:
                raise ValueError("bad request")
            return x + 1

    model = mon.wrap(Flaky(), name="flaky")
    barrier = threading.Barrier(threads)

    def work() -> None:
        x = torch.zeros(2)
        barrier.wait(timeout=10)
        for i in range(per_thread):
            try:
                model(x, fail=(i % 10 == 0))
            except ValueError:
                pass

    ts = [threading.Thread(target=work) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=60)
    assert mon.flush()
    assert value(mon, "perfmon_forward_calls_total", model="flaky") == calls
    assert value(mon, "perfmon_forward_errors_total", model="flaky", exception="ValueError") == raised
    assert value(mon, "perfmon_forward_sampled_total", model="flaky") == calls
    assert not any(value(mon, "perfmon_samples_dropped_total", model="flaky", reason=r)
                   for r in ("queue_full", "pool_exhausted", "graph_capture"))
    timed = hist_count(mon, "flaky", "cold") + hist_count(mon, "flaky", "steady")
    errors_sampled = value(mon, "perfmon_forward_sampled_total", model="flaky") - timed
    assert errors_sampled == raised  # timed calls that raised are not put in the latency histograms


def test_cold_steady_split_follows_warmup_and_new_signatures(make_monitor) -> None:
    """The first warmup calls and the first call of each new shape/dtype are cold; the rest steady."""
    mon = make_monitor(sample_rate=1.0, warmup_calls=3)
    model = mon.wrap(_lin(), name="lin")
    a, b, c = torch.randn(1, 8), torch.randn(2, 8), torch.randn(3, 8)
    a64 = a.double()
    model.double()
    model.float()
    # shape sequence and whether each call is cold
    script = [(a, True), (a, True), (b, True),  # warm-up: the first three calls, whatever their shape
              (a, False), (b, False),           # shapes seen during warm-up are known
              (c, True), (c, False),            # a new shape
              (a, False), (b, False), (c, False)]
    for x, _ in script:
        model(x)
    expected_cold = sum(cold for _, cold in script)
    mon.flush()
    assert hist_count(mon, "lin", "cold") == expected_cold == 4
    assert hist_count(mon, "lin", "steady") == len(script) - expected_cold
    # a new dtype is a new signature
    model.double()
    model(a64)
    model(a64)
    mon.flush()
    assert hist_count(mon, "lin", "cold") == 5
    assert value(mon, "perfmon_input_signatures", model="lin") == 4


def test_a_shape_evicted_from_the_signature_table_is_new_again_when_it_returns(make_monitor) -> None:
    """A warm shape pushed out of a full signature table by a new one is a new shape when it comes back: its first call
    is cold again, and every call and item is still counted (the one-tensor fast path forgets it with the table)."""
    mon = make_monitor(sample_rate=1e-6, sample_floor_seconds=3600.0, warmup_calls=0, signature_cache_size=4)
    model = mon.wrap(_lin(), name="lin")
    rows = [1, 2, 3, 4, 5, 1, 1, 1]  # 1..4 fill the table; 5 evicts 1; 1 comes back (and evicts 2)
    for n in rows:
        for _ in range(3):
            model(torch.randn(n, 8))
    mon.flush()
    # each shape's first call is cold (signature_warmup_calls=1): 1..5, then 1 again; no steady sample at this rate
    assert hist_count(mon, "lin", "cold") == 6
    assert hist_count(mon, "lin", "steady") == 0
    assert value(mon, "perfmon_forward_calls_total", model="lin") == 3 * len(rows)
    assert value(mon, "perfmon_forward_items_total", model="lin") == 3 * sum(rows)
    assert mon.stats()["models"]["lin"]["signature_tracking"] is True


def test_signature_tracking_off_uses_warmup_only(make_monitor) -> None:
    """With track_signatures=False only the warm-up calls are cold."""
    mon = make_monitor(sample_rate=1.0, warmup_calls=2, track_signatures=False)
    model = mon.wrap(_lin(), name="lin")
    for n in range(1, 7):
        model(torch.randn(n, 8))
    mon.flush()
    assert hist_count(mon, "lin", "cold") == 2 and hist_count(mon, "lin", "steady") == 4


def test_signatures_of_keyword_and_nested_inputs(make_monitor) -> None:
    """Tensors in kwargs and lists count toward the signature; other values by type only."""
    mon = make_monitor(sample_rate=1.0, warmup_calls=0)
    fn = mon.instrument(lambda *a, **k: None, name="f", device="cpu")  # "auto" is the GPU where there is one
    t2, t3 = torch.zeros(2), torch.zeros(3)
    fn(ids=t2, n=5)
    fn(ids=t2, n=6)           # int value changed: same signature
    fn(ids=t3, n=6)           # tensor shape changed: new
    fn([t2, t2])
    fn([t2, t3])              # list element shape changed: new
    fn([t2, t3])
    mon.flush()
    assert hist_count(mon, "f", "cold") == 4 and hist_count(mon, "f", "steady") == 2


def test_churning_signatures_stop_being_cold(make_monitor, capsys: pytest.CaptureFixture[str]) -> None:
    """When shapes never repeat, signature tracking switches off after the table turns over. That is the workload's,
    not a fault of the agent's: a warning names the model and the setting, and no internal error is counted (it was,
    with an error-level ``internal_error`` line: an operator's alert on perfmon's own faults fired on traffic)."""
    import json

    from .conftest import wait_until

    mon = make_monitor(sample_rate=0.001, warmup_calls=0, signature_cache_size=8, log_level="warning").start()
    model = mon.wrap(_lin(), name="lin")
    for n in range(1, 41):
        model(torch.randn(n, 8))
    mon.flush()
    # 16 cold (8 to fill the table, 8 evictions to turn it over), then tracking stops
    assert hist_count(mon, "lin", "cold") == 16
    assert mon.stats()["models"]["lin"]["signature_tracking"] is False
    assert value(mon, "perfmon_internal_errors_total", stage="signatures") is None
    seen: list[dict[str, Any]] = []

    def churned() -> bool:
        seen.extend(json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{"))
        return any(e.get("event") == "signatures_churned" for e in seen)

    wait_until(churned, timeout=30, what="the resolver's warning that the signatures churned")
    (line,) = [e for e in seen if e.get("event") == "signatures_churned"]
    assert (line["level"], line["model"], line["signatures"]) == ("warning", "lin", 8)
    assert "signature_cache_size" in line["note"] and not any(e.get("event") == "internal_error" for e in seen)


def test_sampling_floor_times_a_call_after_a_quiet_period(make_monitor) -> None:
    """With a tiny rate, the floor still gets one call timed per floor period."""
    mon = make_monitor(sample_rate=1e-6, warmup_calls=1, sample_floor_seconds=5.0)
    model = mon.wrap(_lin(), name="lin")
    x = torch.randn(1, 8)
    for _ in range(50):
        model(x)
    mon.flush()
    assert hist_count(mon, "lin", "steady") == 0
    state = mon.models.by_name["lin"]
    # the resolver's housekeeping with a clock 6 s later arms the floor
    mon.resolver.step(now_ns=state.last_sample_ns + 6_000_000_000)
    model(x)
    model(x)
    mon.flush()
    assert hist_count(mon, "lin", "steady") == 1


def test_call_sampler_times_the_first_call_a_share_and_one_per_floor() -> None:
    """CallSampler (which generate() calls get their tokens timed): the first call; at rate 1 every call; at a rate
    no run reaches, none until the floor has passed since the last timed call, then that one; the share is the
    rate on average (a jittered stride: mean 1/rate)."""
    from perfmon.agent.sampling import CallSampler

    every = CallSampler(1.0, 3600.0)
    assert all(every.pick(i) for i in range(50))
    rare = CallSampler(1e-9, 1.0)
    s = 1_000_000_000
    assert rare.pick(0)
    assert not any(rare.pick(t) for t in range(1, s, s // 100))  # within the floor: not one
    assert rare.pick(s) and not rare.pick(s + 1) and rare.pick(2 * s + 1)
    tenth = CallSampler(0.1, 3600.0, seed=7)
    share = sum(bool(tenth.pick(i)) for i in range(20_000)) / 20_000
    assert 0.09 < share < 0.11, share


def test_the_sampled_share_holds_through_gaps_drawn_in_batches(make_monitor) -> None:
    """A timed call takes its next gap from a batch drawn ahead (``Sampler.gaps``, ``GAP_BATCH`` at a time): over
    many batches the gaps are uniform over 1 .. 2N-1 as the Sampler draws them, so the share of calls timed is the
    rate (the batch's refill is on a timed call's path: a wrong one would show here)."""
    from perfmon.agent.sampling import Sampler
    from perfmon.agent.state import GAP_BATCH

    sampler = Sampler(0.05, 3600.0, seed=3)
    gaps = [g for _ in range(40) for g in sampler.gaps(GAP_BATCH)]
    assert min(gaps) == 1 and max(gaps) == 39 and abs(statistics.mean(gaps) - 20) < 0.5
    assert list(Sampler(1.0, 3600.0).gaps(5)) == [1] * 5
    mon = make_monitor(sample_rate=0.05, warmup_calls=0, sample_floor_seconds=3600.0, queue_size=4096).start()
    model = mon.wrap(torch.nn.Identity(), name="ident")
    x = torch.ones(1)
    calls = 20 * GAP_BATCH * 8  # ~8 batches of gaps used
    for _ in range(calls):
        model(x)
    mon.flush()
    sampled = value(mon, "perfmon_forward_sampled_total", model="ident")
    assert 0.045 < sampled / calls < 0.055, sampled / calls  # ~2,048 timed: ±5 sd is ±0.5 percentage points


def test_errors_counted_by_class_with_a_cap(make_monitor) -> None:
    """Exceptions are counted by class name; beyond the cap they are labelled 'other'."""
    mon = make_monitor(max_exception_labels=2)
    classes = [type(f"E{i}", (Exception,), {}) for i in range(4)]

    def fail(i: int) -> None:
        raise classes[i]()

    fn = mon.instrument(fail, name="fail")
    # Every class together, at 0 before the first error: a rate() sees the first ones (a class's own series
    # appears only with its first exception).
    assert value(mon, "perfmon_forward_failed_calls_total", model="fail") == 0
    assert value(mon, "perfmon_forward_errors_total", model="fail", exception="E0") is None
    for i in (0, 1, 2, 3, 3, 0):
        with pytest.raises(Exception):  # noqa: B017 - any of the generated classes
            fn(i)
    assert value(mon, "perfmon_forward_errors_total", model="fail", exception="E0") == 2
    assert value(mon, "perfmon_forward_errors_total", model="fail", exception="E1") == 1
    assert value(mon, "perfmon_forward_errors_total", model="fail", exception="other") == 3
    assert value(mon, "perfmon_forward_failed_calls_total", model="fail") == 6
    assert value(mon, "perfmon_forward_calls_total", model="fail") == 6


def test_an_instrumented_async_function_is_timed_over_its_await_and_its_errors_counted(make_monitor) -> None:
    """``instrument`` of an ``async def``: a call is its awaiting (each sleeps 30 ms: no timed call can read less),
    not the coroutine's creation (microseconds, as a plain wrapper read), and an exception raised in the coroutine is
    counted by class and reaches the awaiting caller unchanged; items from an ``items`` callable."""
    import asyncio

    mon = make_monitor(sample_rate=1.0, warmup_calls=1)
    boom = ValueError("negative")

    @mon.instrument(name="handler", device="cpu", items=lambda args, kwargs: args[0] if args[0] > 0 else 0)
    async def handler(n: int) -> int:
        await asyncio.sleep(0.03)
        if n < 0:
            raise boom
        return n

    async def serve() -> list[Any]:
        got: list[Any] = [await handler(n) for n in (1, 2, 3)]
        for _ in range(2):
            try:
                await handler(-1)
            except ValueError as exc:
                got.append(exc)
        return got

    assert asyncio.run(serve()) == [1, 2, 3, boom, boom]
    mon.flush()
    assert value(mon, "perfmon_forward_calls_total", model="handler") == 5
    assert value(mon, "perfmon_forward_errors_total", model="handler", exception="ValueError") == 2
    assert value(mon, "perfmon_forward_items_total", model="handler") == 6
    timed = hist_count(mon, "handler", "cold") + hist_count(mon, "handler", "steady")
    assert timed == 3  # the calls that raised are counted as errors, not timed
    for phase in ("cold", "steady"):
        got = buckets(mon, "handler", phase)
        assert all(count == 0 for le, count in got if le < 0.03), got


def test_instrument_refuses_generator_functions_and_a_monitored_coroutine(make_monitor) -> None:
    """A generator function's call returns before its work runs (timed, it read microseconds for 50 ms of work):
    refused with a clear error at decoration, as is instrumenting an instrumented ``async def`` again."""
    from perfmon import WrapError

    mon = make_monitor()

    def gen() -> Any:
        yield 1

    async def agen() -> Any:
        yield 1

    for fn in (gen, agen):
        with pytest.raises(WrapError, match="generator function"):
            mon.instrument(fn, name="g")

    async def coro() -> None:
        return None

    monitored = mon.instrument(coro, name="c")
    with pytest.raises(WrapError, match="already monitored"):
        mon.instrument(monitored, name="c2")


def test_track_context_manager_counts_and_times(make_monitor) -> None:
    """`with monitor.track(name)` counts blocks, times cold ones, and counts exceptions without eating them."""
    mon = make_monitor(sample_rate=1.0, warmup_calls=1)
    for _ in range(3):
        with mon.track("generate", device="cpu"):  # "auto" is the current GPU where there is one
            pass
    with pytest.raises(KeyError), mon.track("generate", device="cpu"):
        raise KeyError("k")
    mon.flush()
    assert value(mon, "perfmon_forward_calls_total", model="generate") == 4
    assert value(mon, "perfmon_forward_errors_total", model="generate", exception="KeyError") == 1
    assert hist_count(mon, "generate", "cold") == 1 and hist_count(mon, "generate", "steady") == 2


def test_several_models_get_their_own_label(make_monitor) -> None:
    """Two wrapped models are counted under their own model label."""
    mon = make_monitor()
    a, b = mon.wrap(_lin(), name="a"), mon.wrap(_lin(), name="b")
    x = torch.randn(1, 8)
    for _ in range(3):
        a(x)
    b(x)
    assert value(mon, "perfmon_forward_calls_total", model="a") == 3
    assert value(mon, "perfmon_forward_calls_total", model="b") == 1


def test_calls_after_stop_are_counted_not_timed(make_monitor) -> None:
    """After stop() a wrapped model still works and is counted, but nothing is queued."""
    mon = make_monitor(sample_rate=1.0).start()
    model = mon.wrap(_lin(), name="lin")
    x = torch.randn(1, 8)
    model(x)
    mon.stop()
    for _ in range(10):
        model(x)
    assert value(mon, "perfmon_forward_calls_total", model="lin") == 11
    assert mon.stats()["pending_samples"] == 0


def test_a_dtype_switch_is_cold_at_its_first_timed_call(make_monitor) -> None:
    """The unsampled path keys on the shape alone; a known shape in a new dtype is a new signature, and the
    first timed call in it is cold (then steady), while every call stays counted."""
    mon = make_monitor(sample_rate=1e-6, warmup_calls=1, sample_floor_seconds=3600)
    model = mon.wrap(_lin(), name="lin")
    x = torch.randn(2, 8)
    model(x)  # warm-up: cold, timed
    model.double()
    for _ in range(5):
        model(x.double())  # unsampled: counted, not timed
    st = mon.models.by_name["lin"]
    for _ in range(2):
        st.next_index = 0  # what the sampling floor does: time the next call
        model(x.double())
    mon.flush()
    assert value(mon, "perfmon_forward_calls_total", model="lin") == 8
    assert hist_count(mon, "lin", "cold") == 2 and hist_count(mon, "lin", "steady") == 1
    assert value(mon, "perfmon_input_signatures", model="lin") == 2


def test_track_past_max_models_or_with_a_bad_name_never_raises_into_the_request(make_monitor) -> None:
    """Once max_models names exist, a new ``track`` name (or an invalid one) runs its block untracked, every
    time, counted as an internal fault; the user's own exceptions still pass through unchanged."""
    mon = make_monitor(max_models=2)
    mon.instrument(lambda: None, name="a")
    mon.instrument(lambda: None, name="b")
    ran = 0
    for name in ["postprocess"] * 5 + ["", "x" * 500, "\x1b[31m"]:
        with mon.track(name, device="cpu"):
            ran += 1
    assert ran == 8
    with pytest.raises(ValueError, match="mine"), mon.track("postprocess", device="cpu"):
        raise ValueError("mine")
    assert value(mon, "perfmon_internal_errors_total", stage="track") == 9
    assert value(mon, "perfmon_forward_calls_total", model="postprocess") is None
    assert sorted(mon.models.by_name) == ["a", "b"]


def test_resolved_samples_carry_each_field_under_its_name_in_one_batch_a_pass(make_monitor) -> None:
    """The request thread and the resolver build their records field by field in order (no named-tuple __new__): each
    value is read back under its own name, and a sink gets a pass's samples in one call, in the calls' order."""
    mon = make_monitor(sample_rate=1.0, warmup_calls=1)
    batches: list[list[Any]] = []
    mon.resolver.sinks.append(batches.append)
    model = mon.wrap(_lin(), name="lin")
    with torch.inference_mode():
        for rows in (3, 3, 3, 3, 5):
            model(torch.randn(rows, 8))
    assert mon.flush()
    assert len(batches) == 1 and len(batches[0]) == 5
    first, *_, fourth, fifth = batches[0]
    assert (first.model, first.device, first.phase, first.seq, first.stage) == ("lin", "cpu", "cold", 0, "")
    assert [s.seq for s in batches[0]] == [0, 1, 2, 3, 4]
    assert (fourth.phase, fifth.phase) == ("steady", "cold")  # a new shape is cold
    assert (first.items, fifth.items) == (3, 5) and (first.size, fifth.size) == (24, 40)
    assert first.duration_seconds == first.host_seconds > 0
    assert first.end_ns < fourth.end_ns < fifth.end_ns
    assert first.trace is None and first.gc_seconds == 0.0 and first.gc_generation == -1
    assert fourth.sig is not None and fourth.sig.items == 3  # its signature (phases.Signature): 3 rows a call
