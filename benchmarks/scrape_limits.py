"""Scrapes at the documented limits: 64 models and 64 generation names, two scrapers, the default CPU budget.

An agent with ``max_models`` (64) wrapped models and as many generation names, a traffic thread that keeps
every series alive (each model gets calls and each name requests between scrapes), and two scrapers every
``--interval`` seconds (15: Prometheus' usual setting), offset by half an interval as an HA pair's are.
Each scrape asks as Prometheus does (``--accept``: the OpenMetrics preference Prometheus sends by default,
plain text, or protobuf) with ``Accept-Encoding: gzip``, and waits up to ``--client-timeout`` seconds
(longer than Prometheus' 10 s scrape timeout, so the whole distribution is seen). Printed: scrape time
p50/p99/max and how many took over 10 s, one render's time and size per format (median of 15, measured
in-process before the scrapers start), the series count, the agent's HTTP CPU as a share of a core and
the time it paused for its budget.

    python benchmarks/scrape_limits.py [--seconds 140] [--interval 15] [--budget 0.01] [--heap 0] [--json out.json]

``--heap N`` has the application hold N live objects and keep each request's record for a while, as a large
server does (a transformers server holds a few million): full garbage collections then take what they take in
such a process (~0.6 s at 850,000 objects here) and come round every few scrapes, and a render (a burst of
allocations) can be the one that starts one, on the HTTP thread. Printed beside the scrapes:
full collections meanwhile and the seconds of those that ran on the HTTP thread (left out of its budget).

``--interval 1.5 --budget 0.1`` compresses the schedule tenfold at the same budget ratio (CPU per scrape
interval); waits for the budget shrink tenfold with it, render times do not.
"""

from __future__ import annotations

import argparse
import collections
import gc
import gzip
import http.client
import itertools
import statistics
import sys
import threading
import time

import torch
from common import dump, machine, monitor, table

from perfmon.http.wire import metrics_format

#: What Prometheus 2.x sends by default (OpenMetrics preferred), plain text, and the native-histogram protobuf.
ACCEPTS = {
    "openmetrics": "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                   "text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
    "text": "text/plain;version=0.0.4",
    "protobuf": "application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited;q=0.7,"
                "text/plain;version=0.0.4;q=0.3",
}


def traffic(mon, models, stop: threading.Event, kept: collections.deque | None = None) -> None:
    """Round-robin calls of every model and a short generation request per name, ~200 rounds a second; with
    ``kept``, each round's request record (a few small containers) is kept until the deque drops it."""
    x = torch.randn(2, 8)
    names = [f"gen_{i:02d}" for i in range(len(models))]
    for i in itertools.cycle(range(len(models))):
        if stop.is_set():
            return
        models[i](x)
        with mon.generation(names[i], prompt_tokens=16 + i) as g:
            for _ in range(1 + i % 5):
                g.token()
        if kept is not None:
            kept.extend({"id": i, "tokens": [i] * 4, "meta": (i, names[i])} for _ in range(20))
        time.sleep(0.005)


def scraper(port: int, accept: str, start: float, interval: float, until: float, timeout: float,
            out: list[float]) -> None:
    """GET /metrics at start, start + interval, ... (before ``until``); each scrape's seconds into ``out``."""
    for k in itertools.count():
        at = start + k * interval
        if at >= until:
            return
        time.sleep(max(0.0, at - time.monotonic()))
        t0 = time.monotonic()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        try:
            conn.request("GET", "/metrics", headers={"Accept": accept, "Accept-Encoding": "gzip"})
            resp = conn.getresponse()
            body = resp.read()
            ok = resp.status == 200 and len(gzip.decompress(body)) > 0
        except OSError:
            ok = False
        finally:
            conn.close()
        out.append(time.monotonic() - t0 if ok else float("inf"))


def render_ms(mon, fmt: str, repeat: int = 15) -> tuple[float, int, int]:
    """(median render ms, bytes, sample lines) of one format, rendered in-process."""
    encoder, _ = metrics_format(ACCEPTS[fmt])
    encoder(mon.registry)  # the first render of a format builds its per-series caches
    took = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        body = encoder(mon.registry)
        took.append(time.perf_counter() - t0)
    lines = sum(1 for ln in body.split(b"\n") if ln and not ln.startswith(b"#")) if fmt != "protobuf" else 0
    return statistics.median(took) * 1e3, len(body), lines


def value(mon, name: str, **labels: str) -> float:
    return mon.registry.get_sample_value(name, labels) or 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=140.0, help="how long the scrapers run")
    parser.add_argument("--interval", type=float, default=15.0, help="each scraper's scrape interval (s)")
    parser.add_argument("--budget", type=float, default=0.01, help="http_cpu_budget (fraction of a core)")
    parser.add_argument("--accept", choices=sorted(ACCEPTS), default="openmetrics")
    parser.add_argument("--client-timeout", type=float, default=60.0)
    parser.add_argument("--heap", type=int, default=0, help="live objects the application holds (0: none)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    print(machine() + "\n")

    heap = [(i, [i]) for i in range(args.heap // 2)]  # noqa: F841 - held (two tracked objects each)
    kept: collections.deque | None = collections.deque(maxlen=200_000) if args.heap else None
    mon = monitor(port=0, http_cpu_budget=args.budget)
    mon.start()
    n = mon.config.max_models
    models = [mon.wrap(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()), name=f"model_{i:02d}")
              for i in range(n)]
    stop = threading.Event()
    feeder = threading.Thread(target=traffic, args=(mon, models, stop, kept), daemon=True)
    feeder.start()
    time.sleep(3.0)  # every model past warm-up with steady samples, every name with requests
    mon.flush()
    renders = {fmt: render_ms(mon, fmt) for fmt in ACCEPTS}
    series = renders["text"][2]

    cpu0, paused0 = value(mon, "perfmon_agent_cpu_seconds_total", thread="http"), \
        value(mon, "perfmon_agent_http_paused_seconds_total")
    port = int(mon.url.rsplit(":", 1)[1])
    server = mon.ports.server
    clock = getattr(server, "gc_clock", None)  # older trees charged collections to the budget: not summed
    gc0, full0 = clock.seconds() if clock is not None else 0.0, gc.get_stats()[2]["collections"]
    t0 = time.monotonic()
    until = t0 + args.seconds
    results: list[list[float]] = [[], []]
    scrapers = [threading.Thread(target=scraper, args=(port, ACCEPTS[args.accept], t0 + k * args.interval / 2,
                                                       args.interval, until, args.client_timeout, results[k]))
                for k in range(2)]
    for s in scrapers:
        s.start()
    for s in scrapers:
        s.join(args.seconds + args.client_timeout + 5)
    wall = time.monotonic() - t0
    cpu = value(mon, "perfmon_agent_cpu_seconds_total", thread="http") - cpu0
    paused = value(mon, "perfmon_agent_http_paused_seconds_total") - paused0
    on_http = clock.seconds() - gc0 if clock is not None else float("nan")
    full = gc.get_stats()[2]["collections"] - full0
    stop.set()
    feeder.join(5)
    mon.stop()

    took = sorted(results[0] + results[1])
    failed = sum(1 for t in took if t == float("inf"))
    ok = [t for t in took if t != float("inf")]
    p99 = took[min(len(took) - 1, round(0.99 * (len(took) - 1)))]
    print(f"{n} models + {n} generation names, {series} series; budget {args.budget} of a core; two scrapers every "
          f"{args.interval:g} s ({args.accept}, gzip) for {args.seconds:g} s; application heap {args.heap:,} objects; "
          f"{len(gc.get_objects()):,} tracked\n")
    print(table(["format", "render ms (median of 15)", "bytes"],
                [[fmt, f"{ms:.1f}", b] for fmt, (ms, b, _) in renders.items()]))
    print()
    def secs(t: float) -> str:
        return f"{t:.3f}" if t != float("inf") else f"> {args.client_timeout:g} (gave up)"

    print(table(["scrapes", "p50 s", "p99 s", "max s", "over 10 s", "failed", "HTTP CPU (share of a core)",
                 "paused s", "full GCs", "full-GC s on the HTTP thread"],
                [[len(took), secs(statistics.median(took)), secs(p99), secs(max(took)),
                  sum(1 for t in took if t > 10.0), failed, f"{cpu / wall:.4f}", f"{paused:.1f} of {wall:.0f}",
                  full, f"{on_http:.2f}"]]))
    dump(args.json, {"series": series, "renders": {k: {"ms": v[0], "bytes": v[1]} for k, v in renders.items()},
                     "scrapes": ok, "failed": failed, "http_cpu_share": cpu / wall, "paused_seconds": paused,
                     "wall_seconds": wall, "interval": args.interval, "budget": args.budget, "accept": args.accept,
                     "heap": args.heap, "full_collections": full, "gc_seconds_on_http": on_http})
    return 0


if __name__ == "__main__":
    sys.exit(main())
