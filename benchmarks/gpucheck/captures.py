"""Capture checks: a manual capture's trace holds CUDA kernels; a large matmul's roofline verdict and MFU."""

from __future__ import annotations

import gzip
import math
import re
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from perfmon import Monitor

from .common import Check, Figure, MatMuls, fmt, quiet_monitor, ref_ms
from .rig import Rig

__all__ = ["capture_calls", "check_capture", "check_roofline", "live_efficiency"]

_KERNEL = re.compile(rb'"cat"\s*:\s*"kernel"')


def capture_calls(mon: Monitor, name: str, call: Callable[[], Any], *, steps: int) -> dict[str, Any] | None:
    """A manual capture of ``steps`` calls of model ``name``, made by ``call`` on this thread; its metadata."""
    cap = mon.capture(name, steps=steps, max_seconds=10.0)
    deadline = time.monotonic() + 90
    meta: dict[str, Any] | None = None
    while time.monotonic() < deadline:
        for _ in range(steps):  # back to back: the capture records the model's next calls on this thread
            call()
        meta = mon.profile(cap["id"])
        if meta is not None and meta.get("outcome"):
            return meta
        time.sleep(0.01)  # the export runs in a child process: poll, bounded by the deadline
    return meta


def live_efficiency(mon: Monitor, name: str, timeout_seconds: float = 60.0) -> dict[str, Any] | None:
    """Model ``name``'s live efficiency (/stats) once its samples are resolved and its signature counted, or None."""
    mon.flush()
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        eff = mon.stats()["models"][name].get("efficiency") or {}
        waiting = any(why.startswith("not counted yet") for why in eff.get("unknown") or {})
        if eff.get("flops_per_call") is not None or (eff.get("unknown") and not waiting):
            return eff  # counted, or unknown for good (the reasons say why)
        time.sleep(0.05)  # the count runs on perfmon's counting thread: poll, bounded by the deadline
    return None


def check_capture(rig: Rig, *, quick: bool = False) -> Check:
    """A manual capture of a CUDA model: outcome ok and the stored trace holds CUDA kernel events."""
    if not rig.real:
        return Check("capture", "skip", "needs a real GPU")
    with tempfile.TemporaryDirectory(prefix="perfmon-gpucheck-") as tmp:
        mon = quiet_monitor(rig, trace_dir=tmp)
        try:
            mlp = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
            model = mon.wrap(mlp.cuda(), name="mlp")
            x = torch.randn(32, 256, device="cuda")
            model(x)
            meta = capture_calls(mon, "mlp", lambda: model(x), steps=3)
            outcome = None if meta is None else meta.get("outcome")
            trace = mon.traces.read_trace(meta["id"]) if meta is not None and outcome == "ok" else None
        finally:
            mon.stop()
    kernels = len(_KERNEL.findall(gzip.decompress(trace[1]))) if trace else 0
    figures: dict[str, Figure] = {"kernel_events": (kernels, ""), "trace_bytes_gz": (len(trace[1]) if trace else 0,
                                                                                      "bytes")}
    try:
        import hta  # type: ignore[import-not-found]  # noqa: F401  # Holistic Trace Analysis, optional
        hta_note = "; HTA installed but not exercised"
    except ImportError:
        hta_note = "; Holistic Trace Analysis not installed: not loaded there"
    ok = outcome == "ok" and kernels > 0
    return Check("capture", "pass" if ok else "fail",
                 f"capture outcome {outcome!r}; {kernels} CUDA kernel events in the trace{hta_note}", figures)


def check_roofline(rig: Rig, *, quick: bool = False) -> Check:
    """A capture of back-to-back large bf16 matmuls: the matmul's verdict, the capture's MFU and the live one.

    Pass: the matmul op is ``compute-bound``, the capture has a peak from perfmon's table (named in the
    figures), its MFU agrees within 25% with one computed here from event-timed device time (the
    capture's window also holds host gaps, so it may read lower, never above 1), and the live MFU
    (``perfmon_model_mfu_ratio``: the signature's counted FLOPs, 4 x 2n^3 exactly, over perfmon's event-timed
    samples of the warm-up calls) is within 10% of the capture's.
    """
    if not rig.real:
        return Check("roofline", "skip", "needs a real GPU")
    n = 4096 if quick else 8192
    with tempfile.TemporaryDirectory(prefix="perfmon-gpucheck-") as tmp:
        mon = quiet_monitor(rig, trace_dir=tmp, sample_rate=1.0, warmup_calls=0)
        try:
            model = mon.wrap(MatMuls(n), name="matmul")
            x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
            ref = min(ref_ms(rig, lambda: model(x)) for _ in range(5))  # warm (cuBLAS heuristics) and timed
            live = live_efficiency(mon, "matmul")  # perfmon's own: its counted FLOPs over its event-timed samples
            meta = capture_calls(mon, "matmul", lambda: model(x), steps=5)
            rig.synchronize()
        finally:
            mon.stop()
    summary = (meta or {}).get("summary") or []
    compute = (meta or {}).get("compute") or {}
    mm = next((r for r in summary if r.get("name") in ("aten::mm", "aten::matmul", "aten::addmm")), None)
    flops_per_call = 4 * 2 * n ** 3
    peak = compute.get("peak_flops_per_second")
    events_mfu = flops_per_call / (ref / 1e3) / peak if peak else None
    capture_mfu = compute.get("mfu_ratio")
    live_mfu = (live or {}).get("mfu_ratio")
    figures: dict[str, Figure] = {
        "n": (n, ""), "matmul_bound": (None if mm is None else mm.get("bound"), ""),
        "matmul_achieved": (None if mm is None else mm.get("achieved_flops_per_second"), "FLOP/s"),
        "events_achieved": (flops_per_call / (ref / 1e3), "FLOP/s"), "peak": (peak, "FLOP/s"),
        "peak_source": (compute.get("peak_source"), ""), "mfu_capture": (capture_mfu, "1"),
        "mfu_events": (events_mfu, "1"), "outcome": ((meta or {}).get("outcome"), ""),
        "mfu_live": (live_mfu, "1"), "live_flops_per_call": ((live or {}).get("flops_per_call"), "FLOP"),
        "live_peak_source": ((live or {}).get("peak_source"), ""),
    }
    op_rate = None if mm is None else mm.get("achieved_flops_per_second")
    # The op's own rate (its kernels' time) must match event timing; the window MFU also counts the
    # profiler's start and stop and any host gap, so it may only read lower.
    ok = (mm is not None and mm.get("bound") == "compute-bound" and peak is not None and capture_mfu is not None
          and events_mfu is not None and op_rate is not None
          and math.isclose(op_rate, flops_per_call / (ref / 1e3), rel_tol=0.15)
          and 0 < capture_mfu <= min(events_mfu, 1.0) * 1.05
          # Live MFU (issue #26): the signature's counted FLOPs are the shapes' exactly, and the live ratio over the
          # sampled calls' device time is within 10% of the capture's.
          and (live or {}).get("flops_per_call") == flops_per_call and live_mfu is not None
          and math.isclose(live_mfu, capture_mfu, rel_tol=0.10))
    if mm is None:
        return Check("roofline", "fail", f"no matmul row in the capture's summary (outcome "
                                         f"{(meta or {}).get('outcome')!r})", figures)
    return Check("roofline", "pass" if ok else "fail",
                 f"{n}^3 bf16 matmul {mm.get('bound')} at {fmt(op_rate and op_rate / 1e12)} TFLOP/s in the "
                 f"capture, {fmt(flops_per_call / (ref / 1e3) / 1e12)} by events; window MFU {fmt(capture_mfu)}, "
                 f"{fmt(events_mfu)} by events, live {fmt(live_mfu)} (perfmon_model_mfu_ratio), against "
                 f"{compute.get('peak_source')} peak {fmt(peak and peak / 1e12)} TFLOP/s", figures)
