"""What NVML polling costs a GIL-bound serving thread: the mechanism the lent H200 showed, reproduced on CPU.

Every pynvml call is a ctypes call: it lets go of the GIL for the C call and takes it back. A slow call (a driver
ioctl) hands the GIL to a serving thread that wants it, and then has to take it back from that thread: a forced
switch, with two thread wakes, that the serving thread pays. On a lent H200 host (``make gpu-check``, agent_cost)
a loop holding the GIL stood still 1.8 ms a second more with the monitor running than stopped, at 0.67 NVML polls
a second of ~17 C calls each, and almost nothing else awake.

Here ``FakeNvml`` answers each call after a C ``usleep`` made through ctypes (the GIL let go, as pynvml's are),
and ``common.poll_stall`` (a pure-Python loop that never lets go of the GIL, ``common.gil_stalls``) reads what a
thread polling every 0.2 s takes, against the same loop with no poller, in interleaved rounds. Printed: C calls a
poll, the loop's stall a poll and a call, and what that makes a second by who reads: the poller plans its polls on
its readers (one a scrape for a steady Prometheus, one a minute for nobody), and ``common.poll_schedule`` runs its
schedule on a hand-driven clock for each pattern of reads.

    python benchmarks/nvml_cost.py [--rounds 8] [--seconds 2] [--call-us 200]

Not a test: read ratios, on a quiet machine.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import statistics
from typing import Any

from common import dump, machine, poll_schedule, poll_stall, table

from perfmon.config import Config
from perfmon.telemetry.nvml import NvmlPoller
from perfmon.testing import FakeNvml


class SlowNvml:
    """``FakeNvml`` whose every ``nvml*`` call first spends ``call_us`` in C with the GIL let go (a driver call)."""

    def __init__(self, call_us: int, gpus: int = 1) -> None:
        self.fake = FakeNvml(gpus)
        self._sleep = ctypes.CDLL(ctypes.util.find_library("c")).usleep
        self._us = call_us

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.fake, name)
        if not (name.startswith("nvml") and callable(attr)):
            return attr
        sleep, us = self._sleep, self._us

        def call(*args: Any) -> Any:
            sleep(us)
            return attr(*args)

        return call


#: Who reads the GPUs' figures, as read times (seconds from start) over an hour: the poller plans its polls on them.
READERS: dict[str, list[float]] = {
    "nobody": [],
    "a Prometheus every 15 s": [7.0 + 15 * k for k in range(240)],
    "a Prometheus every 30 s": [7.0 + 30 * k for k in range(120)],
    "a Prometheus every 60 s": [7.0 + 60 * k for k in range(60)],
    "a Prometheus every 5 s": [2.0 + 5 * k for k in range(720)],
    "an HA pair every 15 s, 6 s apart": sorted([7.0 + 15 * k for k in range(240)]
                                               + [13.0 + 15 * k for k in range(240)]),
    "a Prometheus every 15 s and a status page open (3 s)": sorted([7.0 + 15 * k for k in range(240)]
                                                                   + [1.0 + 3 * k for k in range(1200)]),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--call-us", type=int, default=200, help="µs each NVML call spends in C, the GIL let go")
    ap.add_argument("--json")
    args = ap.parse_args()
    nvml = SlowNvml(args.call_us)
    poller = NvmlPoller(nvml)
    poller.poll()  # the lookups (handles, UUIDs, static fields) are the first poll's
    before = sum(nvml.fake.calls.values()), nvml.fake.calls["nvmlDeviceGetCount"]
    got = poll_stall(poller.poll, rounds=args.rounds, seconds=args.seconds)
    polls = max(nvml.fake.calls["nvmlDeviceGetCount"] - before[1], 1)
    calls_per_poll = (sum(nvml.fake.calls.values()) - before[0]) / polls
    per_poll_ms = got["per_poll_ns"] / 1e6
    interval = Config().nvml_interval_seconds
    print(f"# NVML polling's cost to a loop holding the GIL ({machine()})\n")
    print(f"1 GPU, each NVML call {args.call_us} µs in C with the GIL let go; a thread polling every 0.2 s; "
          f"{args.rounds} rounds of {args.seconds} s\n")
    rows = [[k, f"{statistics.median(v):.2f}", f"{min(v):.2f}..{max(v):.2f}"] for k, v in got["stalled"].items()]
    print(table(["variant", "ms stalled a second (median)", "range"], rows))
    print(f"\npolls {got['polls']}, NVML calls a poll {calls_per_poll:.1f}; the loop stood still "
          f"**{per_poll_ms:.2f} ms a poll** ({per_poll_ms * 1e3 / calls_per_poll:.0f} µs a call)\n")
    print(f"What that makes a second, by who reads (the poller's own schedule over an hour, interval {interval:g} s; "
          f"a poller polling every interval whoever reads: {60 / interval:.0f} polls a minute, "
          f"{per_poll_ms / interval / 10:.4f}%):\n")
    rows, schedule = [], {}
    for name, reads in READERS.items():
        plan = schedule[name] = poll_schedule(reads)
        age = "—" if reads == [] else f"{plan['age_median']:.1f} / {plan['age_max']:.1f}"
        rows.append([name, f"{plan['per_s'] * 60:.1f}", age,
                     f"{per_poll_ms * plan['per_s'] / 10:.4f}%"])
    print(table(["readers", "polls a minute", "reading's age at a read, s (median / max)",
                 "share of a serving thread"], rows))
    dump(args.json, {"machine": machine(), "stalled_ms_per_s": got["stalled"], "polls": got["polls"],
                     "calls_per_poll": calls_per_poll, "stall_ms_per_poll": per_poll_ms,
                     "default_interval_s": interval, "schedule": schedule})


if __name__ == "__main__":
    main()
