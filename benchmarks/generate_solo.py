"""A ``generate()`` request with one variant a process: what the interleaved benchmarks cannot see.

``agent_cost.py`` and ``generate_where.py`` run every variant in one process, so a process-wide effect of perfmon's
(its threads, its objects' layout, a class of the model's made at wrap time) falls on bare and wrapped alike, and
switching a model's class between variants has costs of its own. Here each process runs one variant only, from the
start: ``bare`` (the model, the monitor started), ``wrapped`` (the same, ``mon.wrap``ped: its calls run quiet) or
``view`` (no perfmon at all: the model's ``generate()`` run on a subclass object sharing its ``__dict__``, as a quiet
call's view does). ``--pairs`` rounds of bare and each other variant, their order alternating; each process times
120 requests of the tiny GPT-2 (32 tokens) after 10 unmeasured, with a stamp in ``forward``: each forward's own time
and the whole request a token, at q25. A process's own layout moves these by ±10-20 µs a token, so the figure is the
mean over processes against bare's, with its standard error.

    python benchmarks/generate_solo.py [--pairs 12] [--variants wrapped,view] [--json out.json]

Not a test: a pair of processes takes ~12 s. (BENCHMARKS.md §3b, "one variant a process".)
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import subprocess
import sys
import time
from typing import Any

from common import dump, machine, stamp_method, table, tiny_gpt2

VARIANTS = ("bare", "wrapped", "view")


def child(variant: str) -> None:
    """One process, one variant: prints one JSON line (q25 of a forward, of a whole request a token, µs)."""
    import torch
    from prometheus_client import CollectorRegistry

    import perfmon

    torch.manual_seed(0)
    model: Any = tiny_gpt2()
    base = type(model)
    stamps: list[int] = []
    clock = time.perf_counter_ns
    stamp_method(base, "forward", stamps)
    mon = perfmon.Monitor(port=None, registry=CollectorRegistry(), log_level="error", count_flops=False,
                          sample_floor_seconds=1e9).start()
    if variant == "wrapped":
        mon.wrap(model, name="gpt2_tiny")
    elif variant == "view":
        cls = type(base.__name__, (base,), {"__slots__": (), "__module__": base.__module__,
                                            "__qualname__": base.__qualname__,
                                            "__call__": torch.nn.Module._call_impl})
        view = cls.__new__(cls)
        object.__setattr__(view, "__dict__", model.__dict__)
        model = view
    ids = torch.randint(2, 1000, (1, 8))
    kw = {"max_new_tokens": 32, "min_new_tokens": 32, "do_sample": False, "pad_token_id": 0}
    forwards: list[float] = []
    whole: list[float] = []
    with torch.inference_mode():
        for _ in range(10):
            model.generate(ids, **kw)
        for _ in range(120):
            stamps.clear()
            gc.disable()
            t0 = clock()
            model.generate(ids, **kw)
            t1 = clock()
            gc.enable()
            forwards += [(stamps[i + 1] - stamps[i]) / 1e3 for i in range(0, len(stamps) - 1, 2)]
            whole.append((t1 - t0) / 1e3 / 32)
    mon.stop()
    forwards.sort()
    whole.sort()
    print(json.dumps({"variant": variant, "forward": forwards[len(forwards) // 4], "whole": whole[len(whole) // 4]}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=12)
    ap.add_argument("--variants", default="wrapped,view", help="compared with bare, comma-separated")
    ap.add_argument("--json")
    ap.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child)
        return
    others = [v for v in args.variants.split(",") if v]
    if args.pairs < 2 or not others or any(v not in VARIANTS[1:] for v in others):
        ap.error(f"--pairs must be at least 2 and --variants a list of {', '.join(VARIANTS[1:])}")
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in ("bare", *others)}
    for i in range(args.pairs):
        for other in others:
            for v in (("bare", other) if i % 2 else (other, "bare")):
                out = subprocess.run([sys.executable, __file__, "--child", v], capture_output=True, text=True,
                                     timeout=300, check=True)
                runs[v].append(json.loads(out.stdout.strip().splitlines()[-1]))
    result: dict[str, Any] = {"machine": machine(), "pairs": args.pairs, "runs": runs}
    rows = []
    for v in others:
        for k, label in (("forward", "a forward"), ("whole", "the whole request, a token")):
            bare = [r[k] for r in runs["bare"]]
            mine = [r[k] for r in runs[v]]
            diff = statistics.mean(mine) - statistics.mean(bare)
            se = math.sqrt(statistics.variance(bare) / len(bare) + statistics.variance(mine) / len(mine))
            result[f"{v} {k}"] = {"added_us": diff, "se_us": se, "bare_us": statistics.mean(bare)}
            rows.append([v, label, f"{statistics.mean(bare):.1f}", f"{diff:+.2f}", f"{se:.2f}",
                         f"{statistics.median(mine) - statistics.median(bare):+.2f}"])
    print(f"\ngenerate() of a tiny GPT-2, 32 tokens, one variant a process, {args.pairs} processes a variant: µs "
          "added against bare (q25 within a process; mean over processes)\n")
    print(table(["variant", "what", "bare µs", "added", "± (s.e.)", "added, medians"], rows))
    dump(args.json, result)


if __name__ == "__main__":
    main()
