"""Scrape cost: time and size of one /metrics render for 1, 4 and 16 models with 1 and 8 (fake) GPUs.

Each model has cold and steady series on one device; GPUs come from perfmon.testing.FakeNvml and
the torch allocator from FakeTorchMemory, so every GPU family is present.

    python benchmarks/scrape.py [--json out.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from common import dump, machine, monitor, table
from prometheus_client import generate_latest

from perfmon.testing import FakeNvml, FakeTorchMemory


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    print(machine() + "\n")
    rows, data = [], {}
    for models in (1, 4, 16):
        for gpus in (1, 8):
            mon = monitor(sample_rate=1.0, nvml=FakeNvml(gpus), memory=FakeTorchMemory(), nvml_interval_seconds=3600)
            mon.start()
            for i in range(models):
                m = mon.wrap(torch.nn.Linear(4, 4), name=f"model_{i}")
                for _ in range(5):
                    m(torch.randn(2, 4))
            mon.flush()
            times = []
            for _ in range(60):
                t0 = time.perf_counter()
                body = generate_latest(mon.registry)
                times.append(time.perf_counter() - t0)
            mon.stop()
            med = statistics.median(times)
            data[f"{models}/{gpus}"] = {"ms": med * 1e3, "bytes": len(body), "lines": body.count(b"\n")}
            rows.append([models, gpus, f"{med * 1e3:.2f}", f"{len(body) / 1024:.1f}", body.count(b"\n")])
    print(table(["models", "GPUs", "render ms (median of 60)", "KiB", "lines"], rows))
    dump(args.json, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
