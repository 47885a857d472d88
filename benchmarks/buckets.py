"""Bucket grids against exact percentiles: what the series budget costs in accuracy.

Synthetic latencies (log-normal) at several medians, narrow (sigma 0.02: a stable model, every call
within a few percent) and wide (sigma 0.5: mixed batch sizes, queueing); per grid, Prometheus'
``histogram_quantile`` (linear interpolation inside the bucket holding the rank) against the exact
percentile of the same values. Grids: the default (43 bounds), ``FINE_BUCKETS`` (the old default, 88),
and the native histogram at perfmon's schema 3 (Prometheus 2.42 interpolates linearly in a native
bucket too). The sweep rows take 97 medians log-spaced from 1 ms to 0.5 s (where both classic grids are
fine-grained; beyond 1 s they are coarse tails), so where a narrow distribution falls against the
bounds averages out: mean and worst |error| over them. A last sweep does the same for time to first
token, 97 medians from 10 ms to 10 s: TTFT_BUCKETS (12 a decade) against its previous 24-a-decade grid.

    python benchmarks/buckets.py [--samples 20000] [--json out.json]
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from collections.abc import Sequence

from common import dump, machine, table

from perfmon.agent.generation import TTFT_BUCKETS
from perfmon.config import DEFAULT_BUCKETS, FINE_BUCKETS, log_buckets
from perfmon.metrics.native import SCHEMA, bucket_index
from perfmon.stats.windows import quantile
from perfmon.testing import histogram_quantile

QS = (0.5, 0.95, 0.99)
MEDIANS = (0.0008, 0.002, 0.005, 0.013, 0.04, 0.12, 0.4)
SHAPES = {"narrow": 0.02, "wide": 0.5}


def classic(values: Sequence[float], bounds: Sequence[float], q: float) -> float:
    counts = [0] * (len(bounds) + 1)
    from bisect import bisect_left

    for v in values:
        counts[bisect_left(bounds, v)] += 1
    cum, total = [], 0
    for le, n in zip((*bounds, math.inf), counts):
        total += n
        cum.append((le, float(total)))
    return histogram_quantile(q, cum)


def native(values: Sequence[float], q: float, schema: int = SCHEMA) -> float:
    counts: dict[int, int] = {}
    for v in values:
        k = bucket_index(v, schema)
        counts[k] = counts.get(k, 0) + 1
    base = 2.0 ** (2.0**-schema)
    rank = q * len(values)
    seen = 0
    for k in sorted(counts):
        n = counts[k]
        if seen + n >= rank:
            lo, hi = base ** (k - 1), base**k
            return lo + (hi - lo) * (rank - seen) / n
        seen += n
    return base ** max(counts)


GRIDS = {
    f"default ({len(DEFAULT_BUCKETS)} bounds)": lambda vs, q: classic(vs, DEFAULT_BUCKETS, q),
    f"FINE_BUCKETS ({len(FINE_BUCKETS)} bounds)": lambda vs, q: classic(vs, FINE_BUCKETS, q),
    f"native schema {SCHEMA}": native,
}

#: Time to first token: the shipped grid, the one it replaced (24 a decade, 116 bounds), native.
PREVIOUS_TTFT = log_buckets(0.001, 60.0, 24)
TTFT_GRIDS = {
    f"TTFT_BUCKETS ({len(TTFT_BUCKETS)} bounds)": lambda vs, q: classic(vs, TTFT_BUCKETS, q),
    f"previous ({len(PREVIOUS_TTFT)} bounds)": lambda vs, q: classic(vs, PREVIOUS_TTFT, q),
    f"native schema {SCHEMA}": native,
}


def sample(median: float, sigma: float, n: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [median * math.exp(rng.gauss(0.0, sigma)) for _ in range(n)]


def errors(values: list[float], estimate: object, q: float) -> float:
    exact = quantile(sorted(values), q)
    return estimate(values, q) / exact - 1  # type: ignore[operator]


def sweep(grids: dict[str, object], low: float, high: float, n: int) -> list[list[str]]:
    """Rows (shape, grid, then "mean% / worst%" |error| per quantile) over 97 log-spaced medians."""
    medians = [low * (high / low) ** (i / 96) for i in range(97)]
    rows = []
    for shape, sigma in SHAPES.items():
        for name, estimate in grids.items():
            errs: dict[float, list[float]] = {q: [] for q in QS}
            for i, median in enumerate(medians):
                values = sample(median, sigma, n, seed=i)
                for q in QS:
                    errs[q].append(abs(errors(values, estimate, q)))
            rows.append([shape, name, *(f"{100 * sum(e) / len(e):.1f}% / {100 * max(e):.1f}%"
                                        for e in errs.values())])
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=20_000)
    ap.add_argument("--json")
    args = ap.parse_args()
    out: dict[str, object] = {"machine": machine()}
    print(machine())
    rows = []
    for shape, sigma in SHAPES.items():
        for median in MEDIANS:
            values = sample(median, sigma, args.samples, seed=int(median * 1e6))
            row = [shape, f"{median * 1e3:g} ms"]
            for estimate in GRIDS.values():
                row.append(" / ".join(f"{errors(values, estimate, q) * 100:+.1f}%" for q in QS))
            rows.append(row)
    print("\nError of histogram_quantile vs the exact percentile (p50 / p95 / p99):\n")
    print(table(["shape", "median", *GRIDS], rows, "lr" + "r" * len(GRIDS)))
    out["medians"] = rows
    sweep_rows = sweep(GRIDS, 0.001, 0.5, args.samples // 4)
    print("\nSweep, 97 medians from 1 ms to 0.5 s: mean / worst |error|:\n")
    print(table(["shape", "grid", "p50", "p95", "p99"], sweep_rows, "llrrr"))
    out["sweep"] = sweep_rows
    ttft_rows = sweep(TTFT_GRIDS, 0.01, 10.0, args.samples // 4)
    print("\nTime to first token, 97 medians from 10 ms to 10 s: mean / worst |error|:\n")
    print(table(["shape", "grid", "p50", "p95", "p99"], ttft_rows, "llrrr"))
    out["ttft_sweep"] = ttft_rows
    dump(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
