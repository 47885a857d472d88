"""Model throughput while the agent's port is flooded: 30 slowloris sockets, 50 scrapes/s, bad tokens.

The model (an MLP, ~100 µs a call) runs in this process with the agent; the flood comes from a second
process on 127.0.0.1 (bounded: --seconds). Reported: calls/s quiet vs flooded, and the agent's own
CPU during the flood. Both processes share this machine's cores, so part of any drop is simply the
attacker's CPU.

    python benchmarks/hostile.py [--seconds 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import collections
import json
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


def rate(model: torch.nn.Module, seconds: float) -> float:
    x = torch.randn(32, 128)
    n, t0 = 0, time.monotonic()
    with torch.inference_mode():
        while time.monotonic() - t0 < seconds:
            model(x)
            n += 1
    return n / (time.monotonic() - t0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-pin", action="store_true", help="do not pin processes to cores")
    parser.add_argument("--attack", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--pin", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.pin:
        os.sched_setaffinity(0, {int(c) for c in args.pin.split(",")})
    if args.attack:
        print(json.dumps(attack(args.attack, args.seconds)), flush=True)
        return 0
    if args.serve:  # a decoy agent in its own process: the same flood, none of it in the model's process
        decoy = monitor(port=0, token="hostile-bench-token")
        decoy.start()
        print(decoy.url, flush=True)
        sys.stdin.read()
        return 0
    print(machine() + "\n")
    # Pin the model's process to one core and the attacker and the decoy to the others, so the control
    # measures no CPU contention at all and what remains is what the agent costs in-process.
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    pin = len(cores) >= 2 and not args.no_pin
    others = ",".join(map(str, cores[1:]))
    if pin:
        os.sched_setaffinity(0, {cores[0]})
        print(f"model process on core {cores[0]}; attacker and decoy on cores {others}\n")
    torch.set_num_threads(1)
    mon = monitor(port=0, token="hostile-bench-token")
    mon.start()
    model = mon.wrap(torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128)),
                     name="m")
    quiet = rate(model, args.seconds)

    def flooded_rate(url: str) -> tuple[float, dict[str, Any]]:
        attacker = subprocess.Popen([sys.executable, __file__, "--attack", url, "--seconds", str(args.seconds),
                                     *(["--pin", others] if pin else [])], stdout=subprocess.PIPE, text=True)
        time.sleep(0.5)
        r = rate(model, args.seconds - 1)
        out, _ = attacker.communicate(timeout=args.seconds + 60)
        return r, json.loads(out.strip().splitlines()[-1])

    # Control: the same flood against a decoy agent in another process. The model's process does no
    # agent work, so what the model loses there is the attacker's (and the decoy's) CPU on shared cores.
    decoy = subprocess.Popen([sys.executable, __file__, "--serve", *(["--pin", others] if pin else [])],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    decoy_url = decoy.stdout.readline().strip()  # type: ignore[union-attr]
    rows, ratios = [], []
    cpu = 0.0
    saw: dict[str, Any] = {}
    saw_decoy: dict[str, Any] = {}
    for i in range(args.rounds):  # alternate which goes first: drift on a shared machine cancels out
        order = ("control", "here") if i % 2 == 0 else ("here", "control")
        got: dict[str, float] = {}
        for which in order:
            if which == "control":
                got[which], saw_decoy = flooded_rate(decoy_url)
            else:
                cpu0 = mon._hub.cpu.totals()["http"]
                got[which], saw = flooded_rate(mon.url)
                cpu += mon._hub.cpu.totals()["http"] - cpu0
        ratios.append(got["here"] / got["control"])
        rows.append([str(i + 1), f"{got['control']:.0f}", f"{got['here']:.0f}", f"{ratios[-1]:.3f}"])
    decoy.stdin.close()  # type: ignore[union-attr]
    decoy.wait(30)
    health = urllib.request.urlopen(mon.url + "/healthz", timeout=5).status
    mon.stop()
    print(f"Quiet: {quiet:.0f} model calls/s.\n")
    print(table(["round", "flood at a decoy agent (control), calls/s", "flood at this process's agent, calls/s",
                 "this process vs control"],
                [*rows, ["median", "", "", f"{statistics.median(ratios):.3f}"]]))
    flood_seconds = args.rounds * (args.seconds - 1)
    print(f"\nAgent HTTP CPU during the floods: {cpu:.2f} s over {flood_seconds:.0f} s "
          f"({100 * cpu / flood_seconds:.1f}% of a core); /healthz after the flood: {health}")
    for name, seen in (("this process's agent", saw), ("decoy agent (control)", saw_decoy)):
        print(f"\nWhat the flood's clients saw from {name} (last round): "
              + ", ".join(f"{k}: {v}" for k, v in sorted(seen["seen"].items()))
              + f"; scrape p50 {seen['scrape_p50'] * 1e3:.0f} ms, max {seen['scrape_max'] * 1e3:.0f} ms"
              + f"; /healthz p50 {seen['health_p50'] * 1e3:.0f} ms, max {seen['health_max'] * 1e3:.0f} ms")
    shed = {s.labels["reason"]: int(s.value) for fam in mon.registry.collect() for s in fam.samples
            if s.name == "perfmon_agent_http_refused_total" and s.value}
    print(f"Refused by the agent: {shed}; paused for its CPU budget: "
          f"{mon.registry.get_sample_value('perfmon_agent_http_paused_seconds_total'):.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
