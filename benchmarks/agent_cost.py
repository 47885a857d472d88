"""What the running agent costs the serving thread: three variants interleaved in one process.

perfmon's per-call figures (``overhead.py``) are taken with the monitor constructed but not started. A user
runs it started: resolver, HTTP server and uploader threads running, scraped every 15 s, a trace store
configured, regression detection and the profiler's preparation on (the defaults). On a GIL-bound serving
loop every background wake is a GIL hand-off the serving thread pays for, which no CPU-seconds figure of
the agent's own threads shows. So this times the serving thread itself:

- ``stopped``: the monitor stopped, the bare model;
- ``running, unwrapped``: the monitor running (threads, scraper), the bare model: the background alone;
- ``running, wrapped``: the monitor running, the model wrapped at the default 1% sampling (the same module
  object throughout: wrapped and unwrapped between variants).

Each round runs every variant once in a shuffled order (they share the machine's noise); the figure is
the median over rounds of each variant's time per call divided by the same round's ``stopped`` one, with
the 25th-75th percentiles. Then a ``generate()`` of a tiny random GPT-2 wrapped vs a bare twin (µs per
generated token) and the per-call cost on Linear(64, 64), both with the monitor running. Agent threads'
wakes per second (voluntary context switches, which include waits for the GIL) are read from /proc.

    python benchmarks/agent_cost.py [--rounds 24] [--calls 3000] [--json out.json]

Not a test: read ratios, on a quiet machine.
"""

from __future__ import annotations

import argparse
import copy
import gc
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from common import Scraper, dump, machine, table
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


def agent_threads_wakes() -> dict[str, int]:
    """name -> voluntary context switches of this process's perfmon threads (a wake each, GIL waits included)."""
    out: dict[str, int] = {}
    for t in threading.enumerate():
        if not t.name.startswith("perfmon") or t.native_id is None:
            continue
        try:
            with open(f"/proc/self/task/{t.native_id}/status") as f:
                text = f.read()
        except OSError:
            continue
        out[t.name] = out.get(t.name, 0) + int(text.split("voluntary_ctxt_switches:")[1].split()[0])
    return out


def pct(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return q[0], statistics.median(values), q[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=24)
    ap.add_argument("--calls", type=int, default=3000, help="calls per variant per round (~1 s)")
    ap.add_argument("--gen-rounds", type=int, default=16)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    tmp = tempfile.mkdtemp(prefix="perfmon-agent-cost-")
    mon = perfmon.Monitor(port=0, log_level="error", registry=CollectorRegistry(), trace_dir=f"{tmp}/traces",
                          trace_store=f"file://{tmp}/store")  # everything else: the defaults
    # One module, wrapped and unwrapped between variants (Monitor.unwrap restores its class): a twin copy
    # would put its weights elsewhere in memory, a difference of its own (an A/A of two copies: ±0.5%).
    model = gil_bound_model()
    x = torch.randn(4, 32)
    lin = torch.nn.Linear(64, 64).eval()
    lin_bare, lin_wrapped = copy.deepcopy(lin), mon.wrap(copy.deepcopy(lin), name="linear64")
    x1 = torch.randn(1, 64)
    mon.start()
    scraper = Scraper(lambda: mon.url)

    def call() -> Any:
        with torch.inference_mode():
            return model(x)

    wrapped = False

    def set_wrapped(want: bool) -> None:
        nonlocal wrapped
        if want and not wrapped:
            mon.wrap(model, name="gil_bound")  # the same name again: its counters continue
        elif wrapped and not want:
            mon.unwrap(model)
        wrapped = want

    for want in (True, False, True, False):  # warm both paths and the monitor's cold calls
        set_wrapped(want)
        time_calls(call, 300)
    running = True
    per: dict[str, list[float]] = {"stopped": [], "running, unwrapped": [], "running, wrapped": []}
    wakes: dict[str, int] = {}
    wake_seconds = 0.0
    for _ in range(args.rounds):
        order = list(per)
        random.shuffle(order)
        for variant in order:
            want = variant != "stopped"
            if want != running:
                mon.start() if want else mon.stop()
                running = want
                time.sleep(0.2)  # threads settled
            set_wrapped(variant == "running, wrapped")
            t0, before = time.perf_counter(), agent_threads_wakes()
            per[variant].append(time_calls(call, args.calls))
            if variant == "running, unwrapped":  # the background alone: its wakes while the loop runs
                wake_seconds += time.perf_counter() - t0
                after = agent_threads_wakes()
                for name in after.keys() & before.keys():
                    wakes[name] = wakes.get(name, 0) + after[name] - before[name]
    set_wrapped(False)
    if not running:
        mon.start()
    rows, out = [], {"machine": machine(), "calls": args.calls, "rounds": args.rounds}
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

    # generate(): a tiny random GPT-2, wrapped at 1% vs a bare twin, the monitor running.
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        print("\n(transformers not installed: generate() skipped)")
    else:
        import transformers

        transformers.logging.set_verbosity_error()
        cfg = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=128, bos_token_id=0,
                         eos_token_id=1)
        g_bare = GPT2LMHeadModel(cfg).eval()
        g_wrapped = mon.wrap(copy.deepcopy(g_bare), name="gpt2_tiny")
        ids = torch.randint(2, 1000, (1, 8))
        kw = {"max_new_tokens": 32, "min_new_tokens": 32, "do_sample": False, "pad_token_id": 0}

        def gen(model: Any) -> Callable[[], Any]:
            def run() -> Any:
                with torch.inference_mode():
                    return model.generate(ids, **kw)
            return run

        for _ in range(3):
            time_calls(gen(g_bare), 3)
            time_calls(gen(g_wrapped), 3)
        gb, gw = [], []
        for _ in range(args.gen_rounds):
            pair = [("bare", gen(g_bare)), ("wrapped", gen(g_wrapped))]
            random.shuffle(pair)
            for name, fn in pair:
                (gb if name == "bare" else gw).append(time_calls(fn, 10) / 32)
        diffs = [(w - b) * 1e6 for w, b in zip(gw, gb)]
        lo, med, hi = pct(diffs)
        ratio = statistics.median(w / b for w, b in zip(gw, gb))
        print(f"\ngenerate(), tiny GPT-2 (2 layers, d=64), 32 new tokens, 1% sampling, {args.gen_rounds} rounds: "
              f"bare {statistics.median(gb) * 1e6:.1f} µs/token, added **{med:+.2f} µs/token** "
              f"(p25..p75 {lo:+.2f}..{hi:+.2f}), {(ratio - 1) * 100:+.2f}%")
        out["generate"] = {"bare_us_per_token": statistics.median(gb) * 1e6, "added_us_per_token": med,
                           "p25": lo, "p75": hi, "ratio": ratio}

    # The per-call hot path on a tiny model, the monitor running.
    lb, lw = [], []
    for _ in range(args.rounds):
        pair = [("bare", lin_bare), ("wrapped", lin_wrapped)]
        random.shuffle(pair)
        for name, model in pair:
            def call(model: Any = model) -> Any:
                with torch.inference_mode():
                    return model(x1)
            (lb if name == "bare" else lw).append(time_calls(call, 20000))
    diffs = [(w - b) * 1e9 for w, b in zip(lw, lb)]
    lo, med, hi = pct(diffs)
    print(f"\nLinear(64,64) batch 1, 1% sampling, monitor running: bare {statistics.median(lb) * 1e9:.0f} ns, "
          f"added **{med:+.0f} ns/call** (p25..p75 {lo:+.0f}..{hi:+.0f})")
    out["linear64"] = {"bare_ns": statistics.median(lb) * 1e9, "added_ns": med, "p25": lo, "p75": hi}

    print(f"\nAgent threads' wakes (voluntary context switches, GIL waits included) while the serving loop ran "
          f"with the monitor running ({wake_seconds:.1f} s):")
    print(table(["thread", "wakes", "per second"],
                [[k, v, f"{v / max(wake_seconds, 1e-9):.1f}"] for k, v in sorted(wakes.items())]))
    print(f"\nscrapes: {scraper.scrapes}")
    out["wakes_per_second"] = {k: v / max(wake_seconds, 1e-9) for k, v in wakes.items()}
    scraper.stop()
    mon.stop()
    dump(args.json, out)


if __name__ == "__main__":
    main()
