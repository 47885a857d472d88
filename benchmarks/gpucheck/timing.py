"""Timing checks: device time against a reference event pair, host vs device time, no sync on the
request path, and perfmon's overhead on a real forward."""

from __future__ import annotations

import functools
import math
import statistics
import time

import torch

from .common import Check, Figure, device_seconds, encoder, host_seconds, quiet_monitor, ref_ms
from .rig import Rig

__all__ = ["TIMING_SIZES_MS", "check_host_vs_device", "check_no_sync", "check_overhead", "check_timing_truth"]

TIMING_SIZES_MS = (0.05, 1.0, 20.0)


def check_timing_truth(rig: Rig, *, quick: bool = False) -> Check:
    """perfmon's device time vs a reference event pair, per kernel size (~50 µs, ~1 ms, ~20 ms).

    Pass: each size's mean error is within 10% or 10 µs. The device is kept busy while the events are
    queued, so the two pairs differ only by what runs between them on the stream (nothing, here).
    """
    reps = 5 if quick else 20
    figures: dict[str, Figure] = {}
    worst = 0.0
    bad: list[str] = []
    for ms in TIMING_SIZES_MS:
        mon = quiet_monitor(rig, sample_rate=1.0, warmup_calls=0)
        try:
            name = f"sleep_{ms:g}ms"
            model = mon.wrap(rig.work(ms), name=name, device=rig.device)
            filler = rig.work(50.0)
            x = rig.input()
            model(x)  # the first call of a signature is cold: keep it out of the comparison
            rig.synchronize()
            mon.flush(timeout=10)
            before, n0 = device_seconds(mon, name)
            call = functools.partial(model, x)
            truth_ms = 0.0
            for _ in range(reps):
                # A 50 ms kernel queued first keeps the device busy while the host enqueues the reference
                # and perfmon's events: they then run back to back, so host launch gaps (µs, which would
                # swamp a 50 µs kernel) fall outside both pairs. 5 ms was not enough on a lent H100 whose
                # every launch took 0.3-1 ms (200 tiny kernels: 70-196 ms of host time, 3 ms elsewhere):
                # the reference then held ms of idle device, and the 1 ms size read 62% off.
                filler(x)
                truth_ms += ref_ms(rig, call)
            if not mon.flush(timeout=10):
                raise RuntimeError("perfmon did not resolve its samples within 10 s")
            after, n1 = device_seconds(mon, name)
            got_ms = (after - before) * 1e3
            if n1 - n0 != reps:
                bad.append(f"{ms:g} ms: {n1 - n0:g} of {reps} calls timed")
            err_ms = abs(got_ms - truth_ms) / reps
            rel = err_ms / max(truth_ms / reps, 1e-9)
            label = f"{ms:g}ms"
            figures[f"{label}.reference_mean"] = (truth_ms / reps * 1e3, "µs")
            figures[f"{label}.perfmon_mean"] = (got_ms / reps * 1e3, "µs")
            figures[f"{label}.error"] = (err_ms * 1e3, "µs")
            figures[f"{label}.relative_error"] = (rel, "1")
            if rel > 0.10 and err_ms > 0.010:
                bad.append(f"{ms:g} ms off by {rel:.1%}")
            worst = max(worst, rel)
        finally:
            mon.stop()
    if bad:
        return Check("timing_truth", "fail", "; ".join(bad), figures)
    return Check("timing_truth", "pass",
                 f"device time matches a reference event pair at 50 µs/1 ms/20 ms (worst {worst:.1%})", figures)


def check_host_vs_device(rig: Rig, *, quick: bool = False) -> Check:
    """Host vs device time: a launch-bound call (host ≥ device) and a device-bound one (host ≪ device).

    Pass: the launch-bound call's device time is at most 1.5 times its host time plus 50 µs, and the 20 ms
    kernel's host time is under a fifth of its device time.
    """
    reps = 5 if quick else 20
    mon = quiet_monitor(rig, sample_rate=1.0, warmup_calls=1)
    try:
        launch = mon.wrap(rig.launch_bound(), name="launch_bound", device=rig.device)
        sleep = mon.wrap(rig.work(20.0), name="device_bound", device=rig.device)
        x = rig.input()
        for _ in range(reps + 1):
            launch(x)
            sleep(x)
            rig.synchronize()
        if not mon.flush(timeout=10):
            raise RuntimeError("perfmon did not resolve its samples within 10 s")
        lh, ln = host_seconds(mon, "launch_bound")
        ld, _ = device_seconds(mon, "launch_bound")
        sh, sn = host_seconds(mon, "device_bound")
        sd, _ = device_seconds(mon, "device_bound")
    finally:
        mon.stop()
    if not (ln and sn):
        return Check("host_vs_device", "fail", "no samples recorded")
    figures: dict[str, Figure] = {
        "launch_bound.host_mean": (lh / ln * 1e6, "µs"), "launch_bound.device_mean": (ld / ln * 1e6, "µs"),
        "device_bound.host_mean": (sh / sn * 1e6, "µs"), "device_bound.device_mean": (sd / sn * 1e6, "µs"),
    }
    ok = ld <= 1.5 * lh + 50e-6 * ln and sh < sd / 5
    summary = (f"launch-bound host {lh / ln * 1e6:.0f} µs vs device {ld / ln * 1e6:.0f} µs; "
               f"20 ms kernel host {sh / sn * 1e6:.0f} µs vs device {sd / sn * 1e3:.1f} ms")
    return Check("host_vs_device", "pass" if ok else "fail", summary, figures)


def check_no_sync(rig: Rig, *, quick: bool = False) -> Check:
    """A call queuing ~100 ms of device work returns to the caller in far less at 100% sampling.

    Pass: host return time under a fifth of the reference device time, and perfmon's device time
    within 10% of it.
    """
    mon = quiet_monitor(rig, sample_rate=1.0, warmup_calls=1)
    try:
        model = mon.wrap(rig.work(100.0), name="no_sync", device=rig.device)
        x = rig.input()
        model(x)  # cold
        rig.synchronize()
        mon.flush(timeout=10)
        before, _ = device_seconds(mon, "no_sync")
        host: list[float] = []

        def call() -> None:
            t0 = time.perf_counter()
            model(x)
            host.append(time.perf_counter() - t0)

        truth = ref_ms(rig, call) / 1e3
        if not mon.flush(timeout=10):
            raise RuntimeError("perfmon did not resolve its samples within 10 s")
        device = device_seconds(mon, "no_sync")[0] - before
    finally:
        mon.stop()
    figures: dict[str, Figure] = {"host_return": (host[0] * 1e3, "ms"), "reference_device": (truth * 1e3, "ms"),
                                  "perfmon_device": (device * 1e3, "ms")}
    ok = host[0] < truth / 5 and math.isclose(device, truth, rel_tol=0.10)
    return Check("no_sync", "pass" if ok else "fail",
                 f"returned in {host[0] * 1e3:.2f} ms for {truth * 1e3:.1f} ms of device work "
                 f"(perfmon: {device * 1e3:.1f} ms)", figures)


def check_overhead(rig: Rig, *, quick: bool = False) -> Check:
    """perfmon's cost on a small half-precision Transformer forward at 1% and 100% sampling.

    One module, so memory placement cannot differ between variants: each block of ``n`` calls runs it
    bare, or wrapped by the 1% or the 100% monitor (``wrap``/``unwrap`` between blocks), synchronized per
    block, in a shuffled order every round. The figure is the median over rounds of each round's ratio
    to that round's bare block, so drifting clocks cancel. Pass: ≤ 1.03 at 1%, ≤ 1.10 at 100%.
    """
    if not rig.real:
        return Check("overhead", "skip", "needs a real GPU")
    import random

    dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    model = encoder(dtype)
    x = torch.randn(8, 128, 512, device="cuda", dtype=dtype)
    monitors = {f"{rate:.0%}": quiet_monitor(rig, sample_rate=rate, warmup_calls=3) for rate in (0.01, 1.0)}
    rounds, n = (8, 20) if quick else (60, 40)
    # "bare again" is the same bare module in its own slot: its ratio to "bare" is the noise floor.
    times: dict[str, list[float]] = {"bare": [], "bare again": [], **{k: [] for k in monitors}}
    order = list(times)
    shuffle = random.Random(0).shuffle

    def block(key: str) -> float:
        wrapped = monitors[key].wrap(model, name=f"enc_{key}", device="cuda:0") if key in monitors else model
        try:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                wrapped(x)
            torch.cuda.synchronize()
            return (time.perf_counter() - t0) / n
        finally:
            if key in monitors:
                monitors[key].unwrap(wrapped)

    try:
        with torch.inference_mode():
            for key in order:  # warm-up: cuBLAS handles, kernels selected, each monitor's cold calls
                block(key)
            for _ in range(rounds):
                shuffle(order)
                for key in order:
                    times[key].append(block(key))
    finally:
        for mon in monitors.values():
            mon.stop()
    others = [k for k in times if k != "bare"]
    ratio = {k: statistics.median(t / b for t, b in zip(times[k], times["bare"], strict=True)) for k in others}
    bare = statistics.median(times["bare"])
    added = {k: statistics.median(t - b for t, b in zip(times[k], times["bare"], strict=True)) for k in others}
    r1, r100 = ratio["1%"], ratio["100%"]
    figures: dict[str, Figure] = {"bare_per_call": (bare * 1e3, "ms"), "ratio_1pct": (r1, "1"),
                                  "ratio_100pct": (r100, "1"), "added_1pct": (added["1%"] * 1e6, "µs"),
                                  "added_100pct": (added["100%"] * 1e6, "µs"),
                                  "ratio_bare_again": (ratio["bare again"], "1"),
                                  "added_bare_again": (added["bare again"] * 1e6, "µs"), "rounds": (rounds, ""),
                                  "calls_per_block": (n, ""), "dtype": (str(dtype).removeprefix("torch."), "")}
    ok = r1 <= 1.03 and r100 <= 1.10
    return Check("overhead", "pass" if ok else "fail",
                 f"{bare * 1e3:.2f} ms/call bare; x{r1:.3f} ({added['1%'] * 1e6:+.1f} µs) at 1%, "
                 f"x{r100:.3f} ({added['100%'] * 1e6:+.1f} µs) at 100%; bare vs bare x{ratio['bare again']:.3f} "
                 f"({added['bare again'] * 1e6:+.1f} µs, the noise floor)", figures)
