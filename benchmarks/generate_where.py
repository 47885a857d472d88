"""Where a ``generate()`` request's added time goes, in wall time on the serving thread: bare vs wrapped, by segment.

``agent_cost.py`` compares whole requests, whose spread (±2-6 µs a token) hides a 1 µs cut. This splits a request at
the model's forward: the forward itself is the same in both variants, so what perfmon adds falls in the gaps
between forwards, each one timed alone. One tiny random GPT-2, wrapped and unwrapped between variants (the same
object, as ``agent_cost.py``), both with the same stamp at the entry and exit of its ``forward`` (a wrapper that keeps
the forward's signature, so perfmon still sees a generative model). Segments of a request:

- ``before the prefill``: from calling ``generate()`` to the prefill's forward (perfmon: opening the call, the
  prefill's stage and hot path);
- ``to the 1st decode``: the prefill's forward returning to the first decode step's forward (perfmon: the prefill's
  return path, the first decode step's stage and short path);
- ``a later step``: one decode step's forward returning to the next's (perfmon: a lean or checked step);
- ``after the last``: the last forward returning to ``generate()`` returning (perfmon: the call's end).

Four checks are reported apart, outside the sums: ``a forward`` (each forward's own time, which the segments take to be
the same in every variant), ``the whole request, a token`` (what ``agent_cost.py`` compares), and ``into generate()`` /
``out of generate()``: from calling ``generate()`` to transformers' own ``generate()`` starting, and from its return to
the caller's (a stamp there too, under every variant's wrapper): the part of the first and last segments that is the
wrapper's own work, without transformers' ~1 ms of preparation and its spread (the A/A reads ±0.05 µs). The stamps
partition a request, so it is exactly the sum of its parts; quantiles do not add up (the q25 of a sum is not the sum of
the parts' q25s: a part's slow tail moves the whole's q25), so a last table gives 10%-trimmed means, which nearly do:
each part's a request (its mean times its count), the forwards', and their sum beside the whole's.

A third variant, ``floor``, is the least any exact count of a ``generate()``'s forwards can cost in Python: a subclass
whose ``__call__`` reads a context variable and advances a counter before ``nn.Module._call_impl``, and whose
``generate()`` sets that variable around the call and appends one small object to a deque at its start and its end
(opening and settling handed over). No sampling decision, no stage, no signature, no error counting: what is left
between it and ``wrapped`` is perfmon's work, and what is between it and ``bare`` no design that counts every forward
in Python can avoid.

Each round runs the variants in a shuffled order (``settle_calls`` unmeasured ``generate()`` calls after each switch,
then one measured); the
figures are each segment's quantiles over the rounds (over every step, for a later step) and the wrapped minus bare
difference at each quantile. Monitor started, at the default 1% sampling, its low-traffic floor off (a call picked
by the floor, one in ~5 rounds here, has its tokens timed: a different path, ``agent_cost.py`` prices it), FLOPs off.

    python benchmarks/generate_where.py [--rounds 150] [--tokens 32] [--json out.json]

Not a test: read the differences on a quiet machine; the A/A (``bare again``) shows the noise.
(BENCHMARKS.md §3b, "where a request's time goes".)
"""

from __future__ import annotations

import argparse
import collections
import contextvars
import gc
import itertools
import random
import time
from typing import Any

import torch
from common import dump, machine, settle_calls, stamp_method, table, tiny_gpt2
from prometheus_client import CollectorRegistry

import perfmon

SEGMENTS = ("before the prefill", "to the 1st decode", "a later step", "after the last")
#: Also reported, not in the sums: each forward's own time (the model's; the segments take it to be the same in every
#: variant), and the whole request a token (what ``agent_cost.py`` compares: the segments, the forwards and the noise).
CHECKS = ("a forward", "the whole request, a token", "into generate()", "out of generate()")
QUANTILES = (0.1, 0.25, 0.5)


def _quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _trimmed_mean(values: list[float], cut: float = 0.1) -> float:
    """The mean of ``values`` without their lowest and highest ``cut`` (the host's stalls, either way)."""
    values = sorted(values)
    k = int(len(values) * cut)
    kept = values[k:len(values) - k] or values
    return sum(kept) / len(kept)


class _Open:
    """The floor's one object a call: what opening and settling would hand over."""

    __slots__ = ("end_ns", "model", "start_ns")


def floor_class(base: type) -> type:
    """``base`` with the least exact counting of its forwards inside its ``generate()`` (the module docstring)."""
    current: contextvars.ContextVar[_Open | None] = contextvars.ContextVar("floor", default=None)
    forwards = itertools.count()
    handed: collections.deque[_Open] = collections.deque(maxlen=1024)
    call_impl = torch.nn.Module._call_impl
    generate = base.generate  # type: ignore[attr-defined]

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        call = current.get()
        if call is not None and call.model is self:
            next(forwards)
        return call_impl(self, *args, **kwargs)

    def generate_(self: Any, *args: Any, **kwargs: Any) -> Any:
        call = _Open()
        call.model = self
        call.start_ns = time.perf_counter_ns()
        handed.append(call)
        token = current.set(call)
        try:
            out = generate(self, *args, **kwargs)
        finally:
            current.reset(token)
        call.end_ns = time.perf_counter_ns()
        handed.append(call)
        return out

    return type(base.__name__, (base,), {"__slots__": (), "__module__": base.__module__, "__call__": __call__,
                                          "generate": generate_})


class Variants:
    """Switches one model object between ``bare``/``bare again`` (its own class), ``floor`` (``floor_class``; with
    ``floor=True``) and ``wrapped`` (``mon.wrap`` under ``name``): the same object in every variant, so its memory
    layout is the same. ``close()`` gives it its own class back, unwrapped."""

    def __init__(self, mon: perfmon.Monitor, model: Any, name: str, *, floor: bool = False) -> None:
        self.mon, self.model, self.name = mon, model, name
        self.base = type(model)
        self.floor = floor_class(self.base) if floor else None
        self.wrapped = False

    def use(self, variant: str) -> None:
        want = variant == "wrapped"
        if want and not self.wrapped:
            self.model.__class__ = self.base
            self.mon.wrap(self.model, name=self.name)
        elif self.wrapped and not want:
            self.mon.unwrap(self.model)
        self.wrapped = want
        if not want:
            self.model.__class__ = self.floor if variant == "floor" and self.floor is not None else self.base

    def close(self) -> None:
        if self.wrapped:
            self.mon.unwrap(self.model)
            self.wrapped = False
        self.model.__class__ = self.base


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=150)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.tokens < 3 or args.rounds < 1:
        ap.error("--tokens must be at least 3 (a prefill, a first decode step and a later one) and --rounds at least 1")
    model = tiny_gpt2()
    base = type(model)
    stamps: list[int] = []  # each forward's start and return
    edges: list[int] = []  # transformers' own generate()'s start and return, under every wrapper
    clock = time.perf_counter_ns
    restore = [stamp_method(base, "forward", stamps), stamp_method(base, "generate", edges)]
    mon = perfmon.Monitor(port=None, registry=CollectorRegistry(), log_level="error", count_flops=False,
                          sample_floor_seconds=1e9).start()
    ids = torch.randint(2, 1000, (1, 8))
    kw = {"max_new_tokens": args.tokens, "min_new_tokens": args.tokens, "do_sample": False, "pad_token_id": 0}
    variants = ("bare", "bare again", "floor", "wrapped")
    switch = Variants(mon, model, "gpt2_tiny", floor=True)
    settle = settle_calls(args.tokens)

    def run(variant: str) -> dict[str, list[float]]:
        switch.use(variant)
        gc.disable()
        try:
            with torch.inference_mode():
                for _ in range(settle):  # after the switch: not measured (SETTLE_EXECUTIONS)
                    model.generate(ids, **kw)
                stamps.clear()
                edges.clear()
                t0 = clock()
                model.generate(ids, **kw)
                t1 = clock()
        finally:
            gc.enable()
        s = stamps
        gaps = [(s[i + 1] - s[i]) / 1e3 for i in range(1, len(s) - 1, 2)]  # a forward's exit to the next's entry
        return {"a forward": [(s[i + 1] - s[i]) / 1e3 for i in range(0, len(s) - 1, 2)],
                "the whole request, a token": [(t1 - t0) / 1e3 / args.tokens],
                "before the prefill": [(s[0] - t0) / 1e3], "to the 1st decode": gaps[:1], "a later step": gaps[1:],
                "after the last": [(t1 - s[-1]) / 1e3],
                "into generate()": [(edges[0] - t0) / 1e3], "out of generate()": [(t1 - edges[-1]) / 1e3]}

    try:
        for _ in range(3):
            for v in variants:
                run(v)
        times: dict[str, dict[str, list[float]]] = {v: {k: [] for k in (*SEGMENTS, *CHECKS)} for v in variants}
        for _ in range(args.rounds):
            order = list(variants)
            random.shuffle(order)
            for v in order:
                for k, values in run(v).items():
                    times[v][k].extend(values)
        switch.close()
    finally:
        mon.stop()
        for put_back in restore:
            put_back()
    result: dict[str, Any] = {"machine": machine(), "rounds": args.rounds, "tokens": args.tokens, "segments": {}}
    rows = []
    for k in SEGMENTS:
        bare = [_quantile(times["bare"][k], q) for q in QUANTILES]
        seg: dict[str, Any] = {"bare_us": bare}
        for v in variants[1:]:
            added = [_quantile(times[v][k], q) - b for q, b in zip(QUANTILES, bare)]
            seg[v] = added
            rows.append([k, v, f"{bare[1]:.1f}", *(f"{a:+.2f}" for a in added)])
        result["segments"][k] = seg
    steps = args.tokens - 2  # later steps a request: its decode steps after the first
    per_request = {v: [sum(result["segments"][k][v][i] * (steps if k == "a later step" else 1) for k in SEGMENTS)
                       for i in range(len(QUANTILES))] for v in variants[1:]}
    for v, totals in per_request.items():
        rows.append(["a request, summed", v, "", *(f"{t:+.1f}" for t in totals)])
        rows.append(["a token, summed", v, "", *(f"{t / args.tokens:+.2f}" for t in totals)])
    result["per_request_us"] = per_request
    for k in CHECKS:  # apart from the sums (CHECKS)
        bare = [_quantile(times["bare"][k], q) for q in QUANTILES]
        check: dict[str, Any] = {"bare_us": bare}
        for v in variants[1:]:
            check[v] = [_quantile(times[v][k], q) - b for q, b in zip(QUANTILES, bare)]
            rows.append([k, v, f"{bare[1]:.1f}", *(f"{a:+.2f}" for a in check[v])])
        result["segments"][k] = check
    # 10%-trimmed means, a request's worth of each part (its mean times its count a request): they add up.
    means: dict[str, dict[str, float]] = {}
    for v in variants[1:]:
        parts = {k: (_trimmed_mean(times[v][k]) - _trimmed_mean(times["bare"][k])) * len(times[v][k]) / args.rounds
                 for k in (*SEGMENTS, "a forward")}
        whole = (_trimmed_mean(times[v]["the whole request, a token"])
                 - _trimmed_mean(times["bare"]["the whole request, a token"])) * args.tokens
        means[v] = {**parts, "segments": sum(parts[k] for k in SEGMENTS), "whole": whole}
    result["trimmed_means_us_per_request"] = means
    print(f"\ngenerate() of a tiny GPT-2, {args.tokens} tokens, {args.rounds} rounds, monitor running, 1% sampling: "
          f"µs added by segment (quantile differences against bare)\n")
    print(table(["segment", "variant", "bare q25 µs", "q10", "q25", "median"], rows))
    print("\nThe same by 10%-trimmed means, µs a token added (a part's mean times its count a request, a token):\n")
    mean_rows = []
    for v, m in means.items():
        figures = (m["segments"], m["a forward"], m["segments"] + m["a forward"], m["whole"])
        mean_rows.append([v, *(f"{x / args.tokens:+.2f}" for x in figures)])
    print(table(["variant", "segments", "the forwards", "their sum", "the whole request"], mean_rows))
    dump(args.json, result)


if __name__ == "__main__":
    main()
