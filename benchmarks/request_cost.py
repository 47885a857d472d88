"""What request spans cost: the wrapped call's hot path with no span open, with one open, and a span itself.

    python benchmarks/request_cost.py [--rounds 30] [--calls 20000]

Per call (added to the bare call, median over interleaved rounds of per-round differences, the monitor
constructed but not started, as benchmarks/overhead.py does): a monitored identity function and an
nn.Linear(64, 64) on a batch of 8, each
  - with no request span open in the process (the hot path reads Hub.requests and moves on),
  - inside an open span (context variable read and set, two clock reads, the span's stamps),
  - with a span open on another context only (the variable read finds none).
Per request: a span opened and ended with no model work, with model work stamped by hand (its record queued
for the resolver), and with one wrapped call in it; and the resolver's drain per queued record (sinks included).

Not a test: timings on a shared 2-core machine are noisy (read ratios, not absolutes).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import perfmon


def _per_call(fn: Callable[[], Any], calls: int) -> float:
    t0 = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    return (time.perf_counter_ns() - t0) / calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=20_000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    mon = perfmon.Monitor(port=None, nvml=False, sample_rate=0.01)  # not started: the hot path's own cost
    ident = mon.instrument(lambda x: x, name="ident")
    bare_lin = torch.nn.Linear(64, 64)
    lin = mon.wrap(torch.nn.Linear(64, 64), name="lin")
    x = torch.randn(8, 64)
    has_spans = hasattr(mon, "request")
    for _ in range(200):  # warm-up and signatures
        ident(1)
        lin(x)
    variants: dict[str, Callable[[], Any]] = {
        "bare function": lambda: (lambda v: v)(1),
        "function, no span open": lambda: ident(1),
        "bare Linear(64,64) b=8": lambda: bare_lin(x),
        "Linear, no span open": lambda: lin(x),
    }
    results: dict[str, list[float]] = {k: [] for k in variants}
    extra: dict[str, list[float]] = {}
    rounds = args.rounds
    for _ in range(rounds):
        gc.disable()
        try:
            for name, fn in variants.items():
                results[name].append(_per_call(fn, args.calls))
            if has_spans:
                with mon.request(name="bench"):
                    extra.setdefault("function, span open", []).append(_per_call(lambda: ident(1), args.calls))
                    extra.setdefault("Linear, span open", []).append(_per_call(lambda: lin(x), args.calls))
                other = mon.request(name="bench")  # open, but not in this context
                extra.setdefault("function, span open elsewhere", []).append(_per_call(lambda: ident(1), args.calls))
                other.finish()

                def empty_span() -> None:
                    with mon.request(name="bench"):
                        pass

                def span_with_call() -> None:
                    with mon.request():
                        ident(1)

                def span_with_work() -> None:
                    with mon.request() as span:
                        span.enqueued()
                        t = time.perf_counter_ns()
                        span.model_call(t, t + 1000, "bench")

                n = max(1, args.calls // 10)
                mon.requests.drain()
                extra.setdefault("request span, no model work", []).append(_per_call(empty_span, n))
                extra.setdefault("request span, enqueue + model stamp", []).append(_per_call(span_with_work, n))
                t0 = time.perf_counter_ns()
                drained = mon.requests.drain()
                took = (time.perf_counter_ns() - t0) / max(1, drained)
                extra.setdefault("resolver drain per record", []).append(took)
                extra.setdefault("request span + 1 wrapped call", []).append(_per_call(span_with_call, n))
                mon.requests.drain()
        finally:
            gc.enable()
    med = {k: statistics.median(v) for k, v in {**results, **extra}.items()}
    print(f"torch {torch.__version__}, {rounds} rounds x {args.calls} calls; median ns per call")
    for name, value in med.items():
        print(f"  {name:36s} {value:9.1f}")
    diff = {"function, no span open": ("function, no span open", "bare function"),
            "Linear, no span open": ("Linear, no span open", "bare Linear(64,64) b=8")}
    if has_spans:
        diff |= {"function, span open": ("function, span open", "bare function"),
                 "Linear, span open": ("Linear, span open", "bare Linear(64,64) b=8"),
                 "function, span open elsewhere": ("function, span open elsewhere", "bare function")}
    print("added per call (median of per-round differences):")
    for label, (a, b) in diff.items():
        series = {**results, **extra}
        print(f"  {label:36s} {statistics.median(x - y for x, y in zip(series[a], series[b], strict=True)):+9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
