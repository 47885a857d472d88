"""What a timed call costs its caller outside the timed window, with the caches cold as in a server.

Between two timed calls at 1% a server runs a hundred untimed ones and its own work (parsing, JSON, the socket), so
the bookkeeping of a timed call (``ModelState.due`` before the start stamp, ``finish`` after the end stamp) runs with
what it touches evicted: each object read costs cache misses, not nanoseconds (helpers measured 26-35 µs after the end
stamp in thread-per-request servers). This reproduces that in one thread: a wrapped Linear(64, 64) at 1%, the monitor
started, and between calls (``cold``) 12 MB copied and a 300-key dict serialised; ``warm`` is the same without.

The caller stamps every call; each resolved sample (a sink on the resolver) is matched to the call whose stamps hold
its end stamp, which gives ``before`` (caller's stamp to perfmon's start stamp) and ``after`` (perfmon's end stamp to
the caller's). Variants, interleaved round by round, one Monitor each: the default exemplar reader (OpenTelemetry's
span read on the resolver thread from the caller's context, when opentelemetry-api is installed), the whole read on
the request thread (``otel_reader``, as before session 33), and no reader. An untimed call's own wrapper cost is a few
hundred ns (``overhead.py``): what is shown here is the timed call's extra, paid by 1 call in 100.

    python benchmarks/finish_cold.py [--rounds 12] [--calls 3000] [--json out.json]

Not a test: read the medians, on a quiet machine.
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
import time
from typing import Any

import torch
from common import dump, machine, monitor, table

from perfmon.agent.exemplars import otel_reader

_BUF = (bytearray(12 << 20), bytearray(12 << 20))
_JUNK = {str(i): [i, str(i) * 3, {"k": i}] for i in range(300)}


def evict() -> None:
    """What a server does between two calls of its model, roughly: enough to evict L1/L2 (and some L3)."""
    _BUF[1][:] = _BUF[0]
    json.dumps(_JUNK)


class Variant:
    """One monitor, one wrapped Linear(64, 64) at 1%, and the timed calls' outside costs it gathered (ns)."""

    def __init__(self, name: str, **kw: Any) -> None:
        self.name = name
        self.mon = monitor(sample_rate=0.01, warmup_calls=1, sample_floor_seconds=3600.0, **kw).start()
        self.samples: list[Any] = []
        self.mon.resolver.sinks.append(self.samples.extend)
        self.model = self.mon.wrap(torch.nn.Linear(64, 64), name="lin")
        self.before: dict[bool, list[int]] = {True: [], False: []}
        self.after: dict[bool, list[int]] = {True: [], False: []}

    def run(self, calls: int, cold: bool) -> None:
        x, model, clock = torch.randn(1, 64), self.model, time.perf_counter_ns
        starts, ends = [0] * calls, [0] * calls
        with torch.inference_mode():
            for i in range(calls):
                if cold:
                    evict()
                starts[i] = clock()
                model(x)
                ends[i] = clock()
        self.mon.flush()
        for s in self.samples:
            if s.phase != "steady":
                continue
            i = bisect.bisect_right(starts, s.end_ns) - 1
            if 0 <= i < calls and starts[i] <= s.end_ns <= ends[i]:
                start_ns = s.end_ns - round(s.host_seconds * 1e9)
                self.before[cold].append(start_ns - starts[i])
                self.after[cold].append(ends[i] - s.end_ns)
        self.samples.clear()


def q(values: list[int], p: float) -> float:
    """Quantile ``p`` of ``values`` (ns) in µs."""
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, int(p * len(v)))] / 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--calls", type=int, default=3000, help="calls a variant makes a round (~30 timed at 1%%)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    variants = [Variant("default reader"), Variant("no reader", trace_reader=None)]
    if otel_reader() is not None:
        variants.insert(1, Variant("span read on the request thread", trace_reader=otel_reader()))
    for v in variants:  # warm-up: the cold call, the first batches
        v.run(500, False)
        for d in (v.before, v.after):
            d[False].clear()
    for r in range(args.rounds):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for cold in (True, False):
            for v in order:
                v.run(args.calls, cold)
    for v in variants:
        v.mon.close()
    rows, data = [], {}
    for v in variants:
        for cold in (True, False):
            b, a = v.before[cold], v.after[cold]
            rows.append([v.name, "cold" if cold else "warm", len(a), f"{q(b, .5):.1f}", f"{q(b, .9):.1f}",
                         f"{q(a, .5):.1f}", f"{q(a, .9):.1f}",
                         f"{(statistics.median(a) + statistics.median(b)) / 100 / 1000:.2f}" if a else "-"])
            data[f"{v.name}/{'cold' if cold else 'warm'}"] = {"timed": len(a), "before_p50_us": q(b, .5),
                                                              "after_p50_us": q(a, .5), "after_p90_us": q(a, .9)}
    print(machine())
    print(f"{args.rounds} rounds x {args.calls} calls a variant and cache state, Linear(64, 64) at 1%, started\n")
    print(table(["variant", "caches", "timed calls", "before p50 µs", "p90", "after p50 µs", "p90",
                 "per call at 1% µs"], rows, "llrrrrrr"))
    dump(args.json, data)


if __name__ == "__main__":
    main()
