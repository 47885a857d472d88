"""Telemetry checks: the allocator gauges against ``torch.cuda.memory_stats()``, and NVML (device and this
process) against ``nvidia-smi``."""

from __future__ import annotations

import math
import shutil
import subprocess
import time
from typing import Any

import torch

from perfmon import Monitor

from .common import Check, Figure, quiet_monitor, total
from .rig import Rig

__all__ = ["check_allocator", "check_nvml"]


def check_allocator(rig: Rig, *, quick: bool = False) -> Check:
    """perfmon's allocator gauges vs ``torch.cuda.memory_stats()`` after allocating 256 MiB.

    Pass: allocated and reserved bytes equal torch's to within 1 MiB (nothing else allocates between).
    """
    if not rig.real:
        return Check("allocator", "skip", "needs a real GPU")
    mon = quiet_monitor(rig)
    try:
        block = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
        got_alloc = total(mon, "perfmon_torch_memory_allocated_bytes", device="cuda:0")
        got_res = total(mon, "perfmon_torch_memory_reserved_bytes", device="cuda:0")
        stats = torch.cuda.memory_stats(0)
        del block
    finally:
        mon.stop()
    want_alloc, want_res = stats["allocated_bytes.all.current"], stats["reserved_bytes.all.current"]
    figures: dict[str, Figure] = {"perfmon_allocated": (got_alloc, "bytes"), "torch_allocated": (want_alloc, "bytes"),
                                  "perfmon_reserved": (got_res, "bytes"), "torch_reserved": (want_res, "bytes")}
    ok = abs(got_alloc - want_alloc) <= 2**20 and abs(got_res - want_res) <= 2**20 and got_alloc >= 256 * 2**20
    return Check("allocator", "pass" if ok else "fail",
                 f"allocated {got_alloc / 2**20:.0f} MiB (torch {want_alloc / 2**20:.0f}), "
                 f"reserved {got_res / 2**20:.0f} MiB (torch {want_res / 2**20:.0f})", figures)


def _smi(field_: str) -> list[str] | None:
    """``nvidia-smi --query-gpu=FIELD`` per GPU, or None without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", f"--query-gpu={field_}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    return [line.strip() for line in out.splitlines() if line.strip()]


def check_nvml(rig: Rig, *, quick: bool = False) -> Check:
    """``perfmon_nvml_up`` is 1; total memory and power limit per GPU agree with ``nvidia-smi``.

    Pass: up, and (where nvidia-smi exists) each GPU's total memory within 1% and power limit within 1 W.
    """
    if not rig.real:
        return Check("nvml", "skip", "needs a real GPU")
    mon = quiet_monitor(rig, nvml=True)
    figures: dict[str, Figure] = {}
    bad: list[str] = []
    try:
        poller = mon.nvml_poller  # one poll now rather than waiting for the poller's interval
        if poller is not None:
            poller.poll()
        up = total(mon, "perfmon_nvml_up")
        smi_uuid, smi_mem, smi_power = _smi("uuid"), _smi("memory.total"), _smi("power.limit")
        figures["nvml_up"] = (up, "")
        if smi_uuid and smi_mem:
            for i, (uuid, mib) in enumerate(zip(smi_uuid, smi_mem, strict=False)):
                got = total(mon, "perfmon_gpu_memory_total_bytes", gpu=str(i), UUID=uuid)
                figures[f"gpu{i}.memory_total_perfmon"] = (got, "bytes")
                figures[f"gpu{i}.memory_total_smi"] = (float(mib) * 2**20, "bytes")
                if not math.isclose(got, float(mib) * 2**20, rel_tol=0.01):
                    bad.append(f"GPU {i} memory {got:g} B vs nvidia-smi {mib} MiB")
                if smi_power and i < len(smi_power) and smi_power[i].replace(".", "", 1).isdigit():
                    watts = total(mon, "perfmon_gpu_power_limit_watts", gpu=str(i))
                    figures[f"gpu{i}.power_limit_perfmon"] = (watts, "W")
                    figures[f"gpu{i}.power_limit_smi"] = (float(smi_power[i]), "W")
                    if abs(watts - float(smi_power[i])) > 1.0:
                        bad.append(f"GPU {i} power limit {watts:g} W vs nvidia-smi {smi_power[i]} W")
        bad += _process_share(mon, poller, figures)
    finally:
        mon.stop()
    if up != 1:
        return Check("nvml", "fail", f"perfmon_nvml_up is {up:g}", figures)
    if bad:
        return Check("nvml", "fail", "; ".join(bad), figures)
    tail = "agrees with nvidia-smi" if smi_uuid else "nvidia-smi not installed: not compared"
    share = figures.get("process_visible", (None, ""))[0]
    tail += ("; this process's memory and SM share read" if share == "yes" else
             "; this process is not in NVML's process list (PID namespace): its share is absent, as documented")
    return Check("nvml", "pass", f"perfmon_nvml_up 1; {tail}", figures)


def _smi_apps() -> dict[int, float] | None:
    """``nvidia-smi --query-compute-apps``: MiB used per PID, or None without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    apps: dict[int, float] = {}
    for line in out.splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip().isdigit() and mib.strip().replace(".", "", 1).isdigit():
            apps[int(pid)] = float(mib)
    return apps


def _process_share(mon: Monitor, poller: Any, figures: dict[str, Figure]) -> list[str]:
    """Hold 1 GiB and keep the SMs busy for about a second; compare this process's series with nvidia-smi.

    NVML reports host PIDs: in a container with its own PID namespace neither nvidia-smi nor perfmon finds
    this process, and perfmon leaves the series absent rather than guessing (not a failure).
    """
    import os

    bad: list[str] = []
    block = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    t_end = time.monotonic() + 1.5
    while time.monotonic() < t_end:  # about 1.5 s of matmuls, so NVML has utilization samples of ours
        for _ in range(20):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()
    if poller is not None:
        poller.poll()
    apps = _smi_apps()
    mem = total(mon, "perfmon_gpu_process_memory_used_bytes", gpu="0")
    present = any(s.name == "perfmon_gpu_process_memory_used_bytes" for f in mon.registry.collect()
                  for s in f.samples)
    util = total(mon, "perfmon_gpu_process_utilization_ratio", gpu="0")
    gpu_util = total(mon, "perfmon_gpu_utilization_ratio", gpu="0")
    smi_mib = None if apps is None else apps.get(os.getpid())
    figures["process_visible"] = ("yes" if present else "no", "")
    figures["process_memory_perfmon"] = (mem if present else None, "bytes")
    figures["process_memory_smi"] = (None if smi_mib is None else smi_mib * 2**20, "bytes")
    figures["process_memory_torch_reserved"] = (float(torch.cuda.memory_reserved(0)), "bytes")
    figures["process_sm_utilization"] = (util, "ratio")
    figures["gpu_utilization"] = (gpu_util, "ratio")
    figures["smi_compute_apps"] = (None if apps is None else len(apps), "")
    if smi_mib is not None and not present:
        bad.append(f"nvidia-smi lists this process ({smi_mib:g} MiB) but perfmon has no process series")
    if smi_mib is not None and present and not math.isclose(mem, smi_mib * 2**20, rel_tol=0.02, abs_tol=2**21):
        bad.append(f"process memory {mem / 2**20:.0f} MiB vs nvidia-smi {smi_mib:g} MiB")
    if present and mem < 2**30:
        bad.append(f"process memory {mem / 2**20:.0f} MiB while holding 1 GiB")
    del block, a
    return bad
