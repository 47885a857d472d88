"""Plots for BENCHMARKS.md from the JSON the benchmark scripts wrote (make bench).

    python benchmarks/plots.py benchmarks/results docs
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    args = argv if argv is not None else sys.argv[1:]
    results, out = Path(args[0]), Path(args[1])
    overhead = json.loads((results / "overhead.json").read_text())
    rows = overhead["linear"]
    names = [r["variant"] for r in rows if r["variant"] != "bare"]
    added = [r["added_ns"] / 1000 for r in rows if r["variant"] != "bare"]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.barh(names, added, color=["#4c72b0" if n.startswith("perfmon") else "#999999" for n in names])
    ax.set_xlabel("added time per call, µs (nn.Linear(64,64), bare call ~7 µs)")
    ax.invert_yaxis()
    for i, v in enumerate(added):
        ax.text(v, i, f" {v:.2f}", va="center", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "overhead.png", dpi=110)

    detection = json.loads((results / "detection.json").read_text())["delay"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for rate in (20, 200, 2000):
        steps, med = [], []
        for step in (1.5, 2.0, 4.0):
            caught = sorted(d for d in detection[f"{rate}/{step}"] if d is not None)
            if caught:
                steps.append(step)
                med.append(caught[len(caught) // 2])
        ax.plot(steps, med, marker="o", label=f"{rate} calls/s")
    ax.axhline(30, color="grey", linestyle=":", label="target at 200 calls/s, 2x")
    ax.set_xlabel("latency step (x baseline)")
    ax.set_ylabel("seconds to detection (median)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "detection.png", dpi=110)
    print(f"wrote {out / 'overhead.png'} and {out / 'detection.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
