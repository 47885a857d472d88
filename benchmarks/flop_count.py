"""What counting a signature's FLOPs and bytes costs (``make bench`` runs it), and what the serving thread feels.

perfmon/agent/flopcount.py counts each input signature once, on a thread of its own: a fake copy of the model
(once per model), then one fake forward per signature. Measured here for a 4 x Linear(512, 512) MLP and a random
2-layer GPT-2 (transformers; no download): the first copy and count, a new signature of a model already copied,
and the process's one-time import (a FakeTensorMode imports torch._dynamo; Monitor.start() does it).

GIL: the count is Python-heavy (torch's dispatch of fake ops). A "serving" thread that loops ``sleep(1 ms)`` measures
how late it wakes while counts run on the other thread and while nothing does: the overshoot is how long it waited
for the GIL (Python hands it over every ``sys.getswitchinterval()``, 5 ms). Rounds interleave idle, counting
unpaced (``duty=1.0``, as before session 28) and counting paced (the default ``FLOP_COUNT_DUTY``: a count works a
slice, then pauses with the GIL let go). The counts' times are their work (``Count.seconds``, pauses apart); a paced
count's wall is about its work over the duty.

The request path is not touched by counting: on an unsampled call nothing changed; a timed call passes its
signature to ``finish`` (one argument, already in hand); a new signature's first call describes its inputs
(abstract.describe, measured below: ``describe``). benchmarks/overhead.py and agent_cost.py measure both paths.

Not a test: read the table on a quiet machine.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import threading
import time
import timeit
import weakref
from typing import Any

import torch

from perfmon.agent.abstract import describe
from perfmon.agent.flopcount import FLOP_COUNT_DUTY, FLOP_COUNT_SLICE_SECONDS, Count, FlopCounter

try:
    from common import dump, machine, table
except ImportError:  # run as `python -m benchmarks.flop_count` from the repository root
    from benchmarks.common import dump, machine, table


#: (duty, slice seconds) compared: unpaced, the defaults, and longer slices (fewer cold restarts after a pause).
PACES = ((1.0, FLOP_COUNT_SLICE_SECONDS), (FLOP_COUNT_DUTY, FLOP_COUNT_SLICE_SECONDS), (FLOP_COUNT_DUTY, 0.001),
         (FLOP_COUNT_DUTY, 0.005),
         (0.25, 0.002), (0.25, 0.005))


def _models() -> dict[str, tuple[torch.nn.Module, Any]]:
    out: dict[str, tuple[torch.nn.Module, Any]] = {
        "mlp 4x512 (batch 64)": (torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)]).eval(),
                                 lambda b: ((torch.randn(b, 512),), {})),
    }
    try:
        import transformers

        cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=1000, n_positions=128,
                                      bos_token_id=0, eos_token_id=0)
        out["gpt2 2-layer (prefill 2x16)"] = (transformers.GPT2LMHeadModel(cfg).eval(),
                                             lambda b: ((torch.randint(0, 1000, (2, 16 + b)),), {}))
    except ImportError:  # pragma: no cover - transformers is a dev dependency
        pass
    return out


def _stalls(work: Any, seconds: float) -> list[float]:
    """Overshoots (ms) of a thread sleeping 1 ms in a loop while ``work`` runs on this one (None: idle)."""
    late: list[float] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            time.sleep(0.001)
            late.append((time.perf_counter() - t0 - 0.001) * 1e3)

    t = threading.Thread(target=serve)
    t.start()
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        if work is None:
            time.sleep(0.01)
        else:
            work()
    stop.set()
    t.join()
    return late


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    print(machine())
    t0 = time.perf_counter()
    counter = FlopCounter(per_minute=10**6, timeout_seconds=30.0)
    counter.prepare()
    first_import = time.perf_counter() - t0
    rows: list[list[Any]] = []
    paces: list[list[Any]] = []
    results: dict[str, Any] = {"import_seconds": first_import, "models": {}}
    for name, (model, make) in _models().items():
        a, kw = make(1)
        spec = describe(a, kw)
        ref = weakref.ref(model)
        firsts, news, walls = [], [], []
        for r in range(args.rounds):
            counter = FlopCounter(per_minute=10**6, timeout_seconds=30.0)  # no copy yet: a model's first signature
            t = time.perf_counter()
            got = counter.count(ref, spec)
            walls.append(time.perf_counter() - t)
            assert isinstance(got, Count), got
            firsts.append(got.seconds)
            a2, kw2 = make(2 + r)
            new = counter.count(ref, describe(a2, kw2))  # the copy is kept: a new signature of the same model
            assert isinstance(new, Count), new
            news.append(new.seconds)
        describe_us = min(timeit.repeat(lambda a=a, kw=kw: describe(a, kw), number=2000, repeat=5)) / 2000 * 1e6
        idle: list[float] = []
        busy: dict[tuple[float, float], list[float]] = {k: [] for k in PACES}
        works: dict[tuple[float, float], list[float]] = {k: [] for k in PACES}
        counters = {k: FlopCounter(per_minute=10**6, timeout_seconds=30.0, duty=k[0], slice_seconds=k[1])
                    for k in PACES}

        for _ in range(args.rounds):  # interleaved: idle, then counting new signatures back to back, each pace
            idle += _stalls(None, 0.5)
            for key, late in busy.items():
                late += _stalls(functools.partial(_count_one, counters[key], ref, make, iter(range(10**6)), works[key]),
                                0.5)
        for key in PACES:
            paces.append([name, "unpaced" if key[0] == 1.0 else f"{key[0]:g} of the time, {key[1] * 1e3:g} ms slices",
                          f"{statistics.median(works[key]) * 1e3:.1f}",
                          f"{_q(busy[key], 0.99):.2f} / {max(busy[key]):.2f}",
                          f"{sum(busy[key]) / 1e3 / (0.5 * args.rounds):.0%}"])
            results["models"].setdefault(name, {})[f"pace {key}"] = {
                "work_ms": statistics.median(works[key]) * 1e3, "late_p99_ms": _q(busy[key], 0.99),
                "late_max_ms": max(busy[key]), "late_share": sum(busy[key]) / 1e3 / (0.5 * args.rounds)}
        unpaced, paced = busy[(1.0, FLOP_COUNT_SLICE_SECONDS)], busy[(FLOP_COUNT_DUTY, FLOP_COUNT_SLICE_SECONDS)]
        row = {"first_ms": statistics.median(firsts) * 1e3, "first_wall_ms": statistics.median(walls) * 1e3,
               "new_signature_ms": statistics.median(news) * 1e3,
               "describe_us": describe_us, "flops": got.flops, "bytes": got.bytes,
               "stall_idle_p99_ms": _q(idle, 0.99), "stall_idle_max_ms": max(idle),
               "stall_unpaced_p99_ms": _q(unpaced, 0.99), "stall_unpaced_max_ms": max(unpaced),
               "stall_paced_p99_ms": _q(paced, 0.99), "stall_paced_max_ms": max(paced),
               "late_share_unpaced": sum(unpaced) / 1e3 / (0.5 * args.rounds),
               "late_share_paced": sum(paced) / 1e3 / (0.5 * args.rounds)}
        results["models"].setdefault(name, {}).update(row)
        rows.append([name, f"{row['first_ms']:.1f} ({row['first_wall_ms']:.0f})", f"{row['new_signature_ms']:.1f}",
                     f"{describe_us:.1f}", f"{row['stall_idle_p99_ms']:.2f} / {row['stall_idle_max_ms']:.2f}",
                     f"{row['stall_unpaced_p99_ms']:.2f} / {row['stall_unpaced_max_ms']:.2f} "
                     f"({row['late_share_unpaced']:.0%})",
                     f"{row['stall_paced_p99_ms']:.2f} / {row['stall_paced_max_ms']:.2f} "
                     f"({row['late_share_paced']:.0%})"])
    print(f"one-time import (FakeTensorMode -> torch._dynamo, in Monitor.start()): {first_import * 1e3:.0f} ms; "
          f"GIL switch interval {sys.getswitchinterval() * 1e3:.0f} ms")
    print(table(["model", "first count (copy + forward), ms of work (wall, paced)", "new signature, ms",
                 "describe (rare path), µs", "serving thread late, idle p99 / max ms",
                 "counting unpaced: p99 / max ms (late, share of time)", f"paced at {FLOP_COUNT_DUTY:g}: the same"],
                rows))
    print("\nThe same counts at other paces (work: a new signature's count, its pauses apart; late: the serving "
          "thread's wake, p99 / max, and the share of its time spent late):")
    print(table(["model", "pace", "work a count, ms", "late p99 / max, ms", "late, share"], paces))
    dump(args.json, results)
    return 0


def _count_one(counter: FlopCounter, ref: Any, make: Any, sizes: Any, works: list[float]) -> None:
    """Count one new signature (the next size), keeping its work (s)."""
    got = counter.count(ref, describe(*make(3 + next(sizes) % 50)))
    if isinstance(got, Count):
        works.append(got.seconds)


def _q(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


if __name__ == "__main__":
    raise SystemExit(main())
