"""Memory over time: RSS and Python's allocated blocks after 1M and 10M wrapped calls at 100% sampling.

A trivial wrapped function so that the calls are perfmon's cost and little else; the resolver runs
on its thread as in production. Bounded means: the 10M figure is not ~10x the 1M figure.

    python benchmarks/memory.py [--calls 1000000,10000000] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import resource
import sys
import time

from common import dump, machine, monitor, table


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", default="1000000,10000000")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    checkpoints = sorted(int(c) for c in args.calls.split(","))
    print(machine() + "\n")
    mon = monitor(sample_rate=1.0, regression=None)
    mon.start()

    def fn(i: int) -> int:
        return i

    f = mon.instrument(fn, name="f")
    gc.collect()
    base_rss, base_blocks = rss_mib(), sys.getallocatedblocks()
    rows, data = [["0", f"{base_rss:.1f}", base_blocks, "-", "-"]], {}
    done = 0
    t0 = time.monotonic()
    for target in checkpoints:
        while done < target:
            f(done)
            done += 1
        mon.flush()
        gc.collect()
        rss, blocks = rss_mib(), sys.getallocatedblocks()
        st = mon.stats()["models"]["f"]
        data[target] = {"rss_mib": rss, "blocks": blocks, "sampled": st["sampled"], "dropped": st["dropped"]}
        rows.append([f"{target:,}", f"{rss:.1f}", blocks, f"{st['sampled']:,}", st["dropped"] or "none"])
    mon.stop()
    print(table(["calls", "RSS MiB", "Python blocks", "timed", "dropped"], rows))
    print(f"\n{done:,} calls in {time.monotonic() - t0:.0f} s")
    dump(args.json, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
