"""Timing truth: what perfmon reports against ground truth measured in the same process.

Modules busy-wait known durations (0.2 ms, 2 ms, 20 ms) and one is bimodal (80% 1 ms, 20% 5 ms).
Bare and wrapped calls are interleaved; the bare calls' own percentiles are the ground truth.
perfmon runs at 100% sampling so every wrapped call is a sample. Reported: p50/p99 from /stats
(exact, over the window) and from Prometheus' histogram_quantile over the exported buckets.

Then under contention, as a thread-per-request server runs: ``--threads`` threads (default 4) call one
wrapped 512-wide two-layer MLP (torch with one thread, so the GIL is the contended resource), each timing
every call of its own; perfmon, started, samples at 1% (the default) and at 100%. The truth is the callers'
p50 over all their calls; perfmon's is its steady p50 (/stats). A timed call must not run slower for being
timed: work between the sampling decision and the start stamp did that (BENCHMARKS §3b, session 31).

    python benchmarks/accuracy.py [--calls 300] [--threads 4] [--thread-calls 4000] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time

import torch
from common import dump, machine, monitor, table

from perfmon.stats.windows import quantile
from perfmon.testing import histogram_quantile


class Bimodal(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        self.rng = random.Random(seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seconds = 0.005 if self.rng.random() < 0.2 else 0.001
        end = time.perf_counter_ns() + int(seconds * 1e9)
        while time.perf_counter_ns() < end:
            pass
        return x


def buckets(mon, model: str) -> list[tuple[float, float]]:
    out = []
    for metric in mon.registry.collect():
        if metric.name == "perfmon_forward_duration_seconds":
            for s in metric.samples:
                if s.name.endswith("_bucket") and s.labels["model"] == model and s.labels["phase"] == "steady":
                    out.append((float(s.labels["le"]), s.value))
    return out


def main(argv: list[str] | None = None) -> int:
    from perfmon.testing import BusyWait

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--threads", type=int, default=4, help="contended section: calling threads (0: skip it)")
    parser.add_argument("--thread-calls", type=int, default=4000, help="contended section: calls per thread a round")
    parser.add_argument("--rounds", type=int, default=3, help="contended section: rounds per sampling rate")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    print(machine() + "\n")
    cases = [("busy 0.2 ms", lambda: BusyWait(0.0002)), ("busy 2 ms", lambda: BusyWait(0.002)),
             ("busy 20 ms", lambda: BusyWait(0.02)), ("bimodal 1/5 ms", lambda: Bimodal(1))]
    rows, data = [], {}
    for name, make in cases:
        mon = monitor(sample_rate=1.0, warmup_calls=3, stats_window_seconds=3600, regression=None)
        bare, wrapped = make(), mon.wrap(make(), name="m")
        if isinstance(bare, Bimodal):
            bare.rng, wrapped.rng = random.Random(7), random.Random(7)  # same sequence of modes
        x = torch.zeros(1)
        for _ in range(3):
            wrapped(x)
        truth = []
        calls = args.calls if "20 ms" not in name else max(50, args.calls // 5)
        for _ in range(calls):
            t0 = time.perf_counter_ns()
            bare(x)
            truth.append((time.perf_counter_ns() - t0) / 1e9)
            wrapped(x)
        mon.flush()
        truth.sort()
        stats = mon.stats()["models"]["m"]["latency"]["steady"]["duration"]
        b = buckets(mon, "m")
        row = {"truth_p50": quantile(truth, 0.5), "truth_p99": quantile(truth, 0.99),
               "stats_p50": stats["p50_seconds"], "stats_p99": stats["p99_seconds"],
               "hist_p50": histogram_quantile(0.5, b), "hist_p99": histogram_quantile(0.99, b)}
        data[name] = row

        def err(k: str, q: str, row: dict[str, float] = row) -> str:
            return f"{(row[f'{k}_{q}'] / row[f'truth_{q}'] - 1) * 100:+.1f}%"

        rows.append([name, f"{row['truth_p50'] * 1e3:.3f}", f"{row['stats_p50'] * 1e3:.3f} ({err('stats', 'p50')})",
                     f"{row['hist_p50'] * 1e3:.3f} ({err('hist', 'p50')})", f"{row['truth_p99'] * 1e3:.3f}",
                     f"{row['stats_p99'] * 1e3:.3f} ({err('stats', 'p99')})",
                     f"{row['hist_p99'] * 1e3:.3f} ({err('hist', 'p99')})"])
    print(table(["module", "true p50 ms", "/stats p50 ms", "buckets p50 ms", "true p99 ms", "/stats p99 ms",
                 "buckets p99 ms"], rows))
    if args.threads > 0:
        data["contended"] = contended(args.threads, args.thread_calls, args.rounds)
    dump(args.json, data)
    return 0


def contended(threads: int, calls: int, rounds: int) -> list[dict[str, float]]:
    """The contended section: per round and sampling rate, perfmon's steady p50 against the callers' own."""
    torch.set_num_threads(1)
    out, rows = [], []
    for r in range(rounds):
        for rate in (0.01, 1.0):  # interleaved: a drift of the host hits both
            row = contended_round(rate, threads, calls)
            row["round"] = r
            out.append(row)
            rows.append([r, f"{rate:.0%}", row["samples"], f"{row['truth_p50'] * 1e3:.3f}",
                         f"{row['stats_p50'] * 1e3:.3f}", f"{(row['stats_p50'] / row['truth_p50'] - 1) * 100:+.1f}%"])
    print(f"\nContended: {threads} threads, {calls} calls each a round, MLP 512x2 batch 16, torch 1 thread\n")
    print(table(["round", "rate", "samples", "callers' p50 ms", "perfmon p50 ms", "perfmon / callers"], rows))
    return out


def contended_round(rate: float, threads: int, calls: int) -> dict[str, float]:
    """One round: ``threads`` callers of one wrapped MLP, each timing its own calls; perfmon started."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512))
    mon = monitor(sample_rate=rate, stats_window_seconds=3600, regression=None)
    mon.start()
    try:
        wrapped = mon.wrap(model, name="mlp")
        x = torch.randn(16, 512)
        with torch.inference_mode():
            for _ in range(50):
                wrapped(x)
        seen: list[list[int]] = [[] for _ in range(threads)]
        go = threading.Barrier(threads)

        def caller(mine: list[int]) -> None:
            clock = time.perf_counter_ns
            go.wait(timeout=60)
            with torch.inference_mode():
                for _ in range(calls):
                    t0 = clock()
                    wrapped(x)
                    mine.append(clock() - t0)

        pool = [threading.Thread(target=caller, args=(mine,)) for mine in seen]
        for t in pool:
            t.start()
        for t in pool:
            t.join(timeout=600)
        mon.flush()
        steady = mon.stats()["models"]["mlp"]["latency"]["steady"]["duration"]
        return {"rate": rate, "truth_p50": statistics.median(d for mine in seen for d in mine) / 1e9,
                "stats_p50": steady["p50_seconds"], "samples": steady["count"]}
    finally:
        mon.stop()


if __name__ == "__main__":
    sys.exit(main())
