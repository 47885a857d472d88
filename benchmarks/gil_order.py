"""Why nothing may run between the sampling decision and a timed call's start stamp (no perfmon here).

Threads (default 4, on however many cores the host has) call one 512-wide two-layer MLP, torch with one
thread, so the GIL is what they contend for. On about 1% of calls ("marked") a thread first runs a burst
of cold Python (random reads of a large list of dicts: what a rarely-run bookkeeping path costs), either
just *before* the call it times or just *after* it. Reported: the marked calls' median over the unmarked
calls' median, and the median of the call right after a marked one. Variants interleave within a round.

    python benchmarks/gil_order.py [--threads 4] [--calls 2000] [--rounds 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
from typing import Any

import torch
from common import dump, machine, table

_JUNK = [{"a": i, "b": str(i)} for i in range(200_000)]


def burst(reps: int, rng: random.Random) -> int:
    """``reps`` reads of random dicts: cache-cold Python that holds the GIL (~1 µs a read alone)."""
    s = 0
    for _ in range(reps):
        s += _JUNK[rng.randrange(len(_JUNK))]["a"]
    return s


def one(mode: str, reps: int, threads: int, calls: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512))
    x = torch.randn(16, 512)
    got: list[tuple[list[int], list[int], list[int]]] = [([], [], []) for _ in range(threads)]
    go = threading.Barrier(threads)

    def caller(k: int) -> None:
        rng = random.Random(k)
        marked, plain, after = got[k]
        clock = time.perf_counter_ns
        follows = False
        go.wait(timeout=60)
        with torch.inference_mode():
            for i in range(calls):
                mark = i % 100 == 50
                if mark and mode == "before":
                    burst(reps, rng)
                t0 = clock()
                model(x)
                d = clock() - t0
                if mark and mode == "after":
                    burst(reps, rng)
                (marked if mark else after if follows else plain).append(d)
                follows = mark

    pool = [threading.Thread(target=caller, args=(k,)) for k in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(timeout=600)
    p50 = statistics.median(d for g in got for d in g[1])
    rng = random.Random(0)
    alone = []
    for _ in range(100):
        t0 = time.perf_counter_ns()
        burst(reps, rng)
        alone.append(time.perf_counter_ns() - t0)
    return {"mode": mode, "reps": reps, "burst_alone_us": statistics.median(alone) / 1e3, "plain_p50_us": p50 / 1e3,
            "marked_ratio": statistics.median(d for g in got for d in g[0]) / p50,
            "next_ratio": statistics.median(d for g in got for d in g[2]) / p50}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--calls", type=int, default=2000, help="calls per thread per variant")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(machine() + "\n")
    variants = [("none", 0)] + [(mode, reps) for reps in (10, 40, 120) for mode in ("before", "after")]
    rows, data = [], []
    for r in range(args.rounds):
        for mode, reps in variants:
            res = one(mode, reps, args.threads, args.calls)
            res["round"] = r
            data.append(res)
            rows.append([r, mode, reps, f"{res['burst_alone_us']:.1f}", f"{res['plain_p50_us']:.0f}",
                         f"{(res['marked_ratio'] - 1) * 100:+.1f}%", f"{(res['next_ratio'] - 1) * 100:+.1f}%"])
    print(f"{args.threads} threads, {args.calls} calls each a variant, MLP 512x2 batch 16, torch 1 thread; "
          "1 call in 100 marked\n")
    print(table(["round", "burst", "reads", "burst alone µs", "unmarked p50 µs", "marked call", "the call after"],
                rows))
    dump(args.json, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
