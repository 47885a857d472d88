"""Model throughput while the agent's port is flooded: 30 slowloris sockets, 50 scrapes/s, bad tokens.

The model (an MLP, ~100 µs a call) runs in this process with the agent; the flood comes from a second
process on 127.0.0.1 (bounded: --seconds). Reported: calls/s quiet vs flooded, and the agent's own
CPU during the flood. Both processes share this machine's cores, so part of any drop is simply the
attacker's CPU.

    python benchmarks/hostile.py [--seconds 8]
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import torch
from common import machine, monitor, table


def attack(url: str, seconds: float) -> None:
    host, port = url.removeprefix("http://").split(":")
    slow = []
    for _ in range(30):
        s = socket.create_connection((host, int(port)), timeout=5)
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        slow.append(s)
    stop = time.monotonic() + seconds

    def scrapes() -> None:
        while time.monotonic() < stop:
            t0 = time.monotonic()
            threads = [threading.Thread(target=lambda: urllib.request.urlopen(url + "/metrics", timeout=10).read())
                       for _ in range(50)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(10)
            time.sleep(max(0.0, 1.0 - (time.monotonic() - t0)))

    def tokens() -> None:
        i = 0
        while time.monotonic() < stop:
            i += 1
            try:
                urllib.request.urlopen(urllib.request.Request(url + "/profiles", headers={
                    "Authorization": f"Bearer guess-{i}"}), timeout=10)
            except urllib.error.HTTPError:
                pass

    import os

    parts = os.environ.get("HOSTILE_PARTS", "scrapes,tokens").split(",")
    ts = [threading.Thread(target={"scrapes": scrapes, "tokens": tokens}[p]) for p in parts]
    for t in ts:
        t.start()
    for t in ts:
        t.join(seconds + 30)
    for s in slow:
        s.close()


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
    parser.add_argument("--attack", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.attack:
        attack(args.attack, args.seconds)
        return 0
    if args.serve:  # a decoy agent in its own process: the same flood, none of it in the model's process
        decoy = monitor(port=0, token="hostile-bench-token")
        decoy.start()
        print(decoy.url, flush=True)
        sys.stdin.read()
        return 0
    print(machine() + "\n")
    torch.set_num_threads(1)
    mon = monitor(port=0, token="hostile-bench-token")
    mon.start()
    model = mon.wrap(torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128)),
                     name="m")
    quiet = rate(model, args.seconds)

    def flooded_rate(url: str) -> float:
        attacker = subprocess.Popen([sys.executable, __file__, "--attack", url, "--seconds", str(args.seconds)])
        time.sleep(0.5)
        r = rate(model, args.seconds - 1)
        attacker.wait(args.seconds + 60)
        return r

    # Control: the same flood against a decoy agent in another process. The model's process does no
    # agent work, so what the model loses there is the attacker's (and the decoy's) CPU on shared cores.
    decoy = subprocess.Popen([sys.executable, __file__, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    decoy_url = decoy.stdout.readline().strip()  # type: ignore[union-attr]
    elsewhere = flooded_rate(decoy_url)
    decoy.stdin.close()  # type: ignore[union-attr]
    decoy.wait(30)
    cpu0 = mon._hub.cpu.totals()
    here = flooded_rate(mon.url)
    cpu1 = mon._hub.cpu.totals()
    health = urllib.request.urlopen(mon.url + "/healthz", timeout=5).status
    mon.stop()
    agent = {k: cpu1[k] - cpu0[k] for k in cpu1}
    print(table(["phase", "model calls/s", "vs quiet", "agent CPU s (http)"],
                [["quiet", f"{quiet:.0f}", "1.000", "-"],
                 ["flood against another process (control)", f"{elsewhere:.0f}", f"{elsewhere / quiet:.3f}", "-"],
                 ["flood against this process's agent", f"{here:.0f}", f"{here / quiet:.3f}", f"{agent['http']:.2f}"],
                 ["this process's agent vs control", "", f"{here / elsewhere:.3f}", ""]]))
    print(f"\n/healthz after the flood: {health}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
