"""Event-pool checks: many threads on several streams through a small and the default pool (every
pair returned, drops counted), and CUDA graph capture skipped."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from perfmon.testing import event_pairs_in_flight

from .common import Check, Figure, device_seconds, fmt, quiet_monitor, total
from .rig import Rig

__all__ = ["check_event_pool", "check_event_pool_default", "check_graph_capture"]


def check_event_pool(rig: Rig, *, quick: bool = False) -> Check:
    """Many threads on several streams through a small event pool: drops counted, every pair returned.

    Pass: every call counted, timed + dropped(pool_exhausted) == calls, and the pool is full again.
    """
    threads, streams, per_thread = 8, 3, (50 if quick else 200)
    mon = quiet_monitor(rig, sample_rate=1.0, warmup_calls=0, event_pool_size=16)
    errors: list[BaseException] = []
    try:
        model = mon.wrap(rig.work(0.05), name="pool", device=rig.device)
        x = rig.input()
        go = threading.Barrier(threads)

        def run(i: int) -> None:
            try:
                go.wait(timeout=30)
                with rig.stream(i % streams):
                    for _ in range(per_thread):
                        model(x)
            except BaseException as exc:  # reported below; a thread must not die silently
                errors.append(exc)

        pool = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join(timeout=120)
        rig.synchronize()
        resolved = mon.flush(timeout=10)
        calls = total(mon, "perfmon_forward_calls_total", model="pool")
        timed = device_seconds(mon, "pool")[1]
        dropped = total(mon, "perfmon_samples_dropped_total", model="pool", reason="pool_exhausted")
        # "In flight" after the drain is the leak this check looks for.
        in_flight = event_pairs_in_flight(mon)
    finally:
        mon.stop()
    want = threads * per_thread
    figures: dict[str, Figure] = {"calls": (calls, ""), "timed": (timed, ""), "dropped_pool_exhausted": (dropped, ""),
                                  "pairs_in_flight_after": (in_flight, ""), "threads": (threads, ""),
                                  "streams": (streams, "")}
    ok = not errors and resolved and calls == want and timed + dropped == want and in_flight == 0
    summary = (f"{want} calls from {threads} threads on {streams} streams: {timed:g} timed, {dropped:g} dropped, "
               f"{in_flight} pairs still in flight" + (f"; {errors[0]!r}" if errors else ""))
    return Check("event_pool", "pass" if ok else "fail", summary, figures)


def check_event_pool_default(rig: Rig, *, quick: bool = False) -> Check:
    """The default pool (256 pairs) at 1% and at 100% sampling under 8 threads: what fraction of samples drops.

    Pass: every call counted and every sample either timed or counted dropped; nothing left in flight.
    A figure, not a gate: the drop fraction at 100% (the pool is sized for production's 1-5%).
    """
    threads, streams, per_thread = 8, 3, (100 if quick else 500)
    figures: dict[str, Figure] = {}
    bad: list[str] = []
    for rate in (0.01, 1.0):
        mon = quiet_monitor(rig, sample_rate=rate, warmup_calls=0)
        try:
            model = mon.wrap(rig.work(0.05), name="pool", device=rig.device)
            x = rig.input()

            def run(i: int, model: Any = model, x: Any = x) -> None:
                with rig.stream(i % streams):
                    for _ in range(per_thread):
                        model(x)

            pool = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(threads)]
            t0 = time.perf_counter()
            for t in pool:
                t.start()
            for t in pool:
                t.join(timeout=120)
            wall = time.perf_counter() - t0
            rig.synchronize()
            mon.flush(timeout=10)
            calls = total(mon, "perfmon_forward_calls_total", model="pool")
            timed = device_seconds(mon, "pool")[1]
            dropped = total(mon, "perfmon_samples_dropped_total", model="pool")
            in_flight = event_pairs_in_flight(mon)
        finally:
            mon.stop()
        tag = f"{rate:.0%}"
        figures[f"{tag}.calls"] = (calls, "")
        figures[f"{tag}.timed"] = (timed, "")
        figures[f"{tag}.dropped"] = (dropped, "")
        figures[f"{tag}.calls_per_second"] = (calls / wall if wall else None, "1/s")
        if calls != threads * per_thread or in_flight:
            bad.append(f"{tag}: {calls:g} calls counted of {threads * per_thread}, {in_flight} pairs in flight")
    drop = figures["100%.dropped"][0]
    frac = drop / (drop + figures["100%.timed"][0]) if drop else 0.0  # type: ignore[operator]
    figures["100%.drop_fraction"] = (frac, "1")
    return Check("event_pool_default", "fail" if bad else "pass",
                 "; ".join(bad) or (f"1%: {figures['1%.timed'][0]:g} timed, {figures['1%.dropped'][0]:g} dropped; "
                                    f"100%: {frac:.0%} of samples dropped at "
                                    f"{fmt(figures['100%.calls_per_second'][0])} calls/s"), figures)


def check_graph_capture(rig: Rig, *, quick: bool = False) -> Check:
    """Capturing a CUDA graph through a wrapped model works; its sample is dropped as graph_capture."""
    mon = quiet_monitor(rig, sample_rate=1.0, warmup_calls=0)
    try:
        if rig.real:
            base: torch.nn.Module = torch.nn.Linear(16, 16).cuda()
            x: Any = torch.randn(4, 16, device="cuda")
        else:
            base, x = rig.work(0.1), rig.input()
        model = mon.wrap(base, name="graph", device=rig.device)
        same = rig.capture_graph(model, x)
        dropped = total(mon, "perfmon_samples_dropped_total", model="graph", reason="graph_capture")
    finally:
        mon.stop()
    ok = same and dropped >= 1
    return Check("graph_capture", "pass" if ok else "fail",
                 f"graph replay {'matches' if same else 'DIFFERS from'} eager; {dropped:g} sample(s) dropped "
                 "as graph_capture", {"dropped_graph_capture": (dropped, "")})
