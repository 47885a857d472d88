"""A traffic mix shift, then a planted op: does the detector stay quiet, and does the capture name the op?

The scenario of issue #25, on a real model, profiler and monitor, repeated: a 3-layer 256-wide MLP serves
batches of 4-8, then 128-256 at the same cost per item (``shift`` seconds), then gains a ``torch.cdist`` per
call (``planted`` seconds). Policy ``RegressionPolicy(window_seconds=2, ratio=1.5, min_samples=20,
consecutive=2, baseline_windows=3)``, 10% sampling. Per run: regression captures during the shift alone
(false fires), whether the planted op was captured, what its comparison ranked first, against which
baseline (same size class or normalised per unit of work). Not a test: a table to read.

    python benchmarks/mix_shift.py --runs 5
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from typing import Any

import torch
from prometheus_client import CollectorRegistry

import perfmon
from perfmon import RegressionPolicy


class Net(torch.nn.Module):
    """Three 256-wide linear layers; ``extra`` adds a distance to 512 centroids per row (torch.cdist)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(*[m for _ in range(3) for m in (torch.nn.Linear(256, 256), torch.nn.ReLU())])
        self.centroids = torch.nn.Parameter(torch.randn(512, 256))
        self.extra = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layers(x)
        if self.extra:
            h = h + torch.cdist(h, self.centroids).min(dim=1, keepdim=True).values
        return h


def run(seed: int, *, learn_s: float, shift_s: float, planted_s: float) -> dict[str, Any]:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    policy = RegressionPolicy(window_seconds=2, ratio=1.5, min_samples=20, consecutive=2, baseline_windows=3)
    with tempfile.TemporaryDirectory() as traces:
        mon = perfmon.Monitor(port=None, registry=CollectorRegistry(), sample_rate=0.1, regression=policy,
                              trace_dir=traces, log_level="error", prepare_profiler=False)
        mon.policy.baseline_check_seconds = 0.5  # look for a baseline of the new size class promptly
        mon.start()
        net = Net()
        model = mon.wrap(net, name="m")
        xs = {b: torch.randn(b, 256) for b in [*range(4, 9), *range(128, 257)]}

        def serve(seconds: float, sizes: list[int]) -> None:
            end = time.monotonic() + seconds
            with torch.no_grad():
                while time.monotonic() < end:
                    model(xs[rng.choice(sizes)])
            mon.flush()

        def regressions() -> list[dict[str, Any]]:
            return [p for p in mon.profiles() if p["trigger"] == "regression"]

        serve(learn_s, list(range(4, 9)))
        serve(shift_s, list(range(128, 257)))
        fired = regressions()
        false_fires = len(fired)
        why = [_why(p) for p in fired]
        net.extra = True
        serve(planted_s, list(range(128, 257)))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and mon.captures.state != "idle":
            time.sleep(0.1)
        caught = regressions()[false_fires:] if len(regressions()) > false_fires else []
        first = basis = None
        if caught:
            meta = mon.profile(caught[-1]["id"]) or {}
            comparison = meta.get("comparison") or {}
            rows = comparison.get("ops") or []
            first = f"{rows[0]['op']} ({rows[0]['status']})" if rows else None
            basis = (comparison.get("basis") or {}).get("sizes")
        baselines = sorted(str((p.get("reason") or {}).get("size_class")) for p in mon.profiles()
                           if p["trigger"] == "baseline")
        mon.stop()
    return {"seed": seed, "false_fires": false_fires, "captured": bool(caught), "first": first, "basis": basis,
            "baselines": baselines, "why": why}


def _why(profile: dict[str, Any]) -> str:
    """One false fire in a line: the statistics that exceeded, their ratios, and the size classes."""
    reason = profile.get("reason") or {}
    ratios = reason.get("observed_ratio") or {}
    parts = [f"{q} x{ratios[q]:.2f}" if q in ratios else q for q in reason.get("exceeded") or []]
    moved = (reason.get("moved") or {}).get("summary") or ""
    return f"{', '.join(parts)} [classes {', '.join(reason.get('size_classes') or [])}] {moved}".strip()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--learn", type=float, default=12.0)
    p.add_argument("--shift", type=float, default=24.0)
    p.add_argument("--planted", type=float, default=14.0)
    p.add_argument("--json")
    args = p.parse_args()
    torch.set_num_threads(1)
    results = []
    print("| run | false fires in the shift | planted op captured | ranked first | basis | baseline captures |")
    print("|---:|---:|---|---|---|---|")
    for seed in range(args.runs):
        r = run(seed, learn_s=args.learn, shift_s=args.shift, planted_s=args.planted)
        results.append(r)
        print(f"| {seed} | {r['false_fires']} | {'yes' if r['captured'] else 'no'} | {r['first']} | {r['basis']} | "
              f"{', '.join(r['baselines'])} |", flush=True)
        for line in r["why"]:
            print(f"|   | false fire: {line} | | | | |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
