"""Detection: how fast a latency step is caught with default settings, and how often noise fires.

Simulated clock, real code: the calls of a model at a fixed rate go through perfmon's own
``Sampler`` (default rate, random phase, jittered stride, the 1 s floor armed every resolver
interval) and the sampled, steady-state latencies feed perfmon's own ``Detector`` with the default
``RegressionPolicy``. Latency is lognormal (median 5 ms, sigma 0.2, i.e. about +-20%); at a known
moment it steps by 1.5x, 2x or 4x. A capture starts at the model's next call after the detector
fires, i.e. within 1/rate of the firing time, so the firing time is reported.

    python benchmarks/detection.py [--seeds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from typing import Any

from perfmon.agent.sampling import Sampler
from perfmon.captures.detector import Detector, RegressionPolicy
from perfmon.config import Config

S = 1_000_000_000


#: Traffic mixes: None = one size (the model's work never changes); "mixed" = batches 4, 16, 64, 256
#: in equal shares; "shift" = batches 4-8 until the step time, then 128-256 (the step is then a mix
#: shift at unchanged per-item cost, not a slowdown: any firing is a false one).
MIXES = (None, "mixed", "shift")


def _size(mix: str | None, rng: random.Random, t: float, step_at: float) -> int | None:
    if mix is None:
        return None
    if mix == "mixed":
        return rng.choice((4, 16, 64, 256))
    return rng.choice((4, 5, 6, 8) if t < step_at else (128, 160, 200, 256))


def simulate(rate_hz: float, step: float | None, *, seconds: float, step_at: float, seed: int,
             policy: RegressionPolicy, noise: str = "lognormal", mix: str | None = None) -> float | None:
    """Seconds from the step to the first firing (None if it never fired); with step=None, the first firing.

    With a ``mix``, latency is 5 ms x (0.25 + 0.75 x batch / 64): a fixed part and a per-item part.
    """
    cfg = Config.from_env({})
    rng = random.Random(seed)
    sampler = Sampler(cfg.sample_rate, cfg.sample_floor_seconds, seed=seed)
    det = Detector(policy, seed=seed)
    warmup = cfg.warmup_calls
    next_index = 0 if warmup else sampler.first_index(0)
    last_sample = 0.0
    tick_every = cfg.resolve_interval_seconds
    next_tick = tick_every
    n_calls = int(seconds * rate_hz)
    for n in range(n_calls):
        t = n / rate_hz
        while next_tick <= t:  # the resolver's housekeeping: floor, window closing
            if next_tick - last_sample >= cfg.sample_floor_seconds:
                next_index = 0
            fired = det.tick(int(next_tick * S))
            if fired:
                return next_tick - (step_at if step is not None else 0.0)
            next_tick += tick_every
        if n < warmup:
            if n == warmup - 1:
                next_index = sampler.first_index(warmup)
            continue  # cold: timed, but never fed to the detector
        if n < next_index:
            continue
        next_index = sampler.next_index(n)
        last_sample = t
        base = 0.005 * (rng.lognormvariate(0, 0.2) if noise == "lognormal" else rng.uniform(0.8, 1.2))
        size = _size(mix, rng, t, step_at)
        if size is not None:
            base *= 0.25 + 0.75 * size / 64
        latency = base * (step if step is not None and t >= step_at else 1.0)
        if det.add("m", latency, int(t * S), size):
            return t - (step_at if step is not None else 0.0)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    policy = RegressionPolicy()
    results: dict[str, Any] = {"policy": {k: getattr(policy, k) for k in (
        "window_seconds", "ratio", "min_samples", "consecutive", "baseline_windows", "quantiles")}, "delay": {},
        "false": {}}
    learn = policy.window_seconds * (policy.baseline_windows + 1)
    print(f"Default policy: {results['policy']}; default sampling {Config.from_env({}).sample_rate:.0%} "
          f"+ 1 call/s floor. Median over {args.seeds} seeds (step at a random moment after the baseline).\n")
    for mix in (None, "mixed"):
        print(f"\nSlowdown of every call, traffic mix: {mix or 'one size'}\n")
        print("| calls/s | 1.5x step | 2x step | 4x step |")
        print("|---:|---:|---:|---:|")
        for rate in (20, 200, 2000):
            row = []
            for step in (1.5, 2.0, 4.0):
                delays = []
                for seed in range(args.seeds):
                    step_at = learn + random.Random(seed).uniform(0, policy.window_seconds)
                    d = simulate(rate, step, seconds=step_at + 120, step_at=step_at, seed=seed, policy=policy,
                                 mix=mix)
                    delays.append(d)
                caught = [d for d in delays if d is not None]
                results["delay"][f"{mix or 'one'}/{rate}/{step}"] = delays
                cell = f"{statistics.median(caught):.1f} s" if caught else "not caught"
                if caught and len(caught) < len(delays):
                    cell += f" ({len(caught)}/{len(delays)} caught)"
                elif caught:
                    cell += f" (max {max(caught):.1f})"
                row.append(cell)
            print(f"| {rate} | " + " | ".join(row) + " |")
    print("\nA mix shift at unchanged per-item cost (batches 4-8 -> 128-256, raw latency ~4x): firings in 120 s\n")
    print("| calls/s | firings |")
    print("|---:|---:|")
    for rate in (20, 200, 2000):
        fired = 0
        for seed in range(args.seeds):
            step_at = learn + random.Random(seed).uniform(0, policy.window_seconds)
            fired += simulate(rate, 1.0, seconds=step_at + 120, step_at=step_at, seed=seed, policy=policy,
                              mix="shift") is not None
        results["false"][f"shift/{rate}"] = fired
        print(f"| {rate} | {fired} of {args.seeds} runs |")
    print("\nFalse firings in 10 simulated minutes of stationary noise (no step):\n")
    print("| calls/s | lognormal sigma 0.2 | uniform +-20% |")
    print("|---:|---:|---:|")
    for rate in (20, 200, 2000):
        cells = []
        for noise in ("lognormal", "uniform"):
            fired = sum(simulate(rate, None, seconds=600, step_at=0, seed=100 + seed, policy=policy, noise=noise)
                        is not None for seed in range(args.seeds))
            results["false"][f"{rate}/{noise}"] = fired
            cells.append(f"{fired} of {args.seeds} runs")
        print(f"| {rate} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
