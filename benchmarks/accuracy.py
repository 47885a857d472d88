"""Timing truth: what perfmon reports against ground truth measured in the same process.

Modules busy-wait known durations (0.2 ms, 2 ms, 20 ms) and one is bimodal (80% 1 ms, 20% 5 ms).
Bare and wrapped calls are interleaved; the bare calls' own percentiles are the ground truth.
perfmon runs at 100% sampling so every wrapped call is a sample. Reported: p50/p99 from /stats
(exact, over the window) and from Prometheus' histogram_quantile over the exported buckets.

    python benchmarks/accuracy.py [--calls 300] [--json out.json]
"""

from __future__ import annotations

import argparse
import random
import sys
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
    dump(args.json, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
