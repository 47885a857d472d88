"""What NVML polling costs a GIL-bound serving thread: the mechanism the lent H200 showed, reproduced on CPU.

Every pynvml call is a ctypes call: it lets go of the GIL for the C call and takes it back. A slow call (a driver
ioctl) hands the GIL to a serving thread that wants it, and then has to take it back from that thread: a forced
switch, with two thread wakes, that the serving thread pays. On a lent H200 host (``make gpu-check``, agent_cost)
a loop holding the GIL stood still 1.8 ms a second more with the monitor running than stopped, at 0.67 NVML polls
a second of ~17 C calls each, and almost nothing else awake.

Here ``FakeNvml`` answers each call after a C ``usleep`` made through ctypes (the GIL let go, as pynvml's are),
and ``common.gil_stalls`` (a pure-Python loop that never lets go of the GIL) reads what the poller takes, polling
every 0.2 s, against the same loop with no poller, in interleaved rounds. Printed: C calls a poll, the loop's
stall a poll and a call, and what that makes a second at the default interval.

    python benchmarks/nvml_cost.py [--rounds 8] [--seconds 2] [--call-us 200]

Not a test: read ratios, on a quiet machine.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import random
import statistics
from typing import Any

from common import dump, gil_stalls, machine, table

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--call-us", type=int, default=200, help="µs each NVML call spends in C, the GIL let go")
    ap.add_argument("--json")
    args = ap.parse_args()
    nvml = SlowNvml(args.call_us)
    interval = 0.2
    stalled: dict[str, list[float]] = {"no poller": [], "polling": []}  # ms stalled a second, a round each
    polls = calls = 0
    for _ in range(args.rounds):
        for variant in random.sample(list(stalled), 2):
            poller = NvmlPoller(nvml, interval_seconds=interval) if variant == "polling" else None
            if poller is not None:
                poller.start()  # its first poll (the lookups) runs here, before the loop
                before_polls, before_calls = nvml.fake.calls.get("nvmlDeviceGetCount", 0), sum(nvml.fake.calls.values())
            got = gil_stalls(args.seconds)
            if poller is not None:
                polls += nvml.fake.calls.get("nvmlDeviceGetCount", 0) - before_polls
                calls += sum(nvml.fake.calls.values()) - before_calls
                poller.stop()
            stalled[variant].append(sum(ns for _, ns in got) / args.seconds / 1e6)
    added = [p - n for p, n in zip(stalled["polling"], stalled["no poller"], strict=True)]
    seconds = args.rounds * args.seconds
    per_poll_ms = statistics.median(added) / (polls / seconds) if polls else float("nan")
    calls_per_poll = calls / max(polls, 1)
    default = Config().nvml_interval_seconds
    print(f"# NVML polling's cost to a loop holding the GIL ({machine()})\n")
    print(f"1 GPU, each NVML call {args.call_us} µs in C with the GIL let go; polling every {interval} s; "
          f"{args.rounds} rounds of {args.seconds} s\n")
    rows = [[k, f"{statistics.median(v):.2f}", f"{min(v):.2f}..{max(v):.2f}"] for k, v in stalled.items()]
    print(table(["variant", "ms stalled a second (median)", "range"], rows))
    print(f"\npolls {polls} ({polls / seconds:.2f}/s), NVML calls a poll {calls_per_poll:.1f}; the loop stood still "
          f"**{per_poll_ms:.2f} ms a poll** ({per_poll_ms * 1e3 / calls_per_poll:.0f} µs a call); at the default "
          f"{default:g} s interval **{per_poll_ms / default / 10:.4f}%** of a serving thread, at 1 s "
          f"{per_poll_ms / 10:.4f}%")
    dump(args.json, {"machine": machine(), "stalled_ms_per_s": stalled, "polls": polls,
                     "calls_per_poll": calls_per_poll, "stall_ms_per_poll": per_poll_ms,
                     "share_at_default": per_poll_ms / default / 1e3, "default_interval_s": default})


if __name__ == "__main__":
    main()
