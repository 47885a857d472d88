"""What reading the OpenTelemetry span adds to a timed call (exemplars).

Two parts. On the request thread a timed call adds one ``trace_reader()`` call: timed alone (timeit,
best of 5), without and inside a sampled span. The resolver thread then builds the exemplar (hex ids,
wall-clock stamp): timed alone too. End to end, three monitors at 100% sampling wrap the same
nn.Linear(64, 64) (batch 8): no trace reader (OTel absent), the reader with no span active, and the
reader inside a sampled span; rounds interleave the variants (order rotated); reported is the median
per-call time against the no-reader variant. At 100% sampling the resolver's work competes with the
caller for the GIL, so that row is an upper bound; the reader runs only on timed calls, so at the
default 1% sampling the per-call average is 1/100 of it.

    python benchmarks/exemplars.py [--rounds 30] [--calls 2000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from contextlib import nullcontext
from typing import Any

import torch
from common import machine, table
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags
from prometheus_client import CollectorRegistry

import perfmon


def span() -> Any:
    ctx = SpanContext(0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, is_remote=False,
                      trace_flags=TraceFlags(TraceFlags.SAMPLED))
    return trace.use_span(NonRecordingSpan(ctx))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()
    print(machine())
    import timeit

    from perfmon.agent.exemplars import otel_reader
    from perfmon.metrics.store import trace_exemplar

    reader = otel_reader()
    assert reader is not None
    n = 200_000

    def best(fn: Any) -> float:
        return min(timeit.repeat(fn, number=n, repeat=5)) / n * 1e9

    micro = [["trace_reader(), no span (request thread)", f"{best(reader):.0f} ns"]]
    with span():
        micro.append(["trace_reader(), sampled span (request thread)", f"{best(reader):.0f} ns"])
        trace_ids = reader()
    assert trace_ids is not None
    micro.append(["trace_exemplar() (resolver thread)",
                  f"{best(lambda: trace_exemplar(trace_ids, 0.001, time.perf_counter_ns())):.0f} ns"])
    print(table(["step", "cost"], micro, "lr"))
    torch.set_num_threads(1)
    x = torch.randn(8, 64)
    variants: dict[str, tuple[Any, Any]] = {}
    monitors = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sample_rate=1.0 warns: on purpose here
        for name in ("no reader (OTel absent)", "reader, no span", "reader, sampled span"):
            reader: dict[str, Any] = {"trace_reader": None} if name.startswith("no reader") else {}
            mon = perfmon.Monitor(port=None, registry=CollectorRegistry(), sample_rate=1.0, regression=None,
                                  prepare_profiler=False, log_format="json", log_level="error",
                                  queue_size=1_000_000, **reader).start()
            model = mon.wrap(torch.nn.Linear(64, 64), name="lin")
            variants[name] = (model, span if name.endswith("sampled span") else nullcontext)
            monitors.append(mon)
    per_call: dict[str, list[float]] = {name: [] for name in variants}
    with torch.inference_mode():
        names = list(variants)
        for r in range(args.rounds):
            for name in names[r % 3:] + names[:r % 3]:
                model, ctx = variants[name]
                with ctx():
                    t0 = time.perf_counter_ns()
                    for _ in range(args.calls):
                        model(x)
                    per_call[name].append((time.perf_counter_ns() - t0) / args.calls)
            for mon in monitors:
                mon.flush()
    base = statistics.median(per_call["no reader (OTel absent)"])
    rows = [[name, f"{statistics.median(v) / 1e3:.2f} µs", f"{(statistics.median(v) - base):+.0f} ns"]
            for name, v in per_call.items()]
    print(table(["timed call (100% sampling)", "median per call", "vs no reader"], rows, "lrr"))
    for mon in monitors:
        mon.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
