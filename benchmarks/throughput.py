"""Throughput under a real server: the example FastAPI server with perfmon off vs on (defaults).

Starts ``uvicorn examples.server:app`` on 127.0.0.1 twice per round (PERFMON_ENABLED=false/true),
drives it with a bounded local load (keep-alive client threads POSTing /predict for a fixed time)
and, when perfmon is on, scrapes its /metrics every second like Prometheus. Reports requests/s and
client-side p50/p99 latency, and the on/off ratio. Rounds alternate off/on to share machine drift.

    python benchmarks/throughput.py [--seconds 10] [--clients 4] [--rounds 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from common import dump, free_port, machine, table

ROOT = Path(__file__).resolve().parents[1]
BODY = json.dumps({"tokens": [[0.01] * 64] * 16}).encode()


def serve(enabled: bool) -> tuple[subprocess.Popen[bytes], int, int]:
    port, agent = free_port(), free_port()
    env = {**os.environ, "PERFMON_ENABLED": str(enabled).lower(), "PERFMON_PORT": str(agent),
           "PERFMON_LOG_LEVEL": "error", "PERFMON_TRACE_DIR": "/tmp/perfmon-bench-traces", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "examples.server:app", "--host", "127.0.0.1",
                             "--port", str(port), "--log-level", "error", "--no-access-log"],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1).read()
            return proc, port, agent
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("example server did not start")


def load(port: int, seconds: float, clients: int, scrape_port: int | None) -> dict[str, float]:
    stop = time.monotonic() + seconds
    latencies: list[list[float]] = [[] for _ in range(clients)]

    def client(i: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        while time.monotonic() < stop:
            t0 = time.perf_counter()
            conn.request("POST", "/predict", BODY, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            resp.read()
            latencies[i].append(time.perf_counter() - t0)
        conn.close()

    def scraper() -> None:
        while time.monotonic() < stop:
            urllib.request.urlopen(f"http://127.0.0.1:{scrape_port}/metrics", timeout=5).read()
            time.sleep(1.0)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    if scrape_port is not None:
        threads.append(threading.Thread(target=scraper))
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 30)
    wall = time.monotonic() - t0
    all_lat = sorted(x for lst in latencies for x in lst)
    return {"rps": len(all_lat) / wall, "p50_ms": statistics.median(all_lat) * 1e3,
            "p99_ms": all_lat[int(0.99 * (len(all_lat) - 1))] * 1e3}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--modes", default="off,on",
                        help="what to compare; 'off,off' measures the noise floor (an A/A run)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    first, second = args.modes.split(",")
    print(machine() + "\n")
    labels = (f"A: {first}", f"B: {second}")
    runs: dict[str, list[dict[str, float]]] = {labels[0]: [], labels[1]: []}
    for _ in range(args.rounds):
        for label, mode in zip(labels, (first, second)):
            proc, port, agent = serve(mode == "on")
            try:
                load(port, 2.0, args.clients, None)  # warm-up: cold calls, allocator
                runs[label].append(load(port, args.seconds, args.clients, agent if mode == "on" else None))
            finally:
                proc.terminate()
                proc.wait(30)
    med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in runs.items()}
    rows = [[m, f"{v['rps']:.0f}", f"{v['p50_ms']:.2f}", f"{v['p99_ms']:.2f}",
             " ".join(f"{r['rps']:.0f}" for r in runs[m])] for m, v in med.items()]
    a, b = med[labels[0]], med[labels[1]]
    per_round = [rb["rps"] / ra["rps"] for ra, rb in zip(runs[labels[0]], runs[labels[1]])]
    rows.append(["B / A", f"{b['rps'] / a['rps']:.3f}", f"{b['p50_ms'] / a['p50_ms']:.3f}",
                 f"{b['p99_ms'] / a['p99_ms']:.3f}", " ".join(f"{r:.3f}" for r in per_round)])
    print(f"{args.clients} keep-alive clients, {args.seconds:g} s per run, {args.rounds} alternating rounds, "
          "medians; perfmon at defaults with a /metrics scrape every second\n")
    print(table(["perfmon", "requests/s", "p50 ms", "p99 ms", "per round"], rows))
    dump(args.json, {"runs": runs, "median": med})
    return 0


if __name__ == "__main__":
    sys.exit(main())
