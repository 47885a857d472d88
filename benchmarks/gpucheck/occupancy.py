"""Occupancy check: the device-bound 8192³ bf16 matmul model (the roofline check's) reads occupancy near 1 and is
not host-bound; the launch-bound bf16 Transformer encoder (the overhead check's) reads low and is host-bound."""

from __future__ import annotations

import tempfile
from typing import Any

import torch

from perfmon import Monitor

from .captures import capture_calls
from .common import Check, Figure, MatMuls, encoder, fmt, quiet_monitor, total
from .rig import Rig

__all__ = ["check_occupancy"]


def _measure(mon: Monitor, rig: Rig, name: str, call: Any, *, live_calls: int, steps: int) -> dict[str, Any]:
    """Live calls (each alone on the device, as a served request), then a capture; the model's /stats verdict."""
    for _ in range(live_calls):
        call()
        rig.synchronize()  # the caller waits between requests, outside the monitored call
    if not mon.flush(timeout=10):
        raise RuntimeError("perfmon did not resolve its samples within 10 s")
    live = dict(mon.stats()["models"][name]["occupancy"])
    meta = capture_calls(mon, name, call, steps=steps)
    rig.synchronize()
    occ = dict(mon.stats()["models"][name]["occupancy"])
    return {"live": live, "after": occ, "capture": (meta or {}).get("occupancy") or {},
            "outcome": (meta or {}).get("outcome"),
            "host_bound_gauge": total(mon, "perfmon_model_host_bound", model=name),
            "occupancy_gauge": total(mon, "perfmon_model_occupancy_ratio", model=name)}


def check_occupancy(rig: Rig, *, quick: bool = False) -> Check:
    """Occupancy and the launch-bound verdict on real kernels, from a capture of each model and from live calls.

    Pass: the matmul model's capture occupancy ≥ 0.9, its live host/device ratio under 0.5 and host-bound 0 (both
    sources); the encoder's, on a decode-like 1x32x512 input (the smallest kernels: unambiguously launch-bound),
    capture occupancy under 0.5, live ratio ≥ 0.9 and host-bound 1 (both sources). The same encoder on the
    overhead check's 8x128x512 input is measured too, for the figures only.
    """
    if not rig.real:
        return Check("occupancy", "skip", "needs a real GPU")
    n = 4096 if quick else 8192
    dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    with tempfile.TemporaryDirectory(prefix="perfmon-gpucheck-") as tmp:
        mon = quiet_monitor(rig, trace_dir=tmp, sample_rate=1.0, warmup_calls=2)
        try:
            mm = mon.wrap(MatMuls(n), name="matmul")
            x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
            enc = mon.wrap(encoder(dtype), name="encoder")
            e_x = torch.randn(1, 32, 512, device="cuda", dtype=dtype)
            big = mon.wrap(encoder(dtype), name="encoder_8x128")
            b_x = torch.randn(8, 128, 512, device="cuda", dtype=dtype)
            with torch.inference_mode():
                dense = _measure(mon, rig, "matmul", lambda: mm(x), live_calls=10, steps=5)
                launch = _measure(mon, rig, "encoder", lambda: enc(e_x), live_calls=30, steps=5)
                served = _measure(mon, rig, "encoder_8x128", lambda: big(b_x), live_calls=30, steps=5)
        finally:
            mon.stop()
    figures: dict[str, Figure] = {"n": (n, "")}
    for label, got in (("matmul", dense), ("encoder", launch), ("encoder_8x128", served)):
        cap, live, after = got["capture"], got["live"], got["after"]
        figures.update({
            f"{label}.occupancy_capture": (cap.get("ratio"), "1"),
            f"{label}.busy_per_call": (_us(cap.get("busy_seconds_per_step")), "µs"),
            f"{label}.span_per_call": (_us(cap.get("span_seconds_per_step")), "µs"),
            f"{label}.host_per_call_in_capture": (_us(cap.get("host_seconds_per_step")), "µs"),
            f"{label}.kernels_per_call": (cap.get("kernels_per_step"), ""),
            f"{label}.host_device_ratio_live": (live.get("host_device_ratio"), "1"),
            f"{label}.host_bound_live": (live.get("host_bound"), ""),
            f"{label}.host_bound_capture": (after.get("host_bound"), ""),
            f"{label}.source_after_capture": (after.get("source"), ""),
            f"{label}.host_bound_gauge": (got["host_bound_gauge"], ""),
            f"{label}.occupancy_gauge": (got["occupancy_gauge"], "1"),
        })
    d_occ, l_occ = dense["capture"].get("ratio"), launch["capture"].get("ratio")
    d_ratio, l_ratio = dense["live"].get("host_device_ratio"), launch["live"].get("host_device_ratio")
    ok = (dense["outcome"] == "ok" and launch["outcome"] == "ok"
          and d_occ is not None and d_occ >= 0.9 and d_ratio is not None and d_ratio < 0.5
          and dense["live"].get("host_bound") is False and dense["after"].get("host_bound") is False
          and dense["after"].get("source") == "capture" and dense["host_bound_gauge"] == 0
          and l_occ is not None and l_occ < 0.5 and l_ratio is not None and l_ratio >= 0.9
          and launch["live"].get("host_bound") is True and launch["after"].get("host_bound") is True
          and launch["after"].get("source") == "capture" and launch["host_bound_gauge"] == 1)
    return Check("occupancy", "pass" if ok else "fail",
                 f"{n}^3 bf16 matmuls: occupancy {fmt(d_occ)} (capture), host/device {fmt(d_ratio)} (live), "
                 f"host-bound {dense['after'].get('host_bound')}; encoder 1x32x512: occupancy {fmt(l_occ)} "
                 f"({fmt(launch['capture'].get('kernels_per_step'))} kernels a call), host/device {fmt(l_ratio)}, "
                 f"host-bound {launch['after'].get('host_bound')}; at 8x128x512: occupancy "
                 f"{fmt(served['capture'].get('ratio'))}, host-bound {served['after'].get('host_bound')}", figures)


def _us(seconds: Any) -> float | None:
    return seconds * 1e6 if isinstance(seconds, (int, float)) else None
