"""Model throughput while the agent's port is flooded: 30 slowloris sockets, 50 scrapes/s, bad tokens.

Two identical worker processes each run the same model (an MLP, ~75 µs a call) with its own agent, at
the same time; a third process floods the agent of one of them (bounded: --seconds). The unflooded
worker is the control: both live through the same machine noise at the same moment, which on a shared
machine swings throughput by ±30% between runs taken seconds apart. Rounds alternate which worker
is flooded, so a difference between the two workers cancels out:

    cost of the flood = sqrt((A flooded / B) x (B flooded / A)) over a pair of rounds

``--aa`` runs the same rounds with no flood at all: the noise floor of that ratio.

    python benchmarks/hostile.py [--seconds 10] [--rounds 6] [--aa]
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import torch
from common import machine, monitor, table


def attack(url: str, seconds: float) -> dict[str, Any]:
    """The flood; returns what its clients saw (status counts, scrape and /healthz latencies)."""
    host, port = url.removeprefix("http://").split(":")
    slow = []
    for _ in range(30):
        s = socket.create_connection((host, int(port)), timeout=5)
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        slow.append(s)
    stop = time.monotonic() + seconds
    seen: collections.Counter[str] = collections.Counter()
    scrape_s: list[float] = []
    health_s: list[float] = []

    def get(path: str, headers: dict[str, str] | None = None, timeout: float = 10) -> tuple[str, float]:
        t0 = time.monotonic()
        try:
            with urllib.request.urlopen(urllib.request.Request(url + path, headers=headers or {}),
                                        timeout=timeout) as r:
                r.read()
                code = str(r.status)
        except urllib.error.HTTPError as e:
            code = str(e.code)
        except OSError as e:
            code = type(e).__name__
        return code, time.monotonic() - t0

    def scrape() -> None:
        code, took = get("/metrics")
        seen[f"scrape {code}"] += 1
        scrape_s.append(took)

    def scrapes() -> None:
        while time.monotonic() < stop:
            t0 = time.monotonic()
            threads = [threading.Thread(target=scrape) for _ in range(50)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(10)
            time.sleep(max(0.0, 1.0 - (time.monotonic() - t0)))

    def tokens() -> None:
        i = 0
        while time.monotonic() < stop:
            i += 1
            code, _ = get("/profiles", {"Authorization": f"Bearer guess-{i}"})
            seen[f"bad token {code}"] += 1

    def health() -> None:  # what a liveness probe sees during the flood
        while time.monotonic() < stop:
            code, took = get("/healthz", timeout=5)
            seen[f"healthz {code}"] += 1
            health_s.append(took)
            time.sleep(0.5)

    parts = os.environ.get("HOSTILE_PARTS", "scrapes,tokens").split(",")
    ts = [threading.Thread(target={"scrapes": scrapes, "tokens": tokens}[p]) for p in parts]
    ts.append(threading.Thread(target=health))
    for t in ts:
        t.start()
    for t in ts:
        t.join(seconds + 30)
    for s in slow:
        s.close()
    return {"seen": dict(seen), "scrape_p50": _pct(scrape_s, 50), "scrape_max": max(scrape_s, default=0.0),
            "health_p50": _pct(health_s, 50), "health_max": max(health_s, default=0.0)}


def _pct(xs: list[float], q: float) -> float:
    return float(sorted(xs)[min(len(xs) - 1, int(len(xs) * q / 100))]) if xs else 0.0


#: Seconds the flood runs before the models are measured.
_LEAD = 2.0


def worker() -> None:
    """A model process with its own agent: prints its URL, then runs the model on each 'run SECONDS'."""
    torch.set_num_threads(1)
    # No regression detector: a flood that slows the model would (rightly) trigger profiler captures,
    # which would perturb the very throughput measured here.
    mon = monitor(port=0, token="hostile-bench-token", regression=None)
    mon.start()
    model = mon.wrap(torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128)),
                     name="m")
    x = torch.randn(32, 128)
    with torch.inference_mode():
        for _ in range(200):  # warm up
            model(x)
    print(mon.url, flush=True)
    for line in sys.stdin:
        seconds = float(line.split()[1])
        cpu0 = mon._hub.cpu.totals()["http"]
        n, t0 = 0, time.monotonic()
        with torch.inference_mode():
            while time.monotonic() - t0 < seconds:
                model(x)
                n += 1
        elapsed = time.monotonic() - t0
        shed = {s.labels["reason"]: int(s.value) for fam in mon.registry.collect() for s in fam.samples
                if s.name == "perfmon_agent_http_refused_total" and s.value}
        print(json.dumps({"rate": n / elapsed, "http_cpu": mon._hub.cpu.totals()["http"] - cpu0,
                          "refused": shed}), flush=True)
    mon.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=6, help="rounds (pairs alternate the flooded worker)")
    parser.add_argument("--aa", action="store_true", help="no flood: the noise floor of the ratio")
    parser.add_argument("--attack", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.attack:
        print(json.dumps(attack(args.attack, args.seconds)), flush=True)
        return 0
    if args.worker:
        worker()
        return 0
    print(machine() + "\n")
    workers = [subprocess.Popen([sys.executable, __file__, "--worker"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True) for _ in range(2)]
    urls = [w.stdout.readline().strip() for w in workers]  # type: ignore[union-attr]
    rows, ratios, flooded_cpu = [], [], 0.0
    saw: dict[str, Any] = {}
    try:
        for i in range(args.rounds):
            target = i % 2
            attacker = None
            if not args.aa:
                attacker = subprocess.Popen(
                    [sys.executable, __file__, "--attack", urls[target], "--seconds", str(args.seconds + _LEAD + 1)],
                    stdout=subprocess.PIPE, text=True)
                # Measure the flood's steady state: the first second spends the budget's burst (0.1 s
                # of CPU, refilled while the other worker was flooded), which a real flood pays once.
                time.sleep(_LEAD)
            for w in workers:  # both models run over the same seconds
                w.stdin.write(f"run {args.seconds}\n")  # type: ignore[union-attr]
                w.stdin.flush()  # type: ignore[union-attr]
            got = [json.loads(w.stdout.readline()) for w in workers]  # type: ignore[union-attr]
            if attacker is not None:
                out, _ = attacker.communicate(timeout=args.seconds + 60)
                saw = json.loads(out.strip().splitlines()[-1])
                saw["refused"] = got[target]["refused"]
            flooded_cpu += got[target]["http_cpu"]
            ratios.append(got[target]["rate"] / got[1 - target]["rate"])
            rows.append([str(i + 1), "AB"[target], f"{got[target]['rate']:.0f}", f"{got[1 - target]['rate']:.0f}",
                         f"{ratios[-1]:.3f}", f"{got[target]['http_cpu'] * 1e3:.0f}"])
    finally:
        for w in workers:
            w.stdin.close()  # type: ignore[union-attr]
            w.wait(30)
    pairs = [math.sqrt(a * b) for a, b in zip(ratios[::2], ratios[1::2], strict=False)]
    what = "no flood (A/A)" if args.aa else "flooded"
    print(table(["round", f"{what} worker", f"{what}, calls/s", "the other, calls/s", "ratio",
                 "its agent's HTTP CPU, ms"], rows))
    print(f"\nPer pair of rounds (A and B flooded once each): {', '.join(f'{p:.3f}' for p in pairs)}; "
          f"median {statistics.median(pairs):.3f}" if pairs else "")
    seconds = args.rounds * args.seconds
    print(f"The flooded agent's HTTP CPU: {flooded_cpu:.2f} s over {seconds:.0f} s "
          f"({100 * flooded_cpu / seconds:.2f}% of a core).")
    if saw:
        print("\nWhat the flood's clients saw (last round): "
              + ", ".join(f"{k}: {v}" for k, v in sorted(saw["seen"].items()))
              + f"; scrape p50 {saw['scrape_p50'] * 1e3:.0f} ms, max {saw['scrape_max'] * 1e3:.0f} ms"
              + f"; /healthz p50 {saw['health_p50'] * 1e3:.0f} ms, max {saw['health_max'] * 1e3:.0f} ms"
              + f"; refused by the agent: {saw['refused']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
