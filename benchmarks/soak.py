"""Soak: millions of wrapped calls at 100% sampling with scrapes and captures; resources stay bounded.

One thread calls a small model as fast as it can; a scraper fetches /metrics every 0.5 s; a capture
is requested every 10 s (trace_max_files=5). Every checkpoint reports RSS, threads, open files and
the trace store's size; at the end, calls counted must equal calls made and every timed sample must
be in a histogram or counted as dropped.

    python benchmarks/soak.py [--seconds 180] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import torch
from common import dump, machine, monitor, table


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=180.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    print(machine() + "\n")
    traces = Path(tempfile.mkdtemp(prefix="perfmon-soak-"))
    mon = monitor(port=0, sample_rate=1.0, trace_dir=str(traces), trace_max_files=5, manual_captures_per_hour=1000,
                  regression=None)
    mon.start()
    model = mon.wrap(torch.nn.Linear(8, 8), name="m")
    x = torch.randn(2, 8)
    stop = threading.Event()
    scrapes = captures = 0

    def scraper() -> None:
        nonlocal scrapes, captures
        last_capture = time.monotonic()
        while not stop.is_set():
            urllib.request.urlopen(mon.url + "/metrics", timeout=10).read()
            scrapes += 1
            if time.monotonic() - last_capture > 10:
                try:
                    mon.capture("m", steps=5)
                    captures += 1
                except Exception:
                    pass
                last_capture = time.monotonic()
            stop.wait(0.5)

    t = threading.Thread(target=scraper, daemon=True)
    t.start()
    made = 0
    rows, data = [], []
    start = time.monotonic()
    next_report = start
    with torch.inference_mode():
        while time.monotonic() - start < args.seconds:
            for _ in range(1000):
                model(x)
            made += 1000
            if time.monotonic() >= next_report:
                next_report += args.seconds / 6
                store = sum(p.stat().st_size for p in traces.iterdir())
                point = {"seconds": round(time.monotonic() - start), "calls": made, "rss_mib": rss_mib(),
                         "threads": threading.active_count(), "open_files": len(os.listdir("/proc/self/fd")),
                         "trace_files": len(list(traces.iterdir())), "trace_store_kib": store / 1024}
                data.append(point)
                rows.append([point["seconds"], f"{made:,}", f"{point['rss_mib']:.1f}", point["threads"],
                             point["open_files"], point["trace_files"], f"{point['trace_store_kib']:.0f}"])
    stop.set()
    t.join(30)
    mon.flush()
    st = mon.stats()["models"]["m"]
    hist = sum((st["latency"].get(p, {}).get("duration", {}).get("count", 0)) for p in ("cold", "steady"))
    counted = st["calls"]
    dropped = sum(st["dropped"].values())
    mon.stop()
    print(table(["s", "calls", "RSS MiB", "threads", "open files", "trace files", "trace store KiB"], rows))
    print(f"\n{made:,} calls made, {counted:,} counted; {st['sampled']:,} timed = "
          f"{st['sampled'] - dropped:,} resolved + {dropped:,} dropped {st['dropped']}; "
          f"{scrapes} scrapes, {captures} captures requested; exact: {made == counted}")
    del hist
    dump(args.json, {"points": data, "made": made, "counted": counted, "sampled": st["sampled"],
                     "dropped": st["dropped"], "scrapes": scrapes, "captures": captures})
    return 0 if made == counted else 1


if __name__ == "__main__":
    sys.exit(main())
