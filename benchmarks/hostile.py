"""Model throughput while the agent's port is flooded: 30 slowloris sockets, 50 scrapes/s, bad tokens.

Two identical worker processes each run the same model (an MLP, ~75 µs a call) with its own agent, at
the same time; a third process floods the agent of one of them (bounded: --seconds). The unflooded
worker is the control: both live through the same machine noise at the same moment, which on a shared
machine swings throughput by ±30% between runs taken seconds apart. Rounds alternate which worker
is flooded, so a difference between the two workers cancels out:

    cost of the flood = sqrt((A flooded / B) x (B flooded / A)) over a pair of rounds

``--aa`` runs the same rounds with no flood at all: the noise floor of that ratio.

``--health`` measures what a liveness probe sees instead, one flood kind at a time: a ``/healthz``
probe on a fresh connection every 0.1 s (as the kubelet opens one per probe) and a legitimate scrape
every second, under 50 closed-loop ``/metrics`` clients (``metrics``), 50 clients asking for unknown
paths (``404``), 50 clients varying ``Accept`` on every scrape (``accept``), 50 ``/stats`` pollers
(``stats``), 300 idle connections reopened constantly (``idle``), 8 clients sending bad tokens
(``tokens``), and the legitimate load of ``legit``: 4 models at 100% sampling, three status pages
(each polls ``/stats`` every 3 s) and a scrape every 15 s (its rounds last 30 s: two scrapes each).

    python benchmarks/hostile.py [--seconds 10] [--rounds 6] [--aa]
    python benchmarks/hostile.py --health [--seconds 8] [--rounds 2] [--kinds metrics,404,...]
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import math
import os
import random
import selectors
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


#: The flood kinds of --health, in the order they run.
KINDS = ("metrics", "404", "accept", "stats", "idle", "tokens", "legit")


def probe(host: str, port: int, timeout: float = 10.0) -> float:
    """One liveness probe as the kubelet sends it (a new connection each time): seconds to the whole answer.

    A probe that fails or gets no 200 counts as ``timeout`` seconds (what the kubelet would see: a failure).
    """
    t0 = time.monotonic()
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(f"GET /healthz HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode())
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        if not data.startswith(b"HTTP/1.1 200"):
            return timeout
    except OSError:
        return timeout
    return time.monotonic() - t0


def flood(url: str, kind: str, seconds: float, health_port: int | None = None) -> dict[str, Any]:
    """One kind of flood (see the module docstring) with a probe every 0.1 s and a scrape every second;
    with ``health_port`` the same probe also goes to the agent's health port."""
    host, port_text = url.removeprefix("http://").split(":")
    port = int(port_text)
    stop = time.monotonic() + seconds
    seen: collections.Counter[str] = collections.Counter()
    health_s: list[float] = []
    health_port_s: list[float] = []
    scrape_s: list[float] = []

    def loop(path: str, headers: Any = None) -> None:  # one closed-loop client on a keep-alive connection
        conn = http.client.HTTPConnection(host, port, timeout=30)
        i = 0
        while time.monotonic() < stop:
            i += 1
            try:
                conn.request("GET", path, headers=headers(i) if callable(headers) else (headers or {}))
                r = conn.getresponse()
                r.read()
                seen[f"{kind} {r.status}"] += 1
                if r.will_close:
                    conn.close()
            except (OSError, http.client.HTTPException) as e:
                seen[f"{kind} {type(e).__name__}"] += 1
                conn.close()
                time.sleep(0.01)
        conn.close()

    def idle() -> None:  # 300 connections that never send a byte, each reopened after 0.2-1 s or when cut
        sel = selectors.DefaultSelector()
        live: dict[socket.socket, float] = {}

        def reopen(old: socket.socket | None) -> None:
            if old is not None:
                sel.unregister(old)
                live.pop(old, None)
                old.close()
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex((host, port))
            sel.register(s, selectors.EVENT_READ)
            live[s] = time.monotonic() + random.uniform(0.2, 1.0)
            seen["idle opened"] += 1

        for _ in range(300):
            reopen(None)
        while time.monotonic() < stop:
            for key, _ in sel.select(0.01):
                reopen(key.fileobj)  # type: ignore[arg-type]  # cut by the server (or refused): at once again
            now = time.monotonic()
            for s in [s for s, t in live.items() if t < now]:
                reopen(s)
        for s in list(live):
            s.close()
        sel.close()

    def periodic(path: str, every: float, out: list[float] | None, phase: float = 0.0) -> None:
        # As Prometheus and a status page do: one keep-alive connection, reopened only when it is lost.
        time.sleep(phase)
        conn: http.client.HTTPConnection | None = None
        while time.monotonic() < stop:
            t0 = time.monotonic()
            try:
                if conn is None:
                    conn = http.client.HTTPConnection(host, port, timeout=30)
                conn.request("GET", path)
                r = conn.getresponse()
                r.read()
                seen[f"{path} {r.status}"] += 1
            except (OSError, http.client.HTTPException) as e:
                seen[f"{path} {type(e).__name__}"] += 1
                if conn is not None:
                    conn.close()
                conn = None
            if out is not None:
                out.append(time.monotonic() - t0)
            time.sleep(max(0.0, every - (time.monotonic() - t0)))
        if conn is not None:
            conn.close()

    def probes() -> None:
        while time.monotonic() < stop:
            health_s.append(probe(host, port))
            if health_port is not None:  # the same probe on the health port (health_port=)
                health_port_s.append(probe(host, health_port))
            time.sleep(0.1)

    threads: list[threading.Thread] = []
    if kind == "metrics":
        threads += [threading.Thread(target=loop, args=("/metrics",)) for _ in range(50)]
    elif kind == "404":
        threads += [threading.Thread(target=loop, args=(f"/nope/{i}",)) for i in range(50)]
    elif kind == "accept":
        threads += [threading.Thread(target=loop, args=("/metrics", lambda i, c=c: {
            "Accept": f"application/openmetrics-text; version=1.0.0; q=0.{c % 9 + 1}, text/plain; q=0.{i % 9 + 1}, "
                      f"x/{c}-{i}"})) for c in range(50)]
    elif kind == "stats":
        threads += [threading.Thread(target=loop, args=("/stats",)) for _ in range(50)]
    elif kind == "idle":
        threads.append(threading.Thread(target=idle))
    elif kind == "tokens":
        threads += [threading.Thread(target=loop, args=("/profiles", lambda i, c=c: {
            "Authorization": f"Bearer guess-{c}-{i}", "X-Perfmon": "1"})) for c in range(8)]
    elif kind == "legit":  # three status pages and a scraper; the scrape is what is measured
        threads += [threading.Thread(target=periodic, args=("/stats", 3.0, None, p)) for p in (0.0, 1.0, 2.0)]
    if kind == "legit":
        threads.append(threading.Thread(target=periodic, args=("/metrics", 15.0, scrape_s, 2.5)))
    else:
        threads.append(threading.Thread(target=periodic, args=("/metrics", 1.0, scrape_s, 0.5)))
    threads.append(threading.Thread(target=probes))
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 60)
    return {"seen": dict(seen), "health": health_s, "scrape": scrape_s, "health_port": health_port_s}


def _pct(xs: list[float], q: float) -> float:
    return float(sorted(xs)[min(len(xs) - 1, int(len(xs) * q / 100))]) if xs else 0.0


#: Seconds the flood runs before the models are measured.
_LEAD = 2.0


def worker(legit: bool = False) -> None:
    """A model process with its own agent: prints its URL, then runs the model on each 'run SECONDS'.

    ``legit``: four models at 100% sampling (called in turn), the heaviest legitimate setup.
    """
    torch.set_num_threads(1)
    # No regression detector: a flood that slows the model would (rightly) trigger profiler captures,
    # which would perturb the very throughput measured here.
    mon = monitor(port=0, health_port=0, token="hostile-bench-token", regression=None,
                  **({"sample_rate": 1.0} if legit else {}))
    mon.start()
    models = [mon.wrap(torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128)),
                       name=f"m{i}" if legit else "m") for i in range(4 if legit else 1)]
    x = torch.randn(32, 128)
    with torch.inference_mode():
        for _ in range(200):  # warm up
            for model in models:
                model(x)
    assert mon.health_url is not None
    print(mon.url, mon.health_url.rsplit(":", 1)[1].split("/")[0], flush=True)
    for line in sys.stdin:
        seconds = float(line.split()[1])
        cpu0 = mon.cpu.totals()["http"]
        n, t0 = 0, time.monotonic()
        with torch.inference_mode():
            while time.monotonic() - t0 < seconds:
                models[n % len(models)](x)
                n += 1
        elapsed = time.monotonic() - t0
        shed = {s.labels["reason"]: int(s.value) for fam in mon.registry.collect() for s in fam.samples
                if s.name == "perfmon_agent_http_refused_total" and s.value}
        print(json.dumps({"rate": n / elapsed, "http_cpu": mon.cpu.totals()["http"] - cpu0,
                          "refused": shed}), flush=True)
    mon.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=6, help="rounds (pairs alternate the flooded worker)")
    parser.add_argument("--aa", action="store_true", help="no flood: the noise floor of the ratio")
    parser.add_argument("--health", action="store_true", help="probe latency per flood kind (see above)")
    parser.add_argument("--kinds", default=",".join(KINDS), help="flood kinds for --health, comma-separated")
    parser.add_argument("--attack", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--kind", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--health-port", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--legit", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.attack and args.kind:
        print(json.dumps(flood(args.attack, args.kind, args.seconds, args.health_port)), flush=True)
        return 0
    if args.attack:
        print(json.dumps(attack(args.attack, args.seconds)), flush=True)
        return 0
    if args.worker:
        worker(args.legit)
        return 0
    print(machine() + "\n")
    if args.health:
        return health_main(args.seconds, args.rounds, [k for k in args.kinds.split(",") if k])
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
                    [sys.executable, __file__, "--attack", urls[target].split()[0], "--seconds",
                     str(args.seconds + _LEAD + 1)],
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


def _workers(legit: bool) -> tuple[list[subprocess.Popen[str]], list[str]]:
    extra = ["--legit"] if legit else []
    workers = [subprocess.Popen([sys.executable, __file__, "--worker", *extra], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True) for _ in range(2)]
    return workers, [w.stdout.readline().strip() for w in workers]  # type: ignore[union-attr]  # "URL HEALTHPORT"


def _close(workers: list[subprocess.Popen[str]]) -> None:
    for w in workers:
        w.stdin.close()  # type: ignore[union-attr]
        w.wait(30)


def health_main(seconds: float, rounds: int, kinds: list[str]) -> int:
    """--health: for each flood kind, rounds alternating the flooded worker; probe and scrape latencies."""
    rows = []
    plain: tuple[list[subprocess.Popen[str]], list[str]] | None = None
    try:
        for kind in kinds:
            legit = kind == "legit"
            if legit:
                workers, urls = _workers(True)
            else:
                plain = plain or _workers(False)
                workers, urls = plain
            length = max(seconds, 30.0) if legit else seconds
            health: list[float] = []
            on_port: list[float] = []
            scrape: list[float] = []
            ratios: list[float] = []
            cpu = 0.0
            seen: collections.Counter[str] = collections.Counter()
            try:
                for i in range(rounds):
                    target = i % 2
                    url, health_port = urls[target].split()
                    attacker = subprocess.Popen([sys.executable, __file__, "--attack", url, "--kind", kind,
                                                 "--seconds", str(length + _LEAD + 1), "--health-port", health_port],
                                                stdout=subprocess.PIPE, text=True)
                    time.sleep(_LEAD)
                    for w in workers:
                        w.stdin.write(f"run {length}\n")  # type: ignore[union-attr]
                        w.stdin.flush()  # type: ignore[union-attr]
                    got = [json.loads(w.stdout.readline()) for w in workers]  # type: ignore[union-attr]
                    out, _ = attacker.communicate(timeout=length + 120)
                    saw = json.loads(out.strip().splitlines()[-1])
                    health += saw["health"]
                    on_port += saw["health_port"]
                    scrape += saw["scrape"]
                    seen.update(saw["seen"])
                    cpu += got[target]["http_cpu"]
                    ratios.append(got[target]["rate"] / got[1 - target]["rate"])
            finally:
                if legit:
                    _close(workers)
            pairs = [math.sqrt(a * b) for a, b in zip(ratios[::2], ratios[1::2], strict=False)] or ratios
            rows.append([kind, str(len(health)), f"{_pct(health, 50) * 1e3:.0f}", f"{_pct(health, 99) * 1e3:.0f}",
                         f"{max(health, default=0) * 1e3:.0f}", str(sum(h >= 10.0 for h in health)),
                         f"{_pct(on_port, 99) * 1e3:.0f} / {max(on_port, default=0) * 1e3:.0f}",
                         f"{_pct(scrape, 50) * 1e3:.0f}", f"{max(scrape, default=0) * 1e3:.0f}",
                         f"{statistics.median(pairs):.3f}", f"{100 * cpu / (rounds * length):.2f}"])
            print(f"{kind}: " + ", ".join(f"{k}: {v}" for k, v in sorted(seen.items())), flush=True)
    finally:
        if plain is not None:
            _close(plain[0])
    print()
    print(table(["flood", "probes", "/healthz p50 ms", "p99 ms", "max ms", "failed (10 s)",
                 "health port p99 / max ms", "scrape p50 ms",
                 "scrape max ms", "model ratio", "agent HTTP CPU, % of a core"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
