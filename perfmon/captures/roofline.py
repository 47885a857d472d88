"""What bounds a capture's ops: FLOPs, bytes, arithmetic intensity and a roofline verdict.

FLOPs come from torch.profiler's ``with_flops`` (matmuls, convolutions, and one per element for
elementwise arithmetic; other ops report 0). Bytes are an estimate: the sizes of the op's tensor
inputs from ``record_shapes`` and their dtypes (outputs and re-reads are not counted), so intensity
is an upper bound. The verdict compares intensity with the device's ridge point (peak FLOP/s over
peak bytes/s):

* ``launch-bound``  the op's mean time per call is under 10 µs: launch and dispatch overhead dominate;
* ``compute-bound`` intensity at or above the ridge point;
* ``memory-bound``  below it;
* ``unknown peak``  no peaks for this device (CPUs, unknown GPUs): perfmon does not invent one.

Peaks come from a small table of common GPUs by name (dense tensor-core peaks for 16-bit types,
CUDA-core peaks for 32-bit), or from ``peak_flops``/``peak_bandwidth`` settings, which win.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .trace_summary import input_bytes, tensor_dtypes

__all__ = ["GPU_PEAKS", "LAUNCH_BOUND_SECONDS", "Peaks", "aggregate", "device_peaks", "peaks_for",
           "summarise"]

LAUNCH_BOUND_SECONDS = 10e-6

#: name fragment -> (16-bit tensor FLOP/s, 32-bit FLOP/s, memory bytes/s); vendor datasheets, dense.
GPU_PEAKS: dict[str, tuple[float, float, float]] = {
    "H200": (989e12, 67e12, 4.8e12),
    "H100 PCIe": (756e12, 51e12, 2.0e12),
    "H100": (989e12, 67e12, 3.35e12),
    "A100-SXM4-80GB": (312e12, 19.5e12, 2.039e12),
    "A100-PCIE-40GB": (312e12, 19.5e12, 1.555e12),
    "A100": (312e12, 19.5e12, 1.935e12),
    "L40S": (362e12, 91.6e12, 0.864e12),
    "L4": (121e12, 30.3e12, 0.3e12),
    "A10": (125e12, 31.2e12, 0.6e12),
    "T4": (65e12, 8.1e12, 0.32e12),
    "V100": (125e12, 15.7e12, 0.9e12),
}

_HALF = {"c10::Half", "c10::BFloat16", "c10::Float8_e4m3fn", "c10::Float8_e5m2"}


@dataclass(frozen=True)
class Peaks:
    """A device's peaks: FLOP/s for 16-bit and 32-bit math, memory bytes/s, and where they came from."""

    flops_16bit: float
    flops_32bit: float
    bandwidth: float
    source: str

    def flops(self, dtypes: Iterable[str]) -> float:
        return self.flops_16bit if any(d in _HALF for d in dtypes) else self.flops_32bit


def peaks_for(device_name: str | None, *, peak_flops: float | None = None,
              peak_bandwidth: float | None = None) -> Peaks | None:
    """The settings' peaks when both are given, else the table's for this GPU name, else None."""
    if peak_flops and peak_bandwidth:
        return Peaks(peak_flops, peak_flops, peak_bandwidth, "settings (peak_flops, peak_bandwidth)")
    if not device_name:
        return None
    for fragment in sorted(GPU_PEAKS, key=len, reverse=True):  # the most specific name first
        if fragment.lower() in device_name.lower():
            f16, f32, bw = GPU_PEAKS[fragment]
            return Peaks(f16, f32, bw, f"table: {fragment} (perfmon.captures.roofline.GPU_PEAKS)")
    return None


def device_peaks(device: str, *, peak_flops: float | None = None, peak_bandwidth: float | None = None) -> Peaks | None:
    """Peaks for a capture's roofline on ``device`` ("cuda:0", "cpu"): the settings', else the GPU table's."""
    import torch  # here, not at the top: the CLI reads roofline tables without torch's import time

    name = None
    if device.startswith("cuda") and torch.cuda.is_available():
        try:
            name = torch.cuda.get_device_name(int(device.partition(":")[2] or 0))
        except Exception:
            name = None
    return peaks_for(name, peak_flops=peak_flops, peak_bandwidth=peak_bandwidth)


def aggregate(events: Iterable[Any]) -> list[dict[str, Any]]:
    """Rows per (op name, input shapes) from torch.profiler FunctionEvents (``prof.events()``).

    The same rows ``perfmon.captures.trace_summary`` computes from a Chrome trace in a child process (the
    exporter's path); kept for callers that hold FunctionEvents already, and to check one against
    the other. Times in seconds; ``dtypes`` lists the input dtype names seen.
    """
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for e in events:
        if getattr(e, "device_type", None) is not None and "CPU" not in str(e.device_type):
            continue  # kernels are attributed to their CPU op through self_device_time_total
        shapes = getattr(e, "input_shapes", None) or []
        key = (e.name, str(shapes) if shapes else "")
        row = rows.get(key)
        if row is None:
            row = rows[key] = {"name": e.name, "calls": 0, "cpu_time_total_seconds": 0.0,
                               "self_cpu_time_total_seconds": 0.0, "device_time_total_seconds": 0.0,
                               "self_device_time_total_seconds": 0.0, "input_shapes": [str(s) for s in shapes] or None,
                               "flops": 0, "input_bytes_estimate": 0, "dtypes": set()}
        row["calls"] += 1
        row["cpu_time_total_seconds"] += e.cpu_time_total / 1e6
        row["self_cpu_time_total_seconds"] += e.self_cpu_time_total / 1e6
        row["device_time_total_seconds"] += getattr(e, "device_time_total", 0) / 1e6
        row["self_device_time_total_seconds"] += getattr(e, "self_device_time_total", 0) / 1e6
        row["flops"] += int(getattr(e, "flops", 0) or 0)
        dtypes = getattr(e, "input_dtypes", None) or []
        row["input_bytes_estimate"] += input_bytes(shapes, dtypes)
        row["dtypes"].update(tensor_dtypes(dtypes))
    out = list(rows.values())
    for row in out:
        row["dtypes"] = sorted(row["dtypes"])
    return out


def summarise(rows: Iterable[Mapping[str, Any]], *, cuda: bool, peaks: Peaks | None, window_seconds: float | None,
              limit: int = 25) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Per-op rows (top ``limit`` by self device time on CUDA, else self CPU time) and window totals.

    ``rows`` come from ``aggregate`` or ``perfmon.captures.trace_summary``; times in seconds. Each output row
    gains achieved FLOP/s, arithmetic intensity and a verdict, and loses its ``dtypes``.
    """
    time_key = "self_device_time_total_seconds" if cuda else "self_cpu_time_total_seconds"
    total_flops = 0
    flop_dtypes: set[str] = set()
    out: list[dict[str, Any]] = []
    for src in rows:
        row = dict(src)
        dtypes = set(row.pop("dtypes", ()) or ())
        seconds = row[time_key]
        row["achieved_flops_per_second"] = row["flops"] / seconds if seconds > 0 and row["flops"] else None
        row["arithmetic_intensity"] = (row["flops"] / row["input_bytes_estimate"]
                                       if row["input_bytes_estimate"] else None)
        row["bound"] = _verdict(row, seconds, peaks, dtypes)
        total_flops += row["flops"]
        if row["flops"]:
            flop_dtypes |= dtypes
        out.append(row)
    ordered = sorted(out, key=lambda r: r[time_key], reverse=True)[:limit]
    totals: dict[str, Any] = {"flops": total_flops, "window_seconds": window_seconds,
                              "achieved_flops_per_second": (total_flops / window_seconds
                                                            if window_seconds and total_flops else None)}
    if peaks is not None:
        peak = peaks.flops(flop_dtypes)
        totals["peak_flops_per_second"] = peak
        totals["peak_bandwidth_bytes_per_second"] = peaks.bandwidth
        totals["peak_source"] = peaks.source
        if cuda and totals["achieved_flops_per_second"] is not None:
            # MFU-style: achieved over peak for the window, idle time between calls included (the
            # exporter passes the longer of the host's recording time and the device's busy span)
            totals["mfu_ratio"] = totals["achieved_flops_per_second"] / peak
    else:
        totals["peak_source"] = "unknown peak"
    return ordered, totals


def _verdict(row: Mapping[str, Any], seconds: float, peaks: Peaks | None, dtypes: set[str]) -> str:
    if row["calls"] and seconds / row["calls"] < LAUNCH_BOUND_SECONDS:
        return "launch-bound"
    if peaks is None:
        return "unknown peak"
    intensity = row["arithmetic_intensity"]
    if intensity is None:
        return "memory-bound" if not row["flops"] else "compute-bound"
    ridge = peaks.flops(dtypes) / peaks.bandwidth
    return "compute-bound" if intensity >= ridge else "memory-bound"
