"""Background cost: CPU seconds perfmon's own threads use per wall second, at 100, 1000 and 5000 calls/s.

Default settings (1% sampling, 50 ms resolver interval, NVML poller on where present), a trivial
wrapped model called at a paced rate from one thread, and a Prometheus-style scrape of /metrics
every second. The figure is perfmon_agent_cpu_seconds_total (resolver + http + nvml) over the
run's wall time, in percent of one core.

    python benchmarks/background.py [--seconds 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import sys
import time
import urllib.request

import torch
from common import dump, machine, monitor, table


class Tiny(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def run(rate: int, seconds: float) -> dict[str, float]:
    mon = monitor(port=0, regression=None)
    mon.start()
    model = mon.wrap(Tiny(), name="m")
    x = torch.zeros(1)
    cpu0 = mon.cpu.totals()
    start = time.monotonic()
    next_scrape = start + 1.0
    calls = 0
    batch = max(1, rate // 200)  # pace in batches of 5 ms
    while (now := time.monotonic()) - start < seconds:
        for _ in range(batch):
            model(x)
        calls += batch
        if now >= next_scrape:
            urllib.request.urlopen(mon.url + "/metrics", timeout=5).read()
            next_scrape += 1.0
        delay = start + calls / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)
    wall = time.monotonic() - start
    cpu1 = mon.cpu.totals()
    mon.stop()
    used = {k: cpu1[k] - cpu0.get(k, 0.0) for k in cpu1}
    return {"calls_per_s": calls / wall, "cpu_percent": 100 * sum(used.values()) / wall,
            **{f"{k}_percent": 100 * v / wall for k, v in used.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    print(machine() + "\n")
    rows, data = [], {}
    for rate in (100, 1000, 5000):
        r = run(rate, args.seconds)
        data[rate] = r
        rows.append([rate, f"{r['calls_per_s']:.0f}", f"{r['cpu_percent']:.3f}%", f"{r['resolver_percent']:.3f}%",
                     f"{r['http_percent']:.3f}%", f"{r['nvml_percent']:.3f}%"])
    print(table(["target calls/s", "achieved", "agent CPU (% of a core)", "resolver", "http (1 scrape/s)", "nvml"],
                rows))
    dump(args.json, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
