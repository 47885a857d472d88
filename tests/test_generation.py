"""Generation requests: TTFT, inter-token latency, token counts and outcomes, bounded under load."""

from __future__ import annotations

import asyncio
import gc
import statistics
import time
import weakref
from collections.abc import AsyncIterator, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import generate_latest

import perfmon
from perfmon.agent.generation import ITL_BUCKETS, TTFT_BUCKETS, Generation
from perfmon.testing import histogram_quantile

from .conftest import promtool_check, value
from .prom import running_prometheus

FIRST_S = 0.050  # the scripted stream's first item comes after ~50 ms ...
GAP_S = 0.005  # ... then one every ~5 ms
TOKENS = 20


def scripted(n: int = TOKENS, first_s: float = FIRST_S, gap_s: float = GAP_S) -> Generator[int, None, None]:
    """A token stream with a scripted pace (the sleeps create the timing; nothing waits on them)."""
    time.sleep(first_s)
    for i in range(n):
        if i:
            time.sleep(gap_s)
        yield i


def consume(mon: perfmon.Monitor, name: str, requests: int, prompt_tokens: int = 7) -> tuple[list[float], list[float]]:
    """Run scripted requests through monitor.stream; the consumer's own (TTFT, ITL) truth in seconds."""
    ttft: list[float] = []
    itl: list[float] = []
    for _ in range(requests):
        t0 = time.perf_counter_ns()
        last = None
        for _item in mon.stream(scripted(), name=name, prompt_tokens=prompt_tokens):
            now = time.perf_counter_ns()
            if last is None:
                ttft.append((now - t0) / 1e9)
            else:
                itl.append((now - last) / 1e9)
            last = now
    return ttft, itl


def buckets(mon: perfmon.Monitor, metric: str, model: str) -> list[tuple[float, float]]:
    """Cumulative (le, count) pairs of one generation histogram."""
    out = []
    for fam in mon.registry.collect():
        if fam.name == metric:
            out += [(float(s.labels["le"]), s.value) for s in fam.samples
                    if s.name.endswith("_bucket") and s.labels.get("model") == model]
    return out


def requests(mon: perfmon.Monitor, model: str) -> dict[str, float | None]:
    """perfmon_generation_requests_total by outcome, from the registry."""
    return {o: value(mon, "perfmon_generation_requests_total", model=model, outcome=o)
            for o in ("ok", "error", "cancelled")}


def nothing_left(mon: perfmon.Monitor) -> None:
    """The tracker holds no live request and no queued record once everything ended and was drained."""
    assert mon.flush()
    assert mon.generations.live() == 0
    assert len(mon.generations.queue) == 0
    assert all(v["in_flight"] == 0 for v in mon.stats()["generation"].values())


def test_scripted_stream_ttft_and_itl_match_truth_in_stats_and_histograms(make_monitor) -> None:
    """A 50 ms + 20 x 5 ms stream reports TTFT and ITL p50 within 5% of the consumer's truth, counts exact."""
    mon = make_monitor().start()
    ttft, itl = consume(mon, "scripted", requests=4)
    assert mon.flush()
    truth_ttft, truth_itl = statistics.median(ttft), statistics.median(itl)
    gen = mon.stats()["generation"]["scripted"]
    assert gen["requests"] == {"ok": 4, "error": 0, "cancelled": 0}
    assert (gen["generated_tokens"], gen["prompt_tokens"], gen["in_flight"]) == (4 * TOKENS, 4 * 7, 0)
    assert gen["time_to_first_token"]["count"] == 4
    assert gen["inter_token_latency"]["count"] == 4 * (TOKENS - 1)
    assert gen["duration"]["count"] == 4
    assert abs(gen["time_to_first_token"]["p50_seconds"] / truth_ttft - 1) < 0.05, (gen, truth_ttft)
    assert abs(gen["inter_token_latency"]["p50_seconds"] / truth_itl - 1) < 0.05, (gen, truth_itl)
    assert gen["tokens_per_second"] > 0
    # Histograms: exact counts; p50 within half a 21% bucket (the midpoint of a 12-a-decade bucket is at most
    # 10.6% from any value in it) plus the truth's own spread.
    ttft_b = buckets(mon, "perfmon_time_to_first_token_seconds", "scripted")
    itl_b = buckets(mon, "perfmon_inter_token_latency_seconds", "scripted")
    assert (len(ttft_b), len(itl_b)) == (len(TTFT_BUCKETS) + 1, len(ITL_BUCKETS) + 1)
    assert (ttft_b[-1][1], itl_b[-1][1]) == (4, 4 * (TOKENS - 1))
    assert abs(histogram_quantile(0.5, ttft_b) / truth_ttft - 1) < 0.12
    assert abs(histogram_quantile(0.5, itl_b) / truth_itl - 1) < 0.12
    assert value(mon, "perfmon_generated_tokens_total", model="scripted") == 4 * TOKENS
    assert value(mon, "perfmon_prompt_tokens_total", model="scripted") == 4 * 7
    assert value(mon, "perfmon_generation_output_tokens_sum", model="scripted") == 4 * TOKENS
    assert value(mon, "perfmon_generation_prompt_tokens_count", model="scripted") == 4
    assert value(mon, "perfmon_generation_duration_seconds_count", model="scripted") == 4
    assert requests(mon, "scripted") == {"ok": 4, "error": 0, "cancelled": 0}
    nothing_left(mon)


@pytest.mark.prometheus
def test_real_prometheus_histogram_quantile_within_bucket_resolution(make_monitor, tmp_path: Path) -> None:
    """Prometheus' histogram_quantile of TTFT and ITL (classic buckets, 21% apart) is within half a bucket
    (10.6%) of the truth, plus its spread; token counts exact."""
    mon = make_monitor(port=0).start()
    ttft, itl = consume(mon, "scripted", requests=3)
    assert mon.flush()
    with running_prometheus(tmp_path, [mon.url.removeprefix("http://")]) as prom:
        for metric, truth in (("perfmon_time_to_first_token_seconds", statistics.median(ttft)),
                              ("perfmon_inter_token_latency_seconds", statistics.median(itl))):
            got = prom.wait_for(f'histogram_quantile(0.5, {metric}_bucket{{model="scripted"}})')
            assert abs(float(got[0]["value"][1]) / truth - 1) < 0.12, (metric, got, truth)
        got = prom.wait_for('perfmon_generated_tokens_total{model="scripted"}')
        assert float(got[0]["value"][1]) == 3 * TOKENS
        got = prom.wait_for('perfmon_generation_requests_total{model="scripted",outcome="ok"}')
        assert float(got[0]["value"][1]) == 3


class Boom(Exception):
    """The user's own exception."""


def failing(after: int) -> Iterator[int]:
    """Yields ``after`` items, then raises Boom."""
    yield from range(after)
    raise Boom("mid-stream")


def test_outcomes_are_counted_exactly_once_each(make_monitor) -> None:
    """ok, error mid-stream (the same exception object), break, close() and garbage collection each count once."""
    mon = make_monitor().start()
    assert list(mon.stream(iter(range(3)), name="m")) == [0, 1, 2]  # ok
    with pytest.raises(Boom) as info:
        for _ in mon.stream(failing(2), name="m"):
            pass
    assert str(info.value) == "mid-stream" and info.traceback[-1].name == "failing"  # unchanged
    for i in mon.stream(scripted(10, 0, 0), name="m"):  # consumer breaks; the loop drops the generator
        if i == 2:
            break
    inner = scripted(10, 0, 0)
    s = mon.stream(inner, name="m")
    next(s)
    s.close()  # cancelled, and the wrapped generator is closed with it
    assert inner.gi_frame is None
    never_started = mon.stream(iter(range(5)), name="m")
    del never_started  # a generator closed before its first next() runs no finally: the request still ends
    cyclic = mon.stream(iter(range(5)), name="m")
    next(cyclic)
    holder: list[Any] = [cyclic]
    holder.append(holder)  # a reference cycle: only the cyclic GC finalizes it
    del cyclic, holder
    gc.collect()
    assert mon.flush()
    assert requests(mon, "m") == {"ok": 1, "error": 1, "cancelled": 4}
    # tokens: 3 (ok) + 2 (error) + 3 (break at the third) + 1 (close) + 0 + 1 (cyclic)
    assert value(mon, "perfmon_generated_tokens_total", model="m") == 10
    assert value(mon, "perfmon_generation_duration_seconds_count", model="m") == 1  # only ok requests
    s = mon.stream(iter(range(3)), name="m")
    list(s)
    s.close()  # closing an exhausted stream changes nothing
    assert requests(mon, "m")["ok"] == 2
    nothing_left(mon)


def test_with_block_and_manual_finish(make_monitor) -> None:
    """The with form ends ok / error / cancelled; finish() is idempotent; late tokens are dropped, not counted."""
    mon = make_monitor().start()
    with mon.generation("chat", prompt_tokens=12) as g:
        g.token()
        g.token(4)  # a chunk: 4 tokens, 4 ITL observations of gap / 4
        g.token(0)  # nothing
    assert (g.outcome, g.tokens, g.prompt_tokens) == ("ok", 5, 12)
    err = ValueError("user's")
    with pytest.raises(ValueError) as info, mon.generation("chat") as g2:
        g2.token()
        raise err
    assert info.value is err and g2.outcome == "error"
    with pytest.raises(KeyboardInterrupt), mon.generation("chat") as g3:
        raise KeyboardInterrupt  # a BaseException that is not an Exception: the caller stopped
    assert g3.outcome == "cancelled"
    g4 = mon.generation("chat", prompt_tokens=3)
    g4.token(2)  # the first chunk: one TTFT, no ITL
    g4.finish()
    g4.finish("error")  # the first finish wins
    g4.token()
    assert g4.outcome == "ok" and g4.tokens == 2
    with pytest.raises(perfmon.ConfigError):
        mon.generation("chat").finish("maybe")  # (that request then ends as cancelled when collected)
    g5 = mon.generation("chat")
    g5.token(-1)  # nonsense: an internal error, counted as one token
    g5.finish()
    ref = weakref.ref(g6 := mon.generation("chat"))
    del g6  # abandoned without finish
    assert ref() is None
    gc.collect()  # the "maybe" request may sit in a traceback cycle until the cyclic GC runs
    assert mon.flush()
    gen = mon.stats()["generation"]["chat"]
    assert gen["requests"] == {"ok": 3, "error": 1, "cancelled": 3}
    assert (gen["generated_tokens"], gen["prompt_tokens"]) == (5 + 1 + 2 + 1, 15)
    assert gen["dropped"] == {"after_finish": 1}
    assert gen["time_to_first_token"]["count"] == 4
    assert gen["inter_token_latency"]["count"] == 4
    assert value(mon, "perfmon_inter_token_latency_seconds_count", model="chat") == 4
    assert value(mon, "perfmon_generation_output_tokens_sum", model="chat") == 5 + 2 + 1
    assert value(mon, "perfmon_internal_errors_total", stage="generation") == 1
    nothing_left(mon)


def test_names_are_validated_bounded_and_shared_with_models(make_monitor) -> None:
    """Names follow the model-name rules and max_models (one it cannot take is an internal error, never the caller's);
    a wrapped model's name shares its label."""
    mon = make_monitor(max_models=2).start()
    model = mon.wrap(torch.nn.Linear(2, 2), name="gpt2")
    model(torch.ones(1, 2))
    with mon.generation("gpt2") as g:
        g.token()
    assert value(mon, "perfmon_generated_tokens_total", model="gpt2") == 1
    forward_calls = sum(s.value for fam in mon.registry.collect() for s in fam.samples
                        if s.name == "perfmon_forward_calls_total" and s.labels.get("model") == "gpt2")
    assert forward_calls == 1  # (summed: the forward series may carry more labels than model)
    # In the request path a name perfmon cannot take never raises: the request counts nowhere, the fault is counted.
    for bad in ("", "x" * 129, "a\nb", "\ud800", 3):
        with mon.generation(bad) as g:  # type: ignore[arg-type]
            g.token(2)
        assert g.outcome == "ok" and g.tokens == 2
    assert value(mon, "perfmon_internal_errors_total", stage="generation") == 5
    # A bad prompt_tokens: the request is counted, its prompt unknown.
    for bad_prompt in (-1, 1.5, True, "7"):
        with mon.generation("gpt2", prompt_tokens=bad_prompt) as g:
            g.token()
    assert value(mon, "perfmon_internal_errors_total", stage="generation") == 9
    assert value(mon, "perfmon_generated_tokens_total", model="gpt2") == 5
    assert value(mon, "perfmon_prompt_tokens_total", model="gpt2") in (None, 0)
    with pytest.raises(perfmon.ConfigError):  # a call that cannot work anywhere: the caller's own bug, at once
        mon.stream(iter(()), name="gpt2", tokens=5)
    mon.generation("second").finish()
    assert list(mon.stream(iter("abc"), name="third")) == ["a", "b", "c"]  # past max_models: yielded unchanged
    assert value(mon, "perfmon_internal_errors_total", stage="generation") == 10
    assert set(mon.stats()["generation"]) == {"gpt2", "second"}
    nothing_left(mon)


def test_token_callable_counts_chunks_and_fails_soft(make_monitor) -> None:
    """tokens=callable counts chunk sizes; empty chunks record nothing; a failing callable counts 1 and is reported."""
    mon = make_monitor().start()

    def size(chunk: str) -> int:
        if chunk == "!":
            raise RuntimeError("tokenizer broke")
        return len(chunk.split())

    chunks = ["hello there", "", "general kenobi", "!"]
    assert list(mon.stream(chunks, name="text", prompt_tokens=2, tokens=size)) == chunks
    assert mon.flush()
    assert value(mon, "perfmon_generated_tokens_total", model="text") == 2 + 0 + 2 + 1
    assert value(mon, "perfmon_time_to_first_token_seconds_count", model="text") == 1
    assert value(mon, "perfmon_inter_token_latency_seconds_count", model="text") == 3
    assert value(mon, "perfmon_internal_errors_total", stage="generation_tokens") == 1
    nothing_left(mon)


def test_thousands_of_concurrent_streams_stay_bounded_and_leave_nothing(make_monitor) -> None:
    """5,000 open streams: the live table and the queue stay at their caps, drops are counted, nothing remains."""
    # No resolver thread (it would drain the queue as soon as a quarter is used): it drains only when the
    # test calls flush(), so the queue's bound and its drop counts are what is tested.
    mon = make_monitor(max_live_generations=1000, generation_queue_size=2000).start()
    mon.resolver.stop(1.0)
    streams = [mon.stream(iter(range(3)), name="many") for _ in range(5000)]
    for s in streams:
        next(s)
    tracker = mon.generations
    assert tracker.live() == 1000
    assert mon.stats()["generation"]["many"]["in_flight"] == 5000
    assert mon.stats()["generation"]["many"]["oldest_in_flight_seconds"] > 0
    refs = [weakref.ref(s.gi_frame.f_locals["g"]) for s in streams[::100]]
    for i, s in enumerate(streams):
        if i % 2:
            s.close()
        else:
            assert list(s) == [1, 2]
        assert len(tracker.queue) <= 2000
    del streams, s
    assert all(r() is None for r in refs)
    assert mon.flush()
    c = requests(mon, "many")
    assert c == {"ok": 2500, "error": 0, "cancelled": 2500}
    assert value(mon, "perfmon_generated_tokens_total", model="many") == 2500 * 3 + 2500
    dropped = {r: value(mon, "perfmon_generation_dropped_total", model="many", reason=r)
               for r in ("live_limit", "queue_full", "after_finish")}
    assert dropped["live_limit"] == 4000
    # The 1,000 timed requests made 1,000 TTFT records, 1,000 ITL records (the 500 exhausted ones) and
    # 1,000 end records; the queue held 2,000 of them, the rest were dropped and counted.
    assert dropped["queue_full"] == 1000 + 1000 + 1000 - 2000
    assert value(mon, "perfmon_time_to_first_token_seconds_count", model="many") == 1000
    histogrammed = sum(value(mon, f"{m}_count", model="many") or 0 for m in (
        "perfmon_time_to_first_token_seconds", "perfmon_inter_token_latency_seconds",
        "perfmon_generation_duration_seconds"))
    assert 1000 < histogrammed <= 2000  # (cancelled ends reached the queue but feed no histogram)
    assert dropped["after_finish"] == 0
    nothing_left(mon)


def test_async_stream_outcomes(make_monitor) -> None:
    """An async iterable gives an async generator: ok, error, aclose() and task cancellation each count once."""
    mon = make_monitor().start()

    async def agen(n: int, gap: float = 0.0, fail: bool = False) -> AsyncIterator[int]:
        for i in range(n):
            await asyncio.sleep(gap)
            yield i
        if fail:
            raise Boom("async")

    async def main() -> None:
        assert [i async for i in mon.stream(agen(4), name="a", prompt_tokens=5)] == [0, 1, 2, 3]
        with pytest.raises(Boom):
            async for _ in mon.stream(agen(2, fail=True), name="a"):
                pass
        s = mon.stream(agen(10), name="a")
        async for i in s:
            if i == 1:
                break
        await s.aclose()

        async def slow_consumer() -> None:
            async for _ in mon.stream(agen(100, gap=0.01), name="a"):
                pass

        task = asyncio.ensure_future(slow_consumer())
        await asyncio.sleep(0.05)
        task.cancel()  # a client that went away
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert mon.flush()
    assert requests(mon, "a") == {"ok": 1, "error": 1, "cancelled": 2}
    generated = value(mon, "perfmon_generated_tokens_total", model="a")
    assert generated is not None and generated >= 4 + 2 + 2 + 1
    assert value(mon, "perfmon_prompt_tokens_total", model="a") == 5
    nothing_left(mon)


def test_reset_after_fork_forgets_the_parents_requests(make_monitor) -> None:
    """After a fork the tracker starts empty; a request begun before it ends without touching the new state."""
    mon = make_monitor().start()
    before = mon.generation("f")
    before.token()
    mon.generations.reset_after_fork()
    after = mon.generation("f")
    before.finish()
    assert mon.generations.live() == 1  # the child's own request is still tracked
    after.finish()
    assert mon.generations.live() == 0
    assert requests(mon, "f") == {"ok": 1, "error": 0, "cancelled": 0}
    assert isinstance(after, Generation)


def test_stopped_monitor_counts_but_does_not_time(make_monitor) -> None:
    """After stop() requests and tokens are still counted exactly, and nothing is queued or tracked."""
    mon = make_monitor().start()
    mon.stop()
    assert list(mon.stream(iter(range(4)), name="idle")) == [0, 1, 2, 3]
    assert len(mon.generations.queue) == 0 and mon.generations.live() == 0
    assert value(mon, "perfmon_generated_tokens_total", model="idle") == 4
    assert requests(mon, "idle")["ok"] == 1
    assert value(mon, "perfmon_generation_dropped_total", model="idle", reason="live_limit") == 0


@pytest.mark.prometheus
def test_generation_exposition_passes_promtool(make_monitor) -> None:
    """The generation families, with data in every one, pass `promtool check metrics` without a warning."""
    mon = make_monitor().start()
    with mon.generation("lint", prompt_tokens=3) as g:
        g.token()
        g.token(2)
    with pytest.raises(Boom):
        list(mon.stream(failing(1), name="lint"))
    assert mon.flush()
    result = promtool_check(generate_latest(mon.registry))
    assert result.returncode == 0 and not result.stdout.strip(), (result.stdout + result.stderr).decode()


def test_deferred_work_waits_for_a_drain_or_a_read_and_is_bounded() -> None:
    """``defer(wake=False)``: kept for the resolver's next pass, run by any read before it (names, stats, live), each
    piece once; refused (the caller runs it now) while nothing drains or when a queue's worth waits. Device work
    (``wake=True``) waits for the resolver's drain, whatever reads come first."""
    import threading

    from perfmon.agent.generation import GenerationTracker
    from perfmon.faults import InternalErrors

    running = [True]
    wakes: list[int] = []
    tracker = GenerationTracker(internal=InternalErrors(), timing=lambda: running[0], queue_size=8,
                                wake=lambda: wakes.append(1))
    ran: list[tuple[str, int]] = []
    for read in ("names", "stats", "live", "drain"):
        assert tracker.defer(lambda read=read: ran.append((read, threading.get_ident())), wake=False)
        assert ran == [] and wakes == []  # not run, and the resolver not woken for one piece
        getattr(tracker, read)()
        assert ran == [(read, threading.get_ident())]
        getattr(tracker, read)()
        assert len(ran) == 1  # once
        ran.clear()
    for i in range(8):
        assert tracker.defer(lambda: ran.append(("bound", 0)), wake=False)
        assert len(wakes) == i  # from the second piece on a quarter of 8 waits: each defer wakes the resolver
    assert not tracker.defer(lambda: ran.append(("bound", 0)), wake=False)  # a queue's worth waits: run it now
    tracker.names()
    assert len(ran) == 8
    running[0] = False  # the monitor stopped: no resolver pass is coming
    assert not tracker.defer(lambda: None, wake=False)
    ran.clear()
    assert tracker.defer(lambda: ran.append(("device", 0)))  # wake=True (device values): kept, and wakes
    assert len(wakes) == 8
    tracker.names()
    tracker.stats()
    assert ran == []  # a read never runs device work (it may wait for the device): the resolver's drain does
    tracker.drain()
    assert ran == [("device", 0)]
