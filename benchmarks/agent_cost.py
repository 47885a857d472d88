"""What the running agent costs the serving thread: three variants interleaved in one process.

perfmon's per-call figures (``overhead.py``) are taken with the monitor constructed but not started. A user
runs it started: resolver, HTTP server, health port and uploader threads running, scraped (every 5 s here, charged
at 15 s; the kubelet's probes, one every 10 s in deploy/, are not sent), a trace store configured, regression
detection and the profiler's preparation on (the defaults). On a GIL-bound serving loop every background wake is a
GIL hand-off the serving thread pays for, which no CPU-seconds figure of the agent's own threads shows. So this
times the serving thread itself:

- ``stopped``: the monitor stopped, the bare model;
- ``running, unwrapped``: the monitor running (threads, scraper), the bare model: the background alone;
- ``running, wrapped``: the monitor running, the model wrapped at the default 1% sampling (the same module
  object throughout: wrapped and unwrapped between variants).

Each round runs every variant once in a shuffled order (they share the machine's noise); the figure is
the median over rounds of each variant's time per call divided by the same round's ``stopped`` one, with
the 25th-75th percentiles. Then a ``generate()`` of one tiny random GPT-2 wrapped vs unwrapped, with a second
unwrapped variant as the A/A (µs per generated token, quantile differences, and what the resolver spends draining
a request's records, per token), and the per-call cost on Linear(64, 64), both with the monitor running. Agent threads'
wakes per second (voluntary context switches, which include waits for the GIL) are read from /proc.

The percentages above are differences of ~1 s timings on a shared host, spread ±2-7% even in a quiet hour: a
±0.1% target cannot be read off them. So the background's cost is also given as a bound built from figures the
host's noise cannot hide: a fourth variant runs the stopped loop beside a plain thread waking every 1 ms (a large
effect, ~+5%), which prices one background switch in serving time; each agent thread's cost is then at most its
switches (wakes and GIL waits, from /proc) times that price plus the CPU time it spent beyond the calibration thread's
own CPU a switch (work it could do holding the GIL), over the time the loop ran in that variant. The HTTP thread's
work is the scrapes (idle, it sleeps until a socket): its cost a scrape, over the scrapes that fell in the running
variants, is charged at one every 15 s. The wrapped model's bound adds the per-call path measured on Linear(64, 64)
(the difference of the minima: noise only adds to a time) over the loop's time a call. The scraper is a child
process, as Prometheus is another process: a scraping thread in this one would charge its own GIL time to the agent.
The bound assumes an agent thread's switch costs the serving thread what a do-nothing thread's does; the cache its
work evicts is not priced beyond that. So the background is also measured with no such model (``common.gil_stalls``,
as ``make gpu-check`` judges it): a pure-Python loop that never lets go of the GIL, beside the monitor running and
stopped, reports the time it stood still; running minus stopped, with a scrape's charged at one every 15 s.

    python benchmarks/agent_cost.py [--rounds 24] [--calls 3000] [--json out.json]

Not a test: read ratios, on a quiet machine.
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.util
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from common import (
    Running,
    ScraperProcess,
    ThreadTally,
    Waker,
    Wrapping,
    agent_threads,
    background_share,
    dump,
    flops_counted,
    free_port,
    machine,
    probe_background,
    settle_calls,
    table,
    thread_cost,
    thread_deltas,
)
from prometheus_client import CollectorRegistry

import perfmon


def gil_bound_model() -> torch.nn.Module:
    """40 x (Linear(32, 32) + ReLU) at batch 4, one torch thread: ~330 µs a call, nearly all of it Python and
    dispatch under the GIL (each op releases and re-takes it)."""
    return torch.nn.Sequential(*[m for _ in range(40) for m in (torch.nn.Linear(32, 32), torch.nn.ReLU())]).eval()


def time_calls(fn: Callable[[], Any], calls: int) -> float:
    """Seconds per call of ``fn`` over ``calls`` calls (GC off, as a serving loop between collections)."""
    gc.disable()
    try:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t0) / calls
    finally:
        gc.enable()


def pct(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return q[0], statistics.median(values), q[2]


def generate_cost(mon: perfmon.Monitor, rounds: int, new: int = 32) -> dict[str, Any]:
    """µs a generated token that wrapping a tiny GPT-2 adds to its ``generate()``, the monitor running.

    One model, wrapped and unwrapped between variants (``Monitor.unwrap`` restores its class): a twin copy puts
    its weights elsewhere in memory, a difference of its own (two bare twins differed by ±9 µs a token; the same
    model unwrapped twice, the A/A here, by ±3). Each round runs the variants (bare, bare again for the A/A,
    wrapped) in a shuffled order, each ``common.settle_calls`` ``generate()`` calls after its switch (its cold calls, a
    new wrap's first request timed in full, the interpreter's attribute caches specialised again for the model's
    class) and one measured. A request's time only gains from noise, so the figures are
    differences of the variants' quantiles (q10, q25, the median) over the rounds, per token, beside the same for
    the A/A. Then what the resolver spends draining a request's records (its TTFT, its inter-token gaps, its end),
    per token: on a GIL-bound server that is the serving thread's time too, and the interleaved rounds see it only
    when a tick falls inside one.
    """
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    transformers.logging.set_verbosity_error()
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=128, bos_token_id=0,
                     eos_token_id=1)
    model = GPT2LMHeadModel(cfg).eval()
    variants = ("bare", "bare again (A/A)", "wrapped")
    ids = torch.randint(2, 1000, (1, 8))
    kw = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False, "pad_token_id": 0}
    wrapping = Wrapping(mon, model, "gpt2_tiny")
    settle = settle_calls(new)

    def run(variant: str) -> float:
        wrapping.set(variant == "wrapped")
        gc.disable()
        try:
            with torch.inference_mode():
                for _ in range(settle):  # after the switch: not measured (common.SETTLE_EXECUTIONS)
                    model.generate(ids, **kw)
                t0 = time.perf_counter_ns()
                model.generate(ids, **kw)
                return (time.perf_counter_ns() - t0) / 1e3
        finally:
            gc.enable()

    for _ in range(3):
        for variant in variants:
            run(variant)
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(rounds):
        order = list(variants)
        random.shuffle(order)
        for k in order:
            times[k].append(run(k))
    # What the resolver (or any reader) runs for the untimed calls, ~99%: each LateCall's opening and settling handed
    # over by the request thread (the calls' own, not a synthetic request), then the drain of their records, timed
    # together, a batch of 100 calls, as the resolver would run them, divided by the requests the batch settled (its
    # ``_close`` works: one a call). Each call's works are taken as it returns: the resolver's own pass (every second)
    # would otherwise run most of a batch first. The least of six batches: the work, without the host's stalls.
    wrapping.set(True)
    tracker = mon.generations
    late: list[tuple[float, float, float]] = []  # (µs a request: the works, the drain, both), a batch each
    with torch.inference_mode():
        for _ in range(settle):
            model.generate(ids, **kw)
        tracker.settle_pending()
        tracker.drain()
        for _ in range(6):
            works = []
            for _ in range(100):
                model.generate(ids, **kw)
                while True:  # taken as each call returns, before the resolver's tick (a second) does: run below
                    try:
                        works.append(tracker.pending.popleft())
                    except IndexError:
                        break
            requests = sum(getattr(w, "__name__", "") == "_close" for w in works)
            if not requests:
                continue
            gc.disable()
            try:
                t0 = time.perf_counter_ns()
                for w in works:
                    w()
                t1 = time.perf_counter_ns()
                tracker.drain()
                t2 = time.perf_counter_ns()
            finally:
                gc.enable()
            late.append(((t1 - t0) / 1e3 / requests, (t2 - t1) / 1e3 / requests, (t2 - t0) / 1e3 / requests))
    wrapping.set(False)
    for v in times.values():
        v.sort()
    qs = {"q10": 0.10, "q25": 0.25, "median": 0.5}
    bare = times["bare"]
    rows, result = [], {"bare_us_per_token": bare[len(bare) // 2] / new, "rounds": rounds, "tokens": new}
    for k in variants[1:]:
        added = {q: (times[k][int(f * rounds)] - bare[int(f * rounds)]) / new for q, f in qs.items()}
        rows.append([k, *(f"{v:+.2f}" for v in added.values())])
        result[k] = added
    # The resolver's share for a timed call: settle requests like these (what a returned timed generate() call hands
    # over: its token times and end) and drain their records (a TTFT, 31 gaps, an end), timed together.
    for kind, timed in (("a timed", True),):
        drain = []
        for _ in range(5):
            starts = [tracker.start("gpt2_tiny_drain") for _ in range(200)]
            t0 = time.perf_counter_ns()
            for g in starts:
                s = g.start_ns
                times = [s + 800_000 * (i + 1) for i in range(new)] if timed else []
                tracker.settle(g, times, None, len(times), new, 8)
                tracker.finish_at(g, "ok", s + 800_000 * (new + 1))
            tracker.drain()
            drain.append((time.perf_counter_ns() - t0) / 1e3 / 200 / new)
        result[f"resolver_{kind.split()[-1]}_us_per_token"] = min(drain)
        rows.append([f"the resolver's settling and drain, {kind} call", "", "", f"+{min(drain):.2f}"])
    least = min(late, key=lambda parts: parts[2]) if late else (0.0, 0.0, 0.0)
    untimed = least[2] / new
    result["resolver_untimed_us_per_token"] = untimed
    result["resolver_untimed_parts_us_per_request"] = {"works": least[0], "drain": least[1], "batches": len(late)}
    rows.append(["the resolver's opening, settling and drain, an untimed call (its own)", "", "", f"+{untimed:.2f}"])
    # What the user's serving thread pays on a GIL-bound server: the request thread's part and the reader's (~99% of
    # calls untimed; a timed call's drain is the row above, 1 in 100).
    total = {q: v + untimed for q, v in result["wrapped"].items()}
    result["wrapped_with_resolver"] = total
    rows.append(["wrapped + the resolver's share (untimed)", *(f"{v:+.2f}" for v in total.values())])
    print(f"\ngenerate(), tiny GPT-2 (2 layers, d=64), {new} new tokens, 1% sampling, monitor running, {rounds} "
          f"rounds: bare {result['bare_us_per_token']:.1f} µs/token; µs a token added (quantile differences):\n")
    print(table(["variant", "q10", "q25", "median"], rows))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=24)
    ap.add_argument("--calls", type=int, default=3000, help="calls per variant per round (~1 s)")
    ap.add_argument("--gen-rounds", type=int, default=120)
    ap.add_argument("--probe-rounds", type=int, default=10, help="rounds of the GIL-stall probe (1.5 s a variant)")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    tmp = tempfile.mkdtemp(prefix="perfmon-agent-cost-")
    port = free_port()  # fixed: the scraper (another process, as Prometheus is) finds it after every restart
    # The health port as deploy/ sets it (its thread is one of the agent's: charged below like the others).
    mon = perfmon.Monitor(port=port, host="127.0.0.1", log_level="error", registry=CollectorRegistry(),
                          health_port=free_port(), trace_dir=f"{tmp}/traces",
                          trace_store=f"file://{tmp}/store")  # the rest: the defaults
    # One module, wrapped and unwrapped between variants (Monitor.unwrap restores its class): a twin copy
    # would put its weights elsewhere in memory, a difference of its own (an A/A of two copies: ±0.5%).
    model = gil_bound_model()
    x = torch.randn(4, 32)
    lin = torch.nn.Linear(64, 64).eval()  # wrapped and unwrapped between rounds, as the GIL-bound model is
    x1 = torch.randn(1, 64)
    mon.start()
    # Every 5 s, so that enough scrapes fall in the running variants to price one (at 15 s a short run saw none); the
    # bound below charges them at Prometheus' 15 s, and the timed variants see 3x production's scrapes (conservative).
    scraper = ScraperProcess(f"http://127.0.0.1:{port}", period=5.0)

    def call() -> Any:
        with torch.inference_mode():
            return model(x)

    set_wrapped = Wrapping(mon, model, "gil_bound").set

    for want in (True, False, True, False):  # warm both paths and the monitor's cold calls
        set_wrapped(want)
        time_calls(call, 300)
    set_wrapped(True)
    once = flops_counted(mon, lambda: time_calls(call, 100))  # the signature's one-time FLOP count, before the steady
    set_wrapped(False)
    print(f"The signature's FLOP count, once, off the request thread: {once['seconds'] * 1e3:.1f} ms "
          f"({'done' if once['settled'] else 'not done'} after {once['waited']:.1f} s of calls); not in the figures "
          "below.")
    running = Running(mon)
    calibrate = "stopped, a thread waking every 1 ms"
    per: dict[str, list[float]] = {"stopped": [], "running, unwrapped": [], "running, wrapped": [], calibrate: []}
    tally = ThreadTally()  # the agent's threads while the loop ran with the monitor running, by variant
    windows: list[tuple[float, float]] = []  # time.time() spans of the running variants (the scrapes they saw)
    per_switch: list[float] = []  # serving ns lost per switch of the calibration thread, a round each
    cpu_per_switch: list[float] = []  # the calibration thread's own CPU ns per switch (a wake's kernel work)
    for _ in range(args.rounds):
        order = list(per)
        random.shuffle(order)
        waker_switches = waker_cpu = 0
        for variant in order:
            if running.set(variant.startswith("running")):
                time.sleep(0.2)  # threads settled
            set_wrapped(variant == "running, wrapped")
            waker = Waker() if variant == calibrate else None
            prefix = "bench-waker" if waker is not None else "perfmon"
            t0, w0, before = time.perf_counter(), time.time(), agent_threads(prefix)
            per[variant].append(time_calls(call, args.calls))
            after = agent_threads(prefix)
            moved = thread_deltas(before, after)
            if waker is not None:
                waker.stop()
                waker_switches = sum(d[0] for d in moved.values())
                waker_cpu = sum(d[1] for d in moved.values())
            if running.running:  # the agent's threads while the loop ran (wrapped: its drains are the resolver's too)
                windows.append((w0, time.time()))
                tally.add(variant, moved, time.perf_counter() - t0)
        if waker_switches:
            per_switch.append((per[calibrate][-1] - per["stopped"][-1]) * args.calls * 1e9 / waker_switches)
            cpu_per_switch.append(waker_cpu / waker_switches)
    set_wrapped(False)
    running.set(True)
    rows, out = [], {"machine": machine(), "calls": args.calls, "rounds": args.rounds, "flop_count_once": once}
    stopped = per["stopped"]
    for variant, vals in per.items():
        ratios = [v / s for v, s in zip(vals, stopped)]
        lo, med, hi = pct(ratios)
        diff = statistics.median(v - s for v, s in zip(vals, stopped)) * 1e6
        rows.append([variant, f"{statistics.median(vals) * 1e6:.1f}", f"{diff:+.2f}",
                     f"{(med - 1) * 100:+.2f}%", f"{(lo - 1) * 100:+.2f}..{(hi - 1) * 100:+.2f}%"])
        out[variant] = {"us_per_call": statistics.median(vals) * 1e6, "ratio_p25": lo, "ratio": med, "ratio_p75": hi}
    print(f"# Agent cost with its threads running ({machine()})\n")
    print(f"GIL-bound loop: 40 x (Linear(32,32)+ReLU), batch 4, {args.calls} calls a variant, {args.rounds} "
          "interleaved rounds\n")
    print(table(["variant", "µs/call", "added µs (median)", "vs stopped", "p25..p75"], rows))

    # generate(): one tiny random GPT-2, wrapped at 1% vs unwrapped (and unwrapped again: the A/A), the monitor
    # running (its resolver drains the requests' records at its 1 s tick, on the serving thread's GIL).
    if importlib.util.find_spec("transformers") is None:
        print("\n(transformers not installed: generate() skipped)")
    else:
        out["generate"] = generate_cost(mon, args.gen_rounds)
        # The same with one new token: what a request costs apart from its tokens (opening and settling it, the
        # prefill's stage and signature), so the per-token figure above splits into a request's share and a step's.
        one = out["generate_one_token"] = generate_cost(mon, 2 * args.gen_rounds, new=1)
        many, n = out["generate"], out["generate"]["tokens"]
        split = {q: (one["wrapped"][q], (many["wrapped"][q] * n - one["wrapped"][q]) / (n - 1))
                 for q in ("q10", "q25")}
        out["generate_split"] = {q: {"request_us": a, "token_us": b} for q, (a, b) in split.items()}
        print(f"\nSo a request adds {split['q10'][0]:+.1f} / {split['q25'][0]:+.1f} µs (q10 / q25) and each token "
              f"after its first {split['q10'][1]:+.2f} / {split['q25'][1]:+.2f}: at {n} tokens the request's share "
              f"is {split['q25'][0] / n:+.2f} µs a token.")

    # The per-call hot path on a tiny model, the monitor running.
    linear = Wrapping(mon, lin, "linear64")  # one module, not a bare and a wrapped copy (Wrapping)
    lb, lw = [], []
    for want in (True, False, True):  # the wrapped class's first calls (its signature's cold calls) and both paths warm
        linear.set(want)
        with torch.inference_mode():
            time_calls(functools.partial(lin, x1), 2000)
    with torch.inference_mode():
        flops_counted(mon, lambda: time_calls(functools.partial(lin, x1), 2000))  # its one-time count, not the path
    for _ in range(args.rounds):
        order = ["bare", "wrapped"]
        random.shuffle(order)
        for name in order:
            linear.set(name == "wrapped")
            # Under one inference_mode (a per-call context manager costs ~1 µs, noise around a ~0.4 µs difference).
            with torch.inference_mode():
                (lb if name == "bare" else lw).append(time_calls(functools.partial(lin, x1), 20000))
    linear.set(False)
    diffs = [(w - b) * 1e9 for w, b in zip(lw, lb)]
    lo, med, hi = pct(diffs)
    # The minimum of each, a difference noise cannot make smaller than the path's cost: it only adds to a time.
    least = (min(lw) - min(lb)) * 1e9
    print(f"\nLinear(64,64) batch 1, 1% sampling, monitor running: bare {statistics.median(lb) * 1e9:.0f} ns, "
          f"added **{med:+.0f} ns/call** (p25..p75 {lo:+.0f}..{hi:+.0f}); by the minima of {len(lw)} rounds "
          f"**{least:+.0f} ns/call**")
    out["linear64"] = {"bare_ns": statistics.median(lb) * 1e9, "added_ns": med, "p25": lo, "p75": hi,
                       "added_ns_by_minima": least}

    # The background measured directly, as the GPU check does: a loop that never lets go of the GIL (the worst case of
    # a GIL-bound serving thread) beside the monitor running and stopped; its stalls count whatever the agent's threads
    # take from it, with no model of what a switch costs.
    probed = probe_background(running.set, args.probe_rounds, 1.5)
    running.set(True)

    # The background's cost as a bound the host's noise cannot hide: each agent thread's switches (wakes and GIL
    # waits) times what one switch of a do-nothing thread costs the serving loop (the calibration variant, a large
    # effect: resolvable at this noise), plus the CPU time it spent beyond what such a switch spends (time it could
    # hold the GIL doing work; a do-nothing wake's own ~100 µs of kernel and scheduler CPU is in the first term).
    lost_ns = statistics.median(per_switch) if per_switch else float("nan")
    wake_cpu_ns = statistics.median(cpu_per_switch) if cpu_per_switch else 0.0
    stopped_us = statistics.median(stopped) * 1e6
    linear = out["linear64"]["added_ns_by_minima"]
    scraper.stop()
    print(f"\nscrapes (a child process, every 5 s): {scraper.scrapes}")
    out["scrapes"] = scraper.scrapes

    def cost(switches: int, cpu: int) -> tuple[float, float]:
        return thread_cost(switches, cpu, lost_ns, wake_cpu_ns)

    print(f"\nThe agent's threads as a bound, while the loop ran with the monitor running (one switch of a do-nothing "
          f"thread cost the loop {lost_ns / 1e3:.1f} µs, median of {len(per_switch)} rounds, p25..p75 "
          f"{pct(per_switch)[0] / 1e3:.1f}..{pct(per_switch)[2] / 1e3:.1f}, and {wake_cpu_ns / 1e3:.1f} µs of its own "
          f"CPU):\n")
    rows, bounds = [], {}
    for variant, threads in tally.by_slot.items():
        seconds = max(tally.seconds[variant], 1e-9)
        bound = 0.0
        for name, (switches, cpu) in sorted(threads.items()):
            work, total = cost(switches, cpu)
            share = total / (seconds * 1e9)
            if name != "perfmon-http":  # its work is the scrapes, charged below at Prometheus' cadence
                bound += share
            rows.append([variant, name, switches, f"{switches / seconds:.2f}", f"{cpu / seconds / 1e3:.1f}",
                         f"{work / seconds / 1e3:.1f}", f"{share * 100:.4f}%"])
        bounds[variant] = bound
        out.setdefault("wakes_per_second", {})[variant] = {k: v[0] / seconds for k, v in threads.items()}
        out.setdefault("cpu_us_per_second", {})[variant] = {k: v[1] / seconds / 1e3 for k, v in threads.items()}
    print(table(["variant", "thread", "switches", "per second", "CPU µs/s", "beyond a do-nothing wake, µs/s",
                 "bound: (switches x cost + CPU beyond) / time"], rows))
    # The HTTP thread's work is the scrapes (idle, it sleeps until a socket): its cost a scrape, over the scrapes
    # that fell in the running variants, charged at one scrape every 15 s (a free-running scraper hits a variant's
    # ~25 s only a couple of times: too few to read its share from the variant alone).
    seen = sum(1 for t in scraper.times if any(a <= t <= b for a, b in windows))
    http = [threads.get("perfmon-http", [0, 0]) for threads in tally.by_slot.values()]
    per_scrape = cost(sum(h[0] for h in http), sum(h[1] for h in http))[1] / seen if seen else float("nan")
    scrape_share = per_scrape / 15e9
    print(f"\nA scrape cost the HTTP thread {per_scrape / 1e3:.0f} µs (switches at their price and CPU beyond, over "
          f"the {seen} scrapes that fell in the running variants): {scrape_share * 100:.4f}% at one every 15 s")
    background = bounds["running, unwrapped"] + scrape_share
    wrapped_bound = bounds["running, wrapped"] + scrape_share + linear / (stopped_us * 1e3)
    print(f"\nbackground bound (running, unwrapped, with the scrapes): **{background * 100:+.4f}%** (target ≤ +0.1%); "
          f"wrapped bound (its threads, with the drains of its samples, the scrapes, and the per-call path measured on "
          f"Linear(64,64), {linear:+.0f} ns, over {stopped_us:.0f} µs a call): **{wrapped_bound * 100:+.3f}%** "
          f"(target ≤ +0.3%)")
    out["serving_ns_per_scrape"] = per_scrape
    out["serving_ns_per_switch"] = lost_ns
    out["wake_cpu_ns_per_switch"] = wake_cpu_ns
    out["background_bound"] = background
    out["wrapped_bound"] = wrapped_bound
    probe = background_share(probed, scraper.times)
    print(f"\nThe same, measured: a loop holding the GIL stood still {probe['running'] * 1e3:.2f} ms a second with the "
          f"monitor running (apart from scrapes), {probe['stopped'] * 1e3:.2f} stopped, and "
          f"{probe['per_scrape'] / 1e6:.2f} ms a scrape ({probe['scrapes']} seen), charged at one every 15 s: "
          f"**{probe['background'] * 100:+.4f}%** ({args.probe_rounds} rounds of 1.5 s a variant)")
    out["background_probe"] = probe
    mon.stop()
    dump(args.json, out)


if __name__ == "__main__":
    main()
