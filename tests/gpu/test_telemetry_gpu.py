"""Real GPU telemetry against what nvidia-smi and torch report. Skipped without CUDA."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

from perfmon.telemetry.memory import TorchMemory
from perfmon.telemetry.nvml import normalize_uuid

from ..conftest import value

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _smi(field: str) -> list[str]:
    if shutil.which("nvidia-smi") is None:
        pytest.skip("nvidia-smi not installed")
    out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    return [line.strip() for line in out.splitlines() if line.strip()]


def test_torch_memory_series_follow_allocations(make_monitor) -> None:
    """Allocating 256 MiB raises allocated and reserved bytes by at least that, labelled with torch's UUID."""
    mon = make_monitor(nvml_interval_seconds=0.2).start()
    x = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    uuid = normalize_uuid(TorchMemory().uuid(0))
    samples = {s.labels["device"]: s for m in mon.registry.collect() if m.name == "perfmon_torch_memory_allocated_bytes"
               for s in m.samples}
    assert samples["cuda:0"].value >= 256 * 2**20
    assert samples["cuda:0"].labels["UUID"] == uuid
    assert samples["cuda:0"].labels["gpu"] != ""  # joined with NVML through the UUID
    del x


def test_nvml_readings_match_nvidia_smi(make_monitor) -> None:
    """Total memory, the UUID list and the power limit agree with nvidia-smi; this process shows up."""
    mon = make_monitor().start()
    torch.ones(1, device="cuda")  # this process now has a context on GPU 0
    mon.nvml_poller.poll()
    assert value(mon, "perfmon_nvml_up") == 1
    uuids = _smi("uuid")
    totals = _smi("memory.total")
    for index, (uuid, total_mib) in enumerate(zip(uuids, totals)):
        got = value(mon, "perfmon_gpu_memory_total_bytes", gpu=str(index), UUID=uuid)
        assert got == pytest.approx(float(total_mib) * 2**20, rel=0.01)
    own = [s for m in mon.registry.collect() if m.name == "perfmon_gpu_process_memory_used_bytes" for s in m.samples]
    assert own and max(s.value for s in own) > 0
