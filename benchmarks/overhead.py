"""Per-call overhead of perfmon's hot path, against the alternatives a team would otherwise write.

Prints a table: for each model and variant, the median added time per call over interleaved rounds
(each round times every variant once, in a shuffled order, so they share the machine's noise),
the 25th-75th percentile spread of that difference, and the ratio to the bare call.

    python benchmarks/overhead.py [--rounds 30] [--calls 2000]

Every figure here has the monitor constructed but **not started** (no resolver, HTTP or upload thread
waking mid-round): the hot path's own cost. What the running agent costs the serving thread, threads
and a scraper included, is ``benchmarks/agent_cost.py``.

Not a test: timings on a shared 2-core machine are noisy (read ratios, not absolutes).
"""

from __future__ import annotations

import argparse
import collections
import gc
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from common import dump, machine, monitor
from prometheus_client import CollectorRegistry, Histogram

import perfmon


def mlp_100us() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128))


def encoder_ms() -> torch.nn.Module:
    layer = torch.nn.TransformerEncoderLayer(d_model=128, nhead=4, dim_feedforward=512, batch_first=True)
    return torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).eval()


class AlwaysProfiled:
    """torch.profiler on for every call: started before and stopped after each timed round."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.prof: Any = None

    def __call__(self, *args: Any) -> Any:
        return self.model(*args)

    def begin(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self.prof = profile(activities=[ProfilerActivity.CPU])
        self.prof.start()

    def end(self) -> None:
        self.prof.stop()
        self.prof = None


def hook_pair(model: torch.nn.Module) -> torch.nn.Module:
    """The usual hand-written alternative: a forward pre-hook + hook pair timing every call."""
    starts: list[int] = []
    out: collections.deque[int] = collections.deque(maxlen=100_000)

    def pre(mod: Any, args: Any) -> None:
        starts.append(time.perf_counter_ns())

    def post(mod: Any, args: Any, result: Any) -> None:
        out.append(time.perf_counter_ns() - starts.pop())

    model.register_forward_pre_hook(pre)
    model.register_forward_hook(post)
    return model


def naive_histogram(model: torch.nn.Module) -> Callable[..., Any]:
    """perf_counter around every call and an inline prometheus Histogram.observe (bound child)."""
    hist = Histogram("naive_seconds", "naive", ["model"], registry=CollectorRegistry()).labels("m")

    def call(*args: Any) -> Any:
        t0 = time.perf_counter()
        y = model(*args)
        hist.observe(time.perf_counter() - t0)
        return y

    return call


def build(make: Callable[[], torch.nn.Module]) -> tuple[dict[str, Callable[..., Any]], list[perfmon.Monitor]]:
    torch.manual_seed(0)
    monitors: list[perfmon.Monitor] = []

    def monitored(rate: float, sigs: bool, items: Any = None) -> Callable[..., Any]:
        mon = monitor(sample_rate=rate, track_signatures=sigs, sample_floor_seconds=1e6, queue_size=1_000_000,
                      regression=None)
        # Not started: no resolver thread waking up mid-measurement. flush() between rounds does its
        # work outside the timed region; its cost is the background benchmark's business.
        monitors.append(mon)
        return mon.wrap(make(), name="m", items=items)  # type: ignore[no-any-return]

    variants = {
        "bare": make(),
        "perfmon unsampled, signatures off": monitored(1e-9, False),
        "perfmon unsampled (signatures on)": monitored(1e-9, True),
        "perfmon unsampled, signatures on, items off": monitored(1e-9, True, items=False),
        "perfmon 1% sampling": monitored(0.01, True),
        "perfmon 5% sampling": monitored(0.05, True),
        "perfmon 100% sampling": monitored(1.0, True),
        "pre-hook + hook pair, every call": hook_pair(make()),
        "naive perf_counter + Histogram.observe": naive_histogram(make()),
        "torch.profiler always on": AlwaysProfiled(make()),
    }
    return variants, monitors


def measure(name: str, make: Callable[[], torch.nn.Module], x: torch.Tensor, rounds: int,
            calls: int) -> list[tuple[str, float, float, float, float]]:
    variants, monitors = build(make)
    per_call: dict[str, list[float]] = {k: [] for k in variants}
    with torch.inference_mode():
        for fn in variants.values():  # warm-up: cold calls, allocator, signatures
            if isinstance(fn, AlwaysProfiled):
                fn.begin()
            for _ in range(50):
                fn(x)
            if isinstance(fn, AlwaysProfiled):
                fn.end()
        order = list(variants)
        for _ in range(rounds):
            random.shuffle(order)
            for key in order:
                fn = variants[key]
                if isinstance(fn, AlwaysProfiled):
                    fn.begin()  # outside the timed region: only the per-call cost is measured
                gc.disable()
                t0 = time.perf_counter_ns()
                for _ in range(calls):
                    fn(x)
                elapsed = time.perf_counter_ns() - t0
                gc.enable()
                if isinstance(fn, AlwaysProfiled):
                    fn.end()
                per_call[key].append(elapsed / calls)
            for mon in monitors:
                mon.flush()  # outside the timed region: the resolver's work is not the request's
    for mon in monitors:
        mon.stop()
    bare = per_call["bare"]
    rows = []
    for key, values in per_call.items():
        diffs = [v - b for v, b in zip(values, bare)]
        q = statistics.quantiles(diffs, n=4) if len(diffs) >= 2 else [diffs[0]] * 3
        rows.append((key, statistics.median(values), statistics.median(diffs), q[0], q[2]))
    print(f"\n## {name}: bare call median {statistics.median(bare) / 1e3:.2f} µs "
          f"({rounds} rounds x {calls} calls, interleaved)\n")
    print("| variant | per call (µs) | added (ns, median) | added p25..p75 (ns) | ratio to bare |")
    print("|---|---:|---:|---:|---:|")
    b = statistics.median(bare)
    for key, med, add, q1, q3 in rows:
        print(f"| {key} | {med / 1e3:.2f} | {add:+.0f} | {q1:+.0f} .. {q3:+.0f} | {med / b:.3f} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--json", default=None)
    parser.add_argument("--models", default="linear,mlp,encoder", help="which of linear,mlp,encoder to run")
    args = parser.parse_args(argv)
    wanted = set(args.models.split(","))
    torch.set_num_threads(1)  # a steadier baseline on a 2-core machine
    print(f"{machine()}, torch threads {torch.get_num_threads()}; monitor not started (hot path alone: "
          "agent_cost.py measures it running)")
    warm = AlwaysProfiled(torch.nn.Linear(2, 2))  # the first profiler start in a process takes ~1 s
    warm.begin()
    warm.end()
    plans = {
        "linear": lambda: measure("nn.Linear(64, 64), batch 8", lambda: torch.nn.Linear(64, 64), torch.randn(8, 64),
                                  args.rounds, args.calls),
        "mlp": lambda: measure("MLP 128-256-128, batch 32 (~100 µs)", mlp_100us, torch.randn(32, 128),
                               max(10, args.rounds // 2), max(200, args.calls // 5)),
        "encoder": lambda: measure("Transformer encoder, 2 layers d=128, batch 4 x 32 tokens (~1-5 ms)", encoder_ms,
                                   torch.randn(4, 32, 128), max(8, args.rounds // 3), max(20, args.calls // 50)),
    }
    results = {name: run() for name, run in plans.items() if name in wanted}
    dump(args.json, {k: [dict(zip(("variant", "per_call_ns", "added_ns", "p25_ns", "p75_ns"), r)) for r in v]
                     for k, v in results.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
