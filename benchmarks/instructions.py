"""What perfmon adds to the serving thread, in instructions executed: a figure a busy host cannot move.

Wall-time comparisons of a ``generate()`` request (``agent_cost.py``, ``generate_where.py``) spread ±1-3 µs a token
between runs of the same code on a shared 2-core host, wider than the ≤ +2 µs a token they are meant to check.
Instructions executed do not depend on the host's load. This runs itself under valgrind's callgrind (the child), with
collection switched on only inside ``sys.call_tracing`` (one measured request or batch of calls) and one profile dump
per measurement, variants interleaved in shuffled rounds in one process, as ``generate_where.py`` interleaves them:

- ``generate()`` of a tiny random GPT-2 (2 layers, d=64, 32 new tokens): ``bare``, ``bare again`` (the A/A),
  ``floor`` (``generate_where.floor_class``: the least any exact count of the forwards can cost in Python) and
  ``wrapped`` (the monitor's defaults, 1% sampling, its low-traffic floor off, FLOP counting off);
- 2,000 calls of Linear(64,64) on one row: ``bare`` and ``wrapped``.

The monitor is started (its resolver thread runs), no HTTP port. Under valgrind the process's threads run one at a
time, so a wake of another thread shows up as GIL signalling on the measured thread (``pthread_cond_*``,
futex): those functions are left out of ``work`` and reported apart (``hand-offs``); they are
valgrind's scheduling, not a native GIL hand-off's cost. Figures are the medians over the rounds; the A/A shows what
is left of the noise (the allocator's and the interpreter's caches: ~±0.1% of a request).

To read instructions as time, the parent times the same bare request natively: ``µs at the model's rate`` is the
added instructions at the bare request's own instructions per µs. Python code that runs once a step (perfmon's)
retires fewer instructions per µs than torch's kernels, so its wall time is higher than that (1-3x on the hosts
measured: BENCHMARKS.md §3b, "instructions").

    python benchmarks/instructions.py [--rounds 4] [--tokens 32] [--mode greedy] [--json out.json]

``--mode`` picks the requests' decoding (``MODES``): greedy, ``sample`` (top-k, top-p, temperature, one seed),
``beams`` (``num_beams=4``), ``streamer`` (a caller's streamer that keeps nothing) or ``no-cache``
(``use_cache=False``); every mode returns one sequence of ``--tokens`` tokens.

Needs ``valgrind`` on PATH (Debian: ``apt install valgrind``); without it, says so and exits 0. Takes ~4-6 minutes
(importing torch under valgrind is most of it).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
GENERATE = ("bare", "bare again", "floor", "wrapped")
LINEAR = ("bare", "wrapped")
LINEAR_CALLS = 2000
#: Functions of a measured thread that only signal or wait on a condition (the GIL's, when another thread woke): under
#: valgrind every thread runs in turn, so these count the scheduler's switches, not the serving thread's work. (Mutex
#: locks stay in ``work``: the allocator's arenas take them on every request.)
HANDOFF = re.compile(r"pthread_cond|futex|take_gil|drop_gil")
#: The C allocators' functions: most of what varies between two identical requests besides the hand-offs.
ALLOC = re.compile(r"obmalloc\.c:|/malloc\.c:")
#: The interpreter's own loop (the bytecodes of Python code, a model's and perfmon's alike): the steadiest part, as
#: the method cache and string-keyed dict lookups vary with what ran before (another thread, a class made).
EVAL_LOOP = ("ceval.c:_PyEval_EvalFrameDefault", "ceval.c:_PyEval_EvalFrameDefault'2")


#: Decoding modes ``--mode`` measures (``generate()``'s keywords beyond greedy's): each one returns one sequence of
#: ``--tokens`` tokens, so "a token" is a token the caller receives in every mode.
MODES = ("greedy", "sample", "beams", "streamer", "no-cache")


def generate_kwargs(mode: str, tokens: int) -> dict[str, Any]:
    """``generate()``'s keywords for ``mode`` (``MODES``): greedy's, plus the mode's own."""
    kw: dict[str, Any] = {"max_new_tokens": tokens, "min_new_tokens": tokens, "do_sample": False, "pad_token_id": 0}
    if mode == "sample":
        kw.update(do_sample=True, top_k=50, top_p=0.9, temperature=0.8)
    elif mode == "beams":
        kw.update(num_beams=4)
    elif mode == "streamer":
        from transformers.generation.streamers import BaseStreamer

        class _Drop(BaseStreamer):  # type: ignore[misc]
            """A caller's streamer that keeps nothing but a count of its puts (the prompt's, then one a step): its own
            cost is the same in every variant."""

            puts = 0

            def put(self, value: Any) -> None:
                self.puts += 1

            def end(self) -> None:
                pass

        kw.update(streamer=_Drop())
    elif mode == "no-cache":
        kw.update(use_cache=False)
    return kw


def child(rounds: int, tokens: int, order_path: str, mode: str = "greedy") -> None:
    """Run under callgrind: each measurement inside ``sys.call_tracing`` (one dump each), its name in ``order_path``."""
    import gc

    import torch
    from prometheus_client import CollectorRegistry

    import perfmon

    sys.path.insert(0, HERE)
    from common import settle_calls, tiny_gpt2
    from generate_where import Variants

    torch.set_num_threads(1)
    random.seed(0)
    torch.manual_seed(0)  # the same weights in every run
    model = tiny_gpt2()
    ids = torch.randint(2, 1000, (1, 8))
    kw = generate_kwargs(mode, tokens)
    linear = torch.nn.Linear(64, 64)
    row = torch.ones(1, 64)
    mon = perfmon.Monitor(port=None, registry=CollectorRegistry(), log_level="error", count_flops=False,
                          sample_floor_seconds=1e9, prepare_profiler=False).start()
    variants = {"gpt2": Variants(mon, model, "gpt2", floor=True), "linear": Variants(mon, linear, "linear")}

    def generate() -> None:
        if mode == "sample":  # the same draws in every variant's request
            torch.manual_seed(0)
        with torch.inference_mode():
            model.generate(ids, **kw)

    def calls() -> None:
        with torch.inference_mode():
            for _ in range(LINEAR_CALLS):
                linear(row)

    settle = settle_calls(tokens)

    def measure(name: str, fn: Any, log: Any) -> None:
        for _ in range(settle if name.startswith("generate/") else 1):  # after a switch: not measured (common.py)
            fn()
        gc.collect()
        gc.disable()
        try:
            sys.call_tracing(fn, ())
        finally:
            gc.enable()
        log.write(name + "\n")
        log.flush()

    with open(order_path, "w") as log:
        try:
            for _ in range(2):
                for v in GENERATE:
                    variants["gpt2"].use(v)
                    generate()
            for _ in range(rounds):
                order = list(GENERATE)
                random.shuffle(order)
                for v in order:
                    variants["gpt2"].use(v)
                    measure(f"generate/{v}", generate, log)
                order = list(LINEAR)
                random.shuffle(order)
                for v in order:
                    variants["linear"].use(v)
                    measure(f"linear/{v}", calls, log)
        finally:
            for switch in variants.values():
                switch.close()
            mon.stop()


def _costs(path: str) -> dict[str, int]:
    """One callgrind dump's costs: ``total`` instructions, ``handoff`` (``HANDOFF``'s functions) and ``alloc`` (the C
    allocators': obmalloc's and glibc's malloc, whose cost depends on their arenas' state as much as on the call);
    with the cache simulated, ``cycles`` too (callgrind_annotate's estimate: Ir + 10 a first-level miss + 100 a
    last-level one) and the ``l1`` and ``ll`` misses."""
    events: list[str] = []
    totals: list[int] = []
    with open(path) as f:
        for line in f:
            if line.startswith("events:"):
                events = line.split()[1:]
            elif line.startswith("summary:") or line.startswith("totals:"):
                totals = [int(x) for x in line.split()[1:]]
                break
    got = dict(zip(events, totals))
    costs = {"total": got.get("Ir", 0)}
    if "I1mr" in got:  # callgrind leaves trailing zero counts out of the summary line
        costs["l1"] = got["I1mr"] + got.get("D1mr", 0) + got.get("D1mw", 0)
        costs["ll"] = got.get("ILmr", 0) + got.get("DLmr", 0) + got.get("DLmw", 0)
        costs["cycles"] = costs["total"] + 10 * costs["l1"] + 100 * costs["ll"]
    if "Bc" in got:  # branch simulation: conditional and indirect branches mispredicted
        costs["mispredicts"] = got.get("Bcm", 0) + got.get("Bim", 0)
    out = subprocess.run(["callgrind_annotate", "--inclusive=no", "--threshold=100", "--show=Ir", path],
                         capture_output=True, text=True, check=True).stdout
    handoff = alloc = interp = 0
    for line in out.splitlines():
        m = re.match(r"\s*([\d,]+) \([^)]*\)\s+(\S+)", line)
        if m is None:
            continue
        name, n = m.group(2), int(m.group(1).replace(",", ""))
        if HANDOFF.search(name):
            handoff += n
        elif ALLOC.search(name):
            alloc += n
        if name.endswith(EVAL_LOOP):
            interp += n
    costs.update(handoff=handoff, alloc=alloc, eval=interp)
    return costs


def _native_us(tokens: int, mode: str = "greedy", n: int = 15) -> tuple[float, float]:
    """The bare request's and the bare Linear(64,64) call's median wall times here, natively (µs)."""
    import torch
    from common import tiny_gpt2

    torch.manual_seed(0)
    model = tiny_gpt2()
    ids = torch.randint(2, 1000, (1, 8))
    kw = generate_kwargs(mode, tokens)
    linear, row = torch.nn.Linear(64, 64), torch.ones(1, 64)
    requests, calls = [], []
    with torch.inference_mode():
        for i in range(n + 3):
            if mode == "sample":
                torch.manual_seed(0)
            t0 = time.perf_counter_ns()
            model.generate(ids, **kw)
            t1 = time.perf_counter_ns()
            for _ in range(LINEAR_CALLS):
                linear(row)
            t2 = time.perf_counter_ns()
            if i >= 3:
                requests.append((t1 - t0) / 1e3)
                calls.append((t2 - t1) / 1e3 / LINEAR_CALLS)
    return statistics.median(requests), statistics.median(calls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--json")
    ap.add_argument("--mode", choices=MODES, default="greedy",
                    help="the decoding mode of the generate() requests (default: greedy)")
    ap.add_argument("--cache", action="store_true",
                    help="simulate the caches too (callgrind --cache-sim=yes; ~2x slower): misses and estimated cycles")
    ap.add_argument("--branch", action="store_true",
                    help="simulate branch prediction too (callgrind --branch-sim=yes): mispredicted branches")
    ap.add_argument("--keep", metavar="DIR", help="keep the callgrind dumps (out.N, in the order of DIR/order) in DIR")
    ap.add_argument("--child", metavar="ORDER_FILE", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rounds < 1 or args.tokens < 3:
        ap.error("--rounds must be at least 1 and --tokens at least 3")
    if args.child:
        child(args.rounds, args.tokens, args.child, args.mode)
        return
    if shutil.which("valgrind") is None or shutil.which("callgrind_annotate") is None:
        print("instructions.py: valgrind (callgrind) not found on PATH; skipped")
        return
    from common import dump, machine, table

    with tempfile.TemporaryDirectory(prefix="perfmon-instr-") as scratch:
        tmp = args.keep or scratch
        os.makedirs(tmp, exist_ok=True)
        order_path = os.path.join(tmp, "order")
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/out", "--collect-atstart=no",
               "--toggle-collect=sys_call_tracing", "--dump-after=sys_call_tracing",
               *(["--cache-sim=yes"] if args.cache else []), *(["--branch-sim=yes"] if args.branch else []),
               sys.executable, os.path.abspath(__file__), "--child", order_path,
               "--rounds", str(args.rounds), "--tokens", str(args.tokens), "--mode", args.mode]
        # One hash seed: str hashes (and so dict probe sequences) alike in every run.
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            sys.exit(f"instructions.py: the child under valgrind failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        with open(order_path) as f:
            names = f.read().splitlines()
        measured: dict[str, list[dict[str, int]]] = {}
        for i, name in enumerate(names, 1):
            measured.setdefault(name, []).append(_costs(f"{tmp}/out.{i}"))
    native_us, native_call_us = _native_us(args.tokens, args.mode)

    def values(name: str, part: str) -> list[int]:
        """Per round: ``work`` (total less hand-offs), ``core`` (work less the allocators) or ``handoff``."""
        rounds = measured[name]
        if part == "work":
            return [r["total"] - r["handoff"] for r in rounds]
        if part == "core":
            return [r["total"] - r["handoff"] - r["alloc"] for r in rounds]
        return [r[part] for r in rounds]

    def med(name: str, part: str = "work") -> float:
        return statistics.median(values(name, part))

    def spread(name: str, part: str = "work") -> str:
        ordered = sorted(values(name, part))
        return f"{ordered[0] - ordered[len(ordered) // 2]:+,}..{ordered[-1] - ordered[len(ordered) // 2]:+,}"

    result: dict[str, Any] = {"machine": machine(), "rounds": args.rounds, "tokens": args.tokens, "mode": args.mode,
                              "bare_request_native_us": native_us, "bare_call_native_us": native_call_us,
                              "generate": {}, "linear": {}}
    bare, bare_core = med("generate/bare"), med("generate/bare", "core")
    rate = bare / native_us  # the bare request's instructions per µs, natively
    rows = []
    for v in GENERATE:
        name = f"generate/{v}"
        work, core = med(name), med(name, "core")
        added, added_core = work - bare, core - bare_core
        added_eval = med(name, "eval") - med("generate/bare", "eval")
        result["generate"][v] = {part: values(name, part) for part in ("work", "core", "eval", "handoff", "alloc")}
        result["generate"][v].update(added=added, added_core=added_core, added_eval=added_eval)
        if v == "bare":
            rows.append([v, f"{work:,.0f}", spread(name), f"{med(name, 'handoff'):,.0f}", "", "", "", "", "", ""])
            continue
        rows.append([v, f"{work:,.0f}", spread(name), f"{med(name, 'handoff'):,.0f}", f"{added:+,.0f}",
                     f"{added / args.tokens:+,.0f}", f"{added_core / args.tokens:+,.0f}",
                     f"{added_eval / args.tokens:+,.0f}", f"{100 * added / bare:+.3f}%",
                     f"{added / rate / args.tokens:+.2f}"])
    print(f"\ngenerate() of a tiny GPT-2 ({args.mode}), {args.tokens} new tokens, {args.rounds} rounds under "
          f"callgrind, monitor running, 1% sampling (bare request natively: {native_us:,.0f} µs, "
          f"{rate:,.0f} instructions/µs)\n")
    print(table(["variant", "instructions a request (work)", "rounds, from the median", "hand-offs", "added",
                 "added a token", "a token, allocators apart", "a token, eval loop", "of bare",
                 "µs a token at the model's rate"], rows))
    lb, lb_core = med("linear/bare"), med("linear/bare", "core")
    call_rate = lb / LINEAR_CALLS / native_call_us
    rows = []
    for v in LINEAR:
        name = f"linear/{v}"
        work = med(name)
        added, added_core = (work - lb) / LINEAR_CALLS, (med(name, "core") - lb_core) / LINEAR_CALLS
        added_eval = (med(name, "eval") - med("linear/bare", "eval")) / LINEAR_CALLS
        result["linear"][v] = {part: values(name, part) for part in ("work", "core", "eval", "handoff", "alloc")}
        result["linear"][v].update(added_per_call=added, added_core_per_call=added_core,
                                   added_eval_per_call=added_eval)
        rows.append([v, f"{work / LINEAR_CALLS:,.0f}", "" if v == "bare" else f"{added:+,.0f}",
                     "" if v == "bare" else f"{added_core:+,.0f}", "" if v == "bare" else f"{added_eval:+,.0f}",
                     "" if v == "bare" else f"{1e3 * added / call_rate:+,.0f}"])
    print(f"\nLinear(64,64), one row, {LINEAR_CALLS:,} calls a measurement (bare natively "
          f"{1e3 * native_call_us:,.0f} ns a call, {call_rate:,.0f} instructions/µs)\n")
    print(table(["variant", "instructions a call", "added a call", "allocators apart", "eval loop",
                 "ns a call at the model's rate"], rows))
    if args.cache:
        # The simulated caches' misses, and callgrind's cycle estimate: what an instruction count leaves out (the code
        # and data a forward evicted, touched again by what runs between two forwards).
        rows = []
        cycles = med("generate/bare", "cycles")
        for v in GENERATE:
            name = f"generate/{v}"
            l1, ll, est = (med(name, part) - med("generate/bare", part) for part in ("l1", "ll", "cycles"))
            result["generate"][v].update({part: values(name, part) for part in ("l1", "ll", "cycles")})
            rows.append([v, f"{med(name, 'cycles'):,.0f}", "" if v == "bare" else f"{l1 / args.tokens:+,.0f}",
                         "" if v == "bare" else f"{ll / args.tokens:+,.0f}",
                         "" if v == "bare" else f"{est / args.tokens:+,.0f}",
                         "" if v == "bare" else f"{100 * est / cycles:+.3f}%",
                         "" if v == "bare" else f"{est / (cycles / native_us) / args.tokens:+.2f}"])
        print("\nThe same requests' simulated caches (callgrind --cache-sim=yes; estimated cycles = instructions + 10 "
              "a first-level miss + 100 a last-level miss)\n")
        print(table(["variant", "estimated cycles a request", "L1 misses added a token", "LL misses added a token",
                     "cycles added a token", "of bare", "µs a token at the model's rate"], rows))
    if args.branch:
        # A mispredicted branch costs ~15-20 cycles on current x86 cores: the interpreter's indirect jumps from one
        # bytecode to the next are what a few Python lines between two forwards add most of.
        rows = []
        for v in GENERATE:
            name = f"generate/{v}"
            added = med(name, "mispredicts") - med("generate/bare", "mispredicts")
            result["generate"][v]["mispredicts"] = values(name, "mispredicts")
            rows.append([v, f"{med(name, 'mispredicts'):,.0f}", "" if v == "bare" else f"{added / args.tokens:+,.0f}"])
        print("\nThe same requests' simulated branch prediction (callgrind --branch-sim=yes)\n")
        print(table(["variant", "mispredicted branches a request", "added a token"], rows))
    dump(args.json, result)


if __name__ == "__main__":
    main()
