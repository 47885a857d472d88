"""Live efficiency per model and stage: achieved FLOP/s and bytes/s of the sampled calls, MFU and MBU.

A resolver sink (``observe``) adds each steady sample's measured duration (device time from CUDA events on
GPU, wall time on CPU) to its input signature's total in the current second: reads sum a window's seconds and
signatures (at most ``window`` seconds x the signatures seen in each), not its samples, which at 100% sampling
were 10,000 a series to walk on every scrape and /stats. The first steady sample of a signature not counted yet hands
it to the counter (agent/flopcount.py: its own short-lived thread, within a budget); the figures read each
signature's count when they are read, so the samples taken before it landed count too. Read over the ``/stats`` window
(``stats_window_seconds``):

    achieved FLOP/s = sum of the counted FLOPs of the window's steady samples / the sum of their durations
    bytes/s         = the same with the counted bytes (an estimate: flopcount.py says what is counted)
    MFU             = sum of (each sample's FLOPs / its peak FLOP/s) / the sum of their durations
    MBU             = bytes/s / the peak memory bandwidth

So the figures are the model's efficiency *while it runs* (time between calls is not in them). Samples whose
signature is not counted (unknown, or not yet) are left out of the rates and reported as their share; MFU and
MBU need a peak (captures/roofline.py: the ``peak_flops``/``peak_bandwidth`` settings, else the GPU table):
with none (CPUs, unknown GPUs) they are absent and /stats says so, never invented.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from time import perf_counter_ns
from typing import Any

from ..agent.flopcount import Count, FlopCounter, Unknown
from ..agent.records import STEADY, Sample
from ..agent.state import ModelState
from ..captures.roofline import Peaks
from ..faults import count_value

__all__ = ["Efficiency"]

_NO_SIGNATURE = "no input signature (signature tracking is off, or the model's signatures churned)"
_NOT_YET = "not counted yet"


#: One second of a series: (second, {signature (or None): [samples, seconds]}).
_Second = tuple[int, dict[Any, list[float]]]


class Efficiency:
    """Per (model, stage): per second, the steady samples and their seconds by signature, and their figures."""

    def __init__(self, counter: FlopCounter, *, window_seconds: float,
                 peaks: Callable[[str], Peaks | None], state_of: Callable[[str, str], ModelState | None]) -> None:
        self.counter = counter
        self.window_ns = int(window_seconds * 1e9)
        self._seconds_kept = int(window_seconds) + 2  # the window's seconds, the partial ones at both ends
        self._peaks_of = peaks
        self._state_of = state_of
        self._peaks: dict[str, Peaks | None] = {}
        self.reset_after_fork()

    def reset_after_fork(self) -> None:
        """Empty (also the initial state): the parent's samples are the parent's."""
        self._rings: dict[tuple[str, str], collections.deque[_Second]] = {}
        self._devices: dict[tuple[str, str], str] = {}
        self._lock = threading.Lock()
        self.counter.reset_after_fork()

    def start(self) -> None:
        """Monitor.start(): torch's fake-tensor imports now, on the caller's thread (FlopCounter.prepare)."""
        self.counter.prepare()

    def stop(self, timeout_seconds: float) -> None:
        """Stop the counting thread (Monitor.stop, after the resolver)."""
        self.counter.stop(timeout_seconds)

    def observe(self, samples: list[Sample]) -> None:
        """Resolver sink: keep a pass's steady samples; count a signature first if it was never counted."""
        steady = [s for s in samples if s.phase == STEADY]
        if not steady:
            return
        for sample in steady:
            sig = sample.sig
            if sig is not None and sig.count is None:
                st = self._state_of(sample.model, sample.stage)
                # counted on the counter's own thread
                self.counter.submit(None if st is None else st.target, sig, -1 if st is None else st.cuda_index)
        rings, devices = self._rings, self._devices
        with self._lock:
            for sample in steady:
                key = (sample.model, sample.stage)
                second = sample.end_ns // 1_000_000_000
                ring = rings.get(key)
                if ring is None:
                    ring = rings[key] = collections.deque(maxlen=self._seconds_kept)
                if not ring or ring[-1][0] != second:
                    ring.append((second, {}))
                by_sig = ring[-1][1]
                total = by_sig.get(sample.sig)
                if total is None:
                    by_sig[sample.sig] = [1, sample.duration_seconds]
                else:
                    total[0] += 1
                    total[1] += sample.duration_seconds
                devices[key] = sample.device

    def series(self) -> list[tuple[str, str]]:
        """The (model, stage) pairs with steady samples kept."""
        with self._lock:
            return list(self._rings)

    def peaks(self, device: str) -> Peaks | None:
        """The device's peaks (the settings', else the GPU table's), looked up once per device label."""
        if device not in self._peaks:
            self._peaks[device] = self._peaks_of(device)
        return self._peaks[device]

    def figures(self, model: str, stage: str = "", now_ns: int | None = None) -> dict[str, Any] | None:
        """The window's figures for one series, or None when it has no steady sample kept (units in the keys)."""
        cutoff = ((perf_counter_ns() if now_ns is None else now_ns) - self.window_ns) // 1_000_000_000
        totals: dict[Any, list[float]] = {}
        with self._lock:
            for second, by_sig in self._rings.get((model, stage), ()):
                if second >= cutoff:  # whole seconds: the window's oldest second counts in full
                    for sig, (n, spent) in by_sig.items():
                        total = totals.setdefault(sig, [0, 0.0])
                        total[0] += n
                        total[1] += spent
            device = self._devices.get((model, stage), "cpu")
        samples = int(sum(n for n, _ in totals.values()))
        if not samples:
            return None
        peaks = self.peaks(device)
        seconds = utilization = 0.0
        flops = moved = counted = 0
        half = False
        unknown: dict[str, int] = {}
        for sig, (n, spent) in totals.items():
            n = int(n)
            count = None if sig is None else sig.count
            if type(count) is Count:
                counted += n
                seconds += spent
                flops += n * count.flops
                moved += n * count.bytes
                half = half or count.half
                if peaks is not None:
                    utilization += n * count.flops / (peaks.flops_16bit if count.half else peaks.flops_32bit)
                continue
            why = _NO_SIGNATURE if sig is None else _NOT_YET if count is None else \
                count.reason if isinstance(count, Unknown) else str(count)
            unknown[why] = unknown.get(why, 0) + n
        rate = seconds > 0
        out: dict[str, Any] = {
            "device": device, "samples": samples, "counted_samples": counted,
            "unknown_ratio": (samples - counted) / samples, "unknown": unknown,
            "flops_per_call": flops / counted if counted else None,
            "bytes_per_call": moved / counted if counted else None,
            "flops_per_second": flops / seconds if rate else None,
            "bytes_per_second": moved / seconds if rate else None,
            "mfu_ratio": utilization / seconds if rate and peaks is not None else None,
            "mbu_ratio": moved / seconds / peaks.bandwidth if rate and peaks is not None else None,
        }
        if peaks is None:
            out["peak_source"] = None
            out["peak_note"] = (f"no peak for {device}: MFU and MBU are not reported (set peak_flops and "
                                "peak_bandwidth to give one)")
        else:
            out["peak_source"] = peaks.source
            out["peak_flops_per_second"] = peaks.flops_16bit if half else peaks.flops_32bit
            out["peak_bandwidth_bytes_per_second"] = peaks.bandwidth
        return out

    def view(self, st: ModelState, now_ns: int | None = None) -> dict[str, Any]:
        """/stats' ``efficiency`` of one state: its figures, or why there are none."""
        figures = self.figures(st.name, st.stage, now_ns)
        if figures is not None:
            return figures
        return {"samples": 0, "note": "no steady sample in the window"}

    def counting(self) -> dict[str, Any]:
        """What counting did: outcomes and the seconds it spent (/stats)."""
        c = self.counter
        return {"counts": {k: count_value(v) for k, v in c.counts.items()}, "seconds": c.seconds,
                "per_minute": c.per_minute, "timeout_seconds": c.timeout_seconds}
