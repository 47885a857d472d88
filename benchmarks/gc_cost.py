"""What timing GC pauses costs (``make bench`` runs it): the hook per collection, how often typical serving loops
collect, and so what the serving threads pay per second; and the resolver's side (drain per pause, mark per sample).

The hook (perfmon/telemetry/gcpauses.py) runs inside every collection of the process, on the thread that
collected: per collection, two calls from the collector into Python (``start``, ``stop``), two clock reads, one
tuple and one ``deque.append``. Measured three ways: the two calls made directly (min of 7 x 200,000), and
``gc.collect(0)`` on a small heap with no callback, an empty Python callback (what any ``gc.callbacks`` user
pays) and perfmon's hook (min of 7 x 20,000 each). The loops count collections with ``gc.get_stats()`` over
``--seconds`` of calls, bare and wrapped by a started monitor. Nothing here is on the wrapped call's path.

Not a test: read the table on a quiet machine.
"""

from __future__ import annotations

import argparse
import gc
import time
import timeit
from collections.abc import Callable
from typing import Any

import torch

from perfmon.agent.records import STEADY, Sample
from perfmon.faults import InternalErrors
from perfmon.metrics.collectors import GcCollector
from perfmon.telemetry import gcpauses
from perfmon.telemetry.gcpauses import GcPauses

try:
    from common import dump, machine, monitor, table
except ImportError:  # run as `python -m benchmarks.gc_cost` from the repository root
    from benchmarks.common import dump, machine, monitor, table


def _best(fn: Callable[[], Any], number: int, repeat: int = 7) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number


def hook_cost() -> list[tuple[str, float]]:
    """ns per collection: the hook's two calls alone, and gc.collect(0) without / with an empty / with the hook."""
    info = {"generation": 0, "collected": 0, "uncollectable": 0}
    pauses = GcPauses(internal=InternalErrors())
    pauses.install()
    try:
        on_gc = gcpauses._on_gc

        def both() -> None:
            on_gc("start", info)
            on_gc("stop", info)  # the ring is bounded: a full one drops its oldest

        direct = _best(both, 200_000)
    finally:
        pauses.uninstall()

    def empty(phase: str, info: dict[str, int]) -> None:
        pass

    def collect0() -> None:
        gc.collect(0)

    saved = list(gc.callbacks)
    gc.callbacks.clear()  # the measured callbacks alone
    try:
        bare = _best(collect0, 20_000)
        gc.callbacks.append(empty)
        with_empty = _best(collect0, 20_000)
        gc.callbacks.clear()
        pauses.install()
        with_hook = _best(collect0, 20_000)
        pauses.uninstall()
    finally:
        gc.callbacks[:] = saved
    return [("hook's two calls, made directly", direct * 1e9),
            ("gc.collect(0), no callback", bare * 1e9),
            ("gc.collect(0) + an empty Python callback", with_empty * 1e9),
            ("gc.collect(0) + perfmon's hook", with_hook * 1e9),
            ("perfmon's hook, added per collection", (with_hook - bare) * 1e9)]


def _collections() -> list[int]:
    return [s["collections"] for s in gc.get_stats()]


def _rate(step: Callable[[], Any], seconds: float) -> tuple[float, list[float]]:
    """(calls per second, collections per second by generation) over ``seconds`` of ``step``."""
    step()
    before, t0, n = _collections(), time.perf_counter(), 0
    deadline = t0 + seconds
    while time.perf_counter() < deadline:
        step()
        n += 1
    elapsed = time.perf_counter() - t0
    return n / elapsed, [(b - a) / elapsed for a, b in zip(before, _collections(), strict=True)]


def loops(seconds: float) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    out = []
    stack = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(256, 256), torch.nn.ReLU())]).eval()
    x = torch.randn(8, 256)
    def with_garbage(m: torch.nn.Module) -> Any:
        # What a web framework leaves per request: a small reference cycle (a context that holds a callback that
        # holds the context), freed only by the collector.
        ctx: dict[str, Any] = {"headers": {"a": "b"}, "body": [1, 2, 3]}
        ctx["done"] = lambda: ctx
        return m(x)

    cases: list[tuple[str, torch.nn.Module, Callable[[torch.nn.Module], Any]]] = [
        ("Linear(256)x4 stack, batch 8", stack, lambda m: m(x)),
        ("the same + a request's reference cycle", stack, with_garbage)]
    try:
        import transformers

        cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=101, n_positions=128,
                                      bos_token_id=0, eos_token_id=0)
        gpt2 = transformers.GPT2LMHeadModel(cfg).eval()
        ids = torch.randint(1, 100, (1, 8))
        gen_kw = {"max_new_tokens": 32, "do_sample": False, "pad_token_id": 0, "attention_mask": torch.ones_like(ids)}
        cases.append(("tiny GPT-2 generate(), 32 new tokens", gpt2, lambda m: m.generate(ids, **gen_kw)))
    except ImportError:
        print("transformers not installed: the GPT-2 loop is skipped")
    with torch.no_grad():
        for name, model, call in cases:
            calls, rates = _rate(lambda model=model, call=call: call(model), seconds)
            out.append({"loop": name, "monitor": "none", "calls_per_second": calls, "collections_per_second": rates})
            mon = monitor(regression=None).start()
            wrapped = mon.wrap(model, name="m")
            calls, rates = _rate(lambda wrapped=wrapped, call=call: call(wrapped), seconds)
            assert mon.flush()
            mon.stop()
            mon.unwrap(wrapped)
            out.append({"loop": name, "monitor": "started, 1% sampling", "calls_per_second": calls,
                        "collections_per_second": rates})
    return out


def resolver_cost() -> list[tuple[str, float]]:
    """ns on the resolver thread: draining a pause (histogram + kept), marking a sample that overlapped none / one."""
    pauses = GcPauses(internal=InternalErrors())
    pauses.sinks.append(GcCollector(lambda: ["m"]).observe)
    t = 10**12
    batch = [(t + i * 1_000_000, t + i * 1_000_000 + 50_000, 0, 3) for i in range(4096)]

    def drain() -> None:
        pauses.ring.extend(batch)
        pauses.drain()

    per_pause = _best(drain, 20) / len(batch)
    last = t + 4095 * 1_000_000
    clear = [Sample("m", "cpu", STEADY, 0, 1e-4, 1e-4, last + 10_000_000 + i) for i in range(4096)]
    hit = [Sample("m", "cpu", STEADY, 0, 1e-4, 1e-4, t + i * 1_000_000 + 60_000) for i in range(4096)]
    mark_clear = _best(lambda: pauses.mark(list(clear)), 20) / len(clear)
    mark_hit = _best(lambda: pauses.mark(list(hit)), 20) / len(hit)
    return [("drain, per pause (histogram observe + kept)", per_pause * 1e9),
            ("mark, per sample after the newest pause", mark_clear * 1e9),
            ("mark, per sample that overlapped a pause", mark_hit * 1e9)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=5.0, help="seconds of each serving loop")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    print(machine())
    hook = hook_cost()
    print(table(["serving thread, per collection", "ns"], [(k, f"{v:,.0f}") for k, v in hook]))
    per = max(0.0, dict(hook)["perfmon's hook, added per collection"])
    rows = loops(args.seconds)
    print()
    print(table(["loop", "monitor", "calls/s", "gen-0/s", "gen-1/s", "gen-2/s", "hook µs/s", "of a core"],
                [(r["loop"], r["monitor"], f"{r['calls_per_second']:,.0f}",
                  *(f"{c:.1f}" for c in r["collections_per_second"]),
                  f"{sum(r['collections_per_second']) * per / 1e3:.2f}",
                  f"{sum(r['collections_per_second']) * per / 1e9:.5%}") for r in rows], "llrrrrrr"))
    res = resolver_cost()
    print()
    print(table(["resolver thread", "ns"], [(k, f"{v:,.0f}") for k, v in res]))
    dump(args.json, {"machine": machine(), "hook_ns": dict(hook), "loops": rows, "resolver_ns": dict(res)})


if __name__ == "__main__":
    main()
