"""What one capture costs: peak and retained memory, export time, trace size, the model's throughput.

A 200-layer MLP (Linear(256, 256) + ReLU per layer, batch 8) is served in a loop on one thread; a
manual capture of ``--steps`` calls is taken with default options and with ``record_shapes``,
``with_stack`` and ``profile_memory``. Each variant runs in a fresh process (so one variant's heap
does not flatter the next). Reported per variant:

* peak RSS (sampled every 20 ms) and RSS 5 s after the capture finished, against RSS before;
* steps recorded and what ended the recording; export wall time (recording end -> outcome);
* trace bytes (gzipped) and the number of host events;
* the model's calls/s before, while recording, while exporting, and in the 5 s after; the longest
  gap between two calls while exporting (a stall of the serving thread).

    python benchmarks/capture_size.py [--steps 100] [--variants default,full] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

VARIANTS = {
    "default": {},
    "full": {"record_shapes": True, "with_stack": True, "profile_memory": True},
}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_variant(variant: str, steps: int, layers: int, settle: float) -> dict[str, Any]:
    import torch
    from common import monitor

    torch.set_num_threads(1)
    trace_dir = tempfile.mkdtemp(prefix="perfmon-capture-size-")
    mon = monitor(trace_dir=trace_dir, prepare_profiler=True, regression=None)
    mon.start()
    layers_ = []
    for _ in range(layers):
        layers_ += [torch.nn.Linear(256, 256), torch.nn.ReLU()]
    model = mon.wrap(torch.nn.Sequential(*layers_).eval(), name="mlp")
    x = torch.randn(8, 256)
    stamps: list[float] = []
    stop = threading.Event()

    def serve() -> None:
        with torch.inference_mode():
            while not stop.is_set():
                model(x)
                stamps.append(time.monotonic())

    peak = [0]

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss_bytes())
            time.sleep(0.02)

    server = threading.Thread(target=serve, name="serve")
    sampler = threading.Thread(target=sample, name="rss")
    server.start()
    time.sleep(2.0)  # warm up
    t_before = time.monotonic()
    rss_before = rss_bytes()
    time.sleep(settle)
    peak[0] = rss_bytes()
    sampler.start()
    t_arm = time.monotonic()
    cap = mon.capture("mlp", steps=steps, max_seconds=60.0, **VARIANTS[variant])
    rec_end = None
    deadline = time.monotonic() + 600
    meta: dict[str, Any] | None = None
    while time.monotonic() < deadline:
        meta = mon.profile(cap["id"])
        if meta is not None and rec_end is None and meta.get("status") in ("exporting", "done"):
            rec_end = time.monotonic()
        if meta is not None and meta.get("outcome"):
            break
        time.sleep(0.01)
    t_done = time.monotonic()
    assert meta is not None and meta.get("outcome"), meta
    rec_end = rec_end or t_done
    time.sleep(settle)
    t_after = time.monotonic()
    rss_after = rss_bytes()
    stop.set()
    server.join(30)
    sampler.join(5)
    mon.stop()

    def rate(a: float, b: float) -> float:
        return sum(1 for s in stamps if a <= s < b) / max(b - a, 1e-9)

    during_export = [s for s in stamps if rec_end <= s < t_done]
    gaps = [b - a for a, b in zip([rec_end, *during_export], [*during_export, t_done])]
    export = meta.get("export") or {}
    return {
        "variant": variant, "steps": steps, "layers": layers, "outcome": meta.get("outcome"),
        "error": meta.get("error"), "steps_recorded": meta.get("steps_recorded"), "ended_by": meta.get("ended_by"),
        "rss_before_bytes": rss_before, "rss_peak_bytes": peak[0], "rss_after_bytes": rss_after,
        "recording_seconds": rec_end - t_arm, "export_seconds": t_done - rec_end,
        "trace_bytes": meta.get("trace_bytes"), "trace_events": export.get("trace_events"),
        "export_child_max_rss_bytes": export.get("child_max_rss_bytes"),
        "calls_per_second_before": rate(t_before, t_before + settle),
        "calls_per_second_recording": rate(t_arm, rec_end),
        "calls_per_second_exporting": rate(rec_end, t_done),
        "calls_per_second_after": rate(t_done, t_after),
        "longest_gap_exporting_seconds": max(gaps) if gaps else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--layers", type=int, default=200)
    parser.add_argument("--settle", type=float, default=5.0, help="seconds measured before and after")
    parser.add_argument("--variants", default="default,full")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child runs one variant
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(run_variant(args.one, args.steps, args.layers, args.settle)))
        return 0
    from common import dump, machine, table

    print(machine() + "\n")
    results = []
    for variant in args.variants.split(","):
        out = subprocess.run([sys.executable, __file__, "--one", variant, "--steps", str(args.steps),
                              "--layers", str(args.layers), "--settle", str(args.settle)],
                             capture_output=True, text=True, timeout=900, check=False)
        if out.returncode != 0:
            print(out.stderr[-3000:], file=sys.stderr)
            return 1
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    mib = 2**20
    rows = [[r["variant"], r["outcome"], f"{r['steps_recorded']} ({r.get('ended_by') or '-'})",
             f"{r['rss_before_bytes'] / mib:.0f}", f"{r['rss_peak_bytes'] / mib:.0f}",
             f"{r['rss_after_bytes'] / mib:.0f}", f"{r['recording_seconds']:.1f}", f"{r['export_seconds']:.1f}",
             f"{(r['trace_bytes'] or 0) / mib:.1f}", r.get("trace_events") or "-",
             f"{r['export_child_max_rss_bytes'] / mib:.0f}" if r.get("export_child_max_rss_bytes") else "-",
             f"{r['calls_per_second_before']:.0f}", f"{r['calls_per_second_recording']:.0f}",
             f"{r['calls_per_second_exporting']:.0f}", f"{r['calls_per_second_after']:.0f}",
             f"{r['longest_gap_exporting_seconds'] or 0:.2f}"] for r in results]
    print(table(["variant", "outcome", "steps (ended by)", "RSS before MiB", "peak MiB", "after MiB",
                 "recording s", "export s", "trace MiB (gz)", "events", "child peak MiB", "calls/s before", "recording",
                 "exporting", "after", "longest gap exporting s"], rows, align="ll" + "r" * 14))
    dump(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
