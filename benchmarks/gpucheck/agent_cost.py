"""The agent's cost with its threads running, on the GPU: ``benchmarks/agent_cost.py``'s variants.

The overhead check times a quiet monitor (no HTTP, no detector, never started). A user runs it started:
resolver, HTTP server and detector threads, NVML, a trace store, a scrape every 15 s. This times the serving
thread of a launch-bound bf16 encoder (1x32x512: the host sets its pace, so every GIL hand-off to a
background thread shows) wrapped at the default 1% against unwrapped with the monitor running, and running
against stopped with the module unwrapped (the background alone), each with an A/A slot for the noise
floor (``check_agent_cost``). Then ``generate()`` of a tiny random GPT-2 on the GPU, wrapped at 1% against a
bare twin, and the bare twin with a do-nothing streamer (Hugging Face copies each step's tokens to the host
for any streamer: the part of perfmon's per-token cost that its tap causes), in µs per generated token.
"""

from __future__ import annotations

import copy
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from prometheus_client import CollectorRegistry

from perfmon import Monitor
from perfmon.telemetry.nvml import NvmlPoller

from ..common import (
    SETTLE_EXECUTIONS,
    Running,
    ScraperProcess,
    ThreadTally,
    Wrapping,
    agent_threads,
    background_share,
    flops_counted,
    free_port,
    poll_schedule,
    poll_stall,
    probe_background,
    quiet_ratio_bounds,
    thread_deltas,
)
from .common import Check, Figure, encoder
from .rig import Rig

__all__ = ["check_agent_cost"]


class _NullStreamer:
    """A streamer that keeps nothing (what a caller's own streamer costs before it does any work)."""

    def put(self, value: Any) -> None:
        pass

    def end(self) -> None:
        pass


def _ratios(per: dict[str, list[float]], base: str) -> dict[str, tuple[float, float, float, float, float]]:
    """variant -> (p25, median, p75 of the per-round ratio to ``base``, median added seconds, the ratio of the
    two variants' 10th-percentile blocks: the quiet blocks, which a host whose clock wanders by ±10% a block
    leaves comparable where the per-round ratio is not)."""
    out = {}
    for key, vals in per.items():
        if key == base:
            continue
        r = [v / b for v, b in zip(vals, per[base], strict=True)]
        q = statistics.quantiles(r, n=4) if len(r) > 1 else [r[0]] * 3
        p10 = (statistics.quantiles(vals, n=10)[0] / statistics.quantiles(per[base], n=10)[0]
               if len(vals) > 1 else r[0])
        out[key] = (q[0], statistics.median(r), q[2],
                    statistics.median(v - b for v, b in zip(vals, per[base], strict=True)), p10)
    return out


def _load_gpt2() -> Any:
    """transformers, with GPT-2's model class resolved now (its lazy import, before any monitor thread runs);
    None when it cannot be had."""
    try:
        import transformers

        transformers.GPT2LMHeadModel  # noqa: B018 (resolves the lazy module)
    except Exception:
        return None
    return transformers


def _generate(rig: Rig, mon: Monitor, rounds: int, transformers: Any) -> dict[str, Figure]:
    if transformers is None:
        return {"generate": ("transformers (GPT-2) cannot be imported", "")}
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=128,
                                  bos_token_id=0, eos_token_id=1)
    bare = transformers.GPT2LMHeadModel(cfg).eval().cuda()
    wrapped: Any = mon.wrap(copy.deepcopy(bare), name="gpt2_tiny")
    ids = torch.randint(2, 1000, (1, 8), device="cuda")
    new = 32
    kw = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False, "pad_token_id": 0,
          "attention_mask": torch.ones_like(ids)}
    runs: dict[str, Callable[[], Any]] = {
        "bare": lambda: bare.generate(ids, **kw),
        "bare + streamer": lambda: bare.generate(ids, streamer=_NullStreamer(), **kw),
        "wrapped": lambda: wrapped.generate(ids, **kw),
    }

    def per_token(fn: Callable[[], Any], n: int) -> float:
        rig.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        rig.synchronize()
        return (time.perf_counter() - t0) / (n * new)

    per: dict[str, list[float]] = {k: [] for k in runs}
    with torch.inference_mode():
        for fn in runs.values():
            per_token(fn, 3)
        order = list(runs)
        for _ in range(rounds):
            random.shuffle(order)
            for key in order:
                per[key].append(per_token(runs[key], 1))  # short blocks, many rounds
    r = _ratios(per, "bare")
    return {"gen_bare_per_token": (statistics.median(per["bare"]) * 1e6, "µs"),
            "gen_added_wrapped": (r["wrapped"][3] * 1e6, "µs/token"),
            "gen_ratio_wrapped": (r["wrapped"][1], "1"),
            "gen_ratio_wrapped_quiet_blocks": (r["wrapped"][4], "1"),
            "gen_ratio_streamer_quiet_blocks": (r["bare + streamer"][4], "1"),
            "gen_ratio_wrapped_p25_p75": (f"{r['wrapped'][0]:.4f}..{r['wrapped'][2]:.4f}", "1"),
            "gen_ratio_streamer_p25_p75": (f"{r['bare + streamer'][0]:.4f}..{r['bare + streamer'][2]:.4f}", "1"),
            "gen_added_streamer": (r["bare + streamer"][3] * 1e6, "µs/token"),
            "gen_rounds": (rounds, "")}


def _wakes(mon: Monitor) -> dict[str, float]:
    """thread -> the agent's own ``perfmon_agent_wakeups_total`` (what an operator alerts on)."""
    return {s.labels["thread"]: s.value for f in mon.registry.collect() for s in f.samples
            if s.name == "perfmon_agent_wakeups_total"}


def _per_call(rig: Rig, model: Any, x: Any, calls: int) -> float:
    """Seconds a call of ``model(x)``, over ``calls`` calls between two waits for the device."""
    rig.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        model(x)
    rig.synchronize()
    return (time.perf_counter() - t0) / calls


def _path_ns(rig: Rig, mon: Monitor, dtype: torch.dtype, rounds: int) -> float:
    """ns a call the wrapper adds on this host, at 1%: a tiny Linear(64, 64) on the device (its launch sets the
    pace), the same module wrapped and unwrapped between blocks of 1,000 calls, by the difference of the two
    variants' fastest blocks (noise only adds to a block's time; the path's cost does not depend on the model)."""
    lin = torch.nn.Linear(64, 64).to(rig.device, dtype).eval()
    x = torch.randn(1, 64, device=rig.device, dtype=dtype)
    best = {"bare": float("inf"), "wrapped": float("inf")}
    wrapping = Wrapping(mon, lin, "linear64", device=rig.device,
                        settle=lambda: _per_call(rig, lin, x, SETTLE_EXECUTIONS))
    with torch.inference_mode():
        wrapping.set(True)
        flops_counted(mon, lambda: _per_call(rig, lin, x, 100))  # its signature's one-time count: not the path
        for _ in range(rounds):
            for slot in random.sample(list(best), 2):
                wrapping.set(slot == "wrapped")
                best[slot] = min(best[slot], _per_call(rig, lin, x, 1000) * 1e9)
        wrapping.set(False)
    return best["wrapped"] - best["bare"]


def _sampled_cuda_ns(rig: Rig, calls: int = 2000, pairs: int = 64) -> float:
    """ns of the CUDA runtime calls a timed call makes on the request thread (``ModelState.begin``/``finish``: is
    the stream capturing, the current stream, an event pair's two records), through perfmon's backend, less an
    empty loop's: what 1 call in 1/sample_rate adds to ``_path_ns`` beyond the CPU path, on this host's driver.
    The resolver's ``query``/``elapsed_time`` are its thread's, not the caller's."""
    backend = rig.backend
    index = 0
    made = [(backend.new_event(), backend.new_event()) for _ in range(pairs)]
    rig.synchronize()
    best = {"calls": float("inf"), "empty": float("inf")}
    for _ in range(5):
        for key in random.sample(list(best), 2):
            t0 = time.perf_counter_ns()
            for k in range(calls):
                start, end = made[k % pairs]
                if key == "calls":
                    backend.is_capturing(index)
                    stream = backend.current_stream(index)
                    start.record(stream)
                    end.record(stream)
            best[key] = min(best[key], (time.perf_counter_ns() - t0) / calls)
            rig.synchronize()
    return best["calls"] - best["empty"]


def _nvml_poll(rounds: int, seconds: float) -> dict[str, float]:
    """What an NVML poll of this host's GPUs costs a loop holding the GIL (ns, ``common.poll_stall``), and the polls
    a second the poller makes for a Prometheus scraping every 15 s; empty without NVML."""
    poller = NvmlPoller()
    try:
        if not poller.poll():  # the lookups (handles, UUIDs, static fields) are the first poll's
            return {}
        got = poll_stall(poller.poll, rounds=rounds, seconds=seconds)
    finally:
        poller.stop()
    return {"per_poll_ns": max(0.0, got["per_poll_ns"]), "polls": got["polls"],
            "per_s": poll_schedule([7.0 + 15 * k for k in range(240)])["per_s"]}


def check_agent_cost(rig: Rig, *, quick: bool = False) -> Check:
    """Serving-thread time of a launch-bound bf16 encoder (1x32x512) with the monitor running, as users run it.

    Two parts, each interleaved in short blocks (40 calls, ~60 ms: the lent host's clock wanders by ±15% over
    seconds, so long blocks measure the host, not perfmon; the first try, 0.7 s blocks, had a bare-vs-bare
    p25..p75 of x0.88..x1.15):

    - **wrapped**: the monitor running throughout (threads, a child process scraping every 5 s), the same module
      unwrapped, unwrapped again (the noise floor) and wrapped at 1%, in a shuffled order every round; a switch
      between wrapped and unwrapped is followed by ``SETTLE_EXECUTIONS`` unmeasured calls;
    - **background**: the monitor stopped, stopped again (the noise floor) and running with the module unwrapped,
      in a shuffled order; each slot starts with the switch (or none), a 0.5 s settle and an unrecorded block, then
      several recorded blocks.

    Two direct figures per comparison: the median over rounds of each slot's mean time per call divided by the
    same round's reference slot (with p25..p75), and the ratio of the two slots' 10th-percentile blocks (the quiet
    blocks). On the lent hosts so far their A/A moved by ±0.5-6%, wider than the x1.005 target. So the verdict is
    a bound built from figures that noise cannot hide:

    - **the background's GIL time**: a pure-Python loop that never lets go of the GIL (``common.gil_stalls``, the
      worst case of a GIL-bound serving thread) beside the monitor running and stopped, shuffled: the time it
      stood still over 20 µs at a time, running minus stopped, the median over rounds (``common.background_share``:
      a scrape's stalls apart, charged at one every 15 s; the scraper calls every 5 s so that several fall in the
      running slots). It counts whatever the agent's threads take (their GIL holds and each hand-off) and nothing
      of the host's speed wandering, which changes the loop's pace, not its gaps;
    - **NVML polls**, priced apart (a probe slot, 2 s after a restart, holds none: the next poll is at least an
      interval after the start's): the same loop beside a thread polling the real NVML every 0.2 s against none
      (``common.poll_stall``), per poll, at the poller's own rate for a Prometheus scraping every 15 s
      (``common.poll_schedule``: one poll a scrape);
    - **the request path**: ``_path_ns``, by minima, over the encoder's time a call (reported split: the timed
      calls' CUDA runtime calls, ``_sampled_cuda_ns`` at the sampling rate, and the rest; session 28's H200 read
      +456..+1,448 ns a call where the CPU host reads ~220);
    - **the samples' work**: the agent threads' CPU a second in the wrapped slots beyond the unwrapped ones
      (the resolver resolving the 1% sample's events), all of it counted as if it held the GIL. The signature's
      FLOP count, a one-time cost, is done before (``common.flops_counted``) and reported apart
      (``flop_count_once``).

    Pass: background ≤ +0.1% and wrapped ≤ +0.5% (x1.005), and neither quiet-block ratio's 95% lower bound (a
    bootstrap over the slots, ``common.quiet_ratio_bounds``) above x1.005: the direct timing overrules the bounds
    only where it shows a slowdown past the target whatever the host's noise.
    The generate() figures are reported, not judged (a tiny model on a shared host's clock).
    """
    if not rig.real:
        return Check("agent_cost", "skip", "needs a real GPU")
    dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    model = encoder(dtype)
    x = torch.randn(1, 32, 512, device=rig.device, dtype=dtype)
    hf = _load_gpt2()
    n = 40
    rounds_w, rounds_b, blocks_b = (10, 3, 2) if quick else (120, 16, 8)
    rounds_p, probe_s = (2, 0.5) if quick else (10, 1.5)
    with tempfile.TemporaryDirectory(prefix="perfmon-gpucheck-") as tmp:
        port = free_port()  # fixed: the scraper (another process, as Prometheus is) finds it after every restart
        # The health port as deploy/ sets it: its thread is charged like the agent's others.
        mon = Monitor(registry=CollectorRegistry(), cuda=rig.backend, port=port, host="127.0.0.1", log_level="error",
                      log_format="json", health_port=free_port(), trace_dir=f"{tmp}/traces",
                      trace_store=f"file://{tmp}/store")
        set_wrapped = Wrapping(mon, model, "encoder", device=rig.device,
                               settle=lambda: _per_call(rig, model, x, SETTLE_EXECUTIONS)).set

        def block() -> float:
            return _per_call(rig, model, x, n)

        def watched(slot: str, prefix: str = "perfmon") -> float:
            """One block, the threads named ``prefix`` read around it into ``threads``."""
            before = agent_threads(prefix)
            t = block()
            threads.add(slot, thread_deltas(before, agent_threads(prefix)), t * n)
            return t

        mon.start()
        scraper = ScraperProcess(f"http://127.0.0.1:{port}", period=5.0, limit=1800.0)
        running = Running(mon)
        per_w: dict[str, list[float]] = {"unwrapped": [], "unwrapped again": [], "wrapped": []}
        per_b: dict[str, list[float]] = {"stopped": [], "stopped again": [], "running": []}
        threads = ThreadTally()
        wakes: dict[str, float] = {}  # the agent's own perfmon_agent_wakeups_total over the running slots
        try:
            with torch.inference_mode():
                for want in (True, False, True, False):  # cuBLAS, kernels, the monitor's cold calls
                    set_wrapped(want)
                    block()
                # The signature's FLOP count, once, before the steady state is measured (a 4-layer encoder's fake
                # copy and forward: tens of ms on the counting thread; the H200's first run read it, in the wrapped
                # slots, as +0.75% of "the samples' work").
                set_wrapped(True)
                once = flops_counted(mon, block)
                set_wrapped(False)
                for _ in range(rounds_w):
                    order = list(per_w)
                    random.shuffle(order)
                    for slot in order:
                        set_wrapped(slot == "wrapped")
                        per_w[slot].append(watched(slot))
                set_wrapped(False)
                for _ in range(rounds_b):
                    order = list(per_b)
                    random.shuffle(order)
                    for slot in order:
                        want = slot == "running"
                        running.set(want)
                        time.sleep(0.5)  # threads settled: a start's own work is not the steady cost
                        block()
                        own = _wakes(mon)
                        # paired with the other slots' blocks by index
                        per_b[slot].extend(watched(slot) for _ in range(blocks_b))
                        if want:
                            for k, v in _wakes(mon).items():
                                wakes[k] = wakes.get(k, 0.0) + v - own.get(k, 0.0)
            # The background's GIL time, seen by a loop that never lets go of it.
            probed = probe_background(running.set, rounds_p, probe_s)
            running.set(False)
            nvml = _nvml_poll(rounds_p, probe_s)
            running.set(True)
            path_ns = _path_ns(rig, mon, dtype, 8 if quick else 40)
            try:
                cuda_ns: float | None = _sampled_cuda_ns(rig)
            except Exception:  # a figure that explains the path; the check stands without it
                cuda_ns = None
            try:
                gen = _generate(rig, mon, 4 if quick else 60, hf)
            except Exception as exc:  # the encoder's figures stand without it
                cause = exc.__cause__ or exc.__context__
                gen = {"generate": (f"raised {exc!r}" + (f" from {cause!r}" if cause else ""), "")}
        finally:
            scraper.stop()
            mon.stop()
    rw, rb = _ratios(per_w, "unwrapped"), _ratios(per_b, "stopped")
    call_ns = statistics.median(per_w["unwrapped"]) * 1e9
    figures: dict[str, Figure] = {"unwrapped_per_call": (call_ns / 1e3, "µs")}
    for r, key, short in ((rw, "unwrapped again", "noise_w"), (rw, "wrapped", "wrapped"),
                          (rb, "stopped again", "noise_b"), (rb, "running", "running")):
        lo, med, hi, added, p10 = r[key]
        figures[f"ratio_{short}"] = (med, "1")
        figures[f"ratio_{short}_quiet_blocks"] = (p10, "1")
        figures[f"ratio_{short}_p25_p75"] = (f"{lo:.4f}..{hi:.4f}", "1")
        figures[f"added_{short}"] = (added * 1e6, "µs")
    bounds = {short: quiet_ratio_bounds(per[key], per[base]) for per, key, base, short in (
        (per_w, "unwrapped again", "unwrapped", "noise_w"), (per_w, "wrapped", "unwrapped", "wrapped"),
        (per_b, "stopped again", "stopped", "noise_b"), (per_b, "running", "stopped", "running"))}
    for short, (low, high) in bounds.items():
        figures[f"ratio_{short}_quiet_blocks_ci90"] = (f"{low:.4f}..{high:.4f}", "1")
    probe = background_share(probed, scraper.times)
    nvml_share = nvml["per_poll_ns"] * nvml["per_s"] / 1e9 if nvml else 0.0
    background, per_scrape = probe["background"] + nvml_share, probe["per_scrape"]
    share = {k: probe[k] for k in ("stopped", "running")}
    for k in ("stopped", "running"):
        figures[f"gil_stalled.{k}"] = (share[k] * 1e3, "ms/s")  # the median round's; running: a scrape's apart
        stalls = sum(len(got[k][0]) for got in probed)
        figures[f"gil_stalls_per_s.{k}"] = (stalls / max(rounds_p * probe_s, 1e-9), "1/s")
    figures.update({"gil_stalled.running_minus_stopped": (probe["wakes"] * 1e3, "ms/s"),
                    "scrape_stalled": (per_scrape / 1e6, "ms"), "scrapes_probed": (probe["scrapes"], "")})
    if nvml:
        figures.update({"nvml_poll_stalled": (nvml["per_poll_ns"] / 1e6, "ms"),
                        "nvml_polls_per_min": (nvml["per_s"] * 60, "1/min"), "nvml_share": (nvml_share * 100, "%")})
    cpu_per_s = {}
    for slot, moved in sorted(threads.by_slot.items()):
        sec = max(threads.seconds.get(slot, 0.0), 1e-9)
        cpu_per_s[slot] = sum(cpu for name, (_, cpu) in moved.items() if name != "perfmon-http") / sec
        for name, (sw, cpu) in sorted(moved.items()):
            figures[f"switches_per_s.{slot}.{name}"] = (sw / sec, "1/s")
            figures[f"cpu_per_s.{slot}.{name}"] = (cpu / sec / 1e3, "µs/s")
    unwrapped_cpu = (cpu_per_s.get("unwrapped", 0.0) + cpu_per_s.get("unwrapped again", 0.0)) / 2
    samples = max(0.0, cpu_per_s.get("wrapped", 0.0) - unwrapped_cpu) / 1e9
    wrapped_bound = background + path_ns / call_ns + samples
    running_s = threads.seconds.get("running", 0.0)
    figures.update({f"wakes_per_s.{k}": (v / max(running_s, 1e-9), "1/s") for k, v in sorted(wakes.items())})
    if cuda_ns is not None:  # the path by minima, split: the timed calls' CUDA runtime calls at the sampling rate
        figures.update({"sampled_cuda_calls": (cuda_ns / 1e3, "µs"),
                        "path_cuda_share": (cuda_ns * mon.config.sample_rate, "ns"),
                        "path_rest": (path_ns - cuda_ns * mon.config.sample_rate, "ns")})
    figures.update({"path_per_call": (path_ns, "ns"), "samples_cpu_share": (samples * 100, "%"),
                    "bound_background": (background * 100, "%"), "bound_wrapped": (wrapped_bound * 100, "%")})
    figures.update({"flop_count_once": (once["seconds"] * 1e3, "ms"), "flop_count_settled": (once["settled"], ""),
                    "flop_count_waited": (once["waited"], "s")})
    figures.update({"rounds_wrapped": (rounds_w, ""), "rounds_background": (rounds_b, ""),
                    "calls_per_block": (n, ""), "scrapes": (scraper.scrapes, ""), **gen})
    wr, run = rw["wrapped"][4], rb["running"][4]
    # The direct timing fails the check only where it shows a slowdown past the target at 95% (its bootstrap's lower
    # bound); session 28's guard (the ratio past x1.005 by more than one A/A slot's distance from x1) failed an
    # H200 run on one noisy draw (x1.0182 against an A/A of x1.0068) with both bounds met.
    ok = (background <= 0.001 and wrapped_bound <= 0.005 and bounds["wrapped"][0] <= 1.005
          and bounds["running"][0] <= 1.005)
    cuda_txt = (f", of it {cuda_ns * mon.config.sample_rate:.0f} the timed calls' CUDA calls, {cuda_ns / 1e3:.1f} µs "
                f"each" if cuda_ns is not None else "")
    gen_txt = (f"; generate() {gen['gen_added_wrapped'][0]:+.1f} µs/token wrapped (a streamer alone "
               f"{gen['gen_added_streamer'][0]:+.1f})" if "gen_added_wrapped" in gen else "")
    return Check("agent_cost", "pass" if ok else "fail",
                 f"encoder {call_ns / 1e3:.0f} µs/call; bounds: background {background * 100:+.3f}% (a loop holding "
                 f"the GIL stood still {share['running'] * 1e3:.2f} ms/s running, {share['stopped'] * 1e3:.2f} "
                 f"stopped, {per_scrape / 1e6:.1f} ms a scrape at one every 15 s, "
                 f"{nvml.get('per_poll_ns', 0) / 1e6:.2f} ms an NVML poll at {nvml.get('per_s', 0) * 60:.1f} a "
                 f"minute), "
                 f"wrapped 1% "
                 f"{wrapped_bound * 100:+.3f}% (path {path_ns:+.0f} ns a call{cuda_txt}); quiet blocks (90% CI): "
                 f"wrapped vs unwrapped x{wr:.4f} ({_ci(bounds['wrapped'])}; A/A x{rw['unwrapped again'][4]:.4f}), "
                 f"running vs stopped x{run:.4f} ({_ci(bounds['running'])}; A/A x{rb['stopped again'][4]:.4f})"
                 f"{gen_txt}", figures)


def _ci(bounds: tuple[float, float]) -> str:
    return f"x{bounds[0]:.4f}..x{bounds[1]:.4f}"
