"""One-go real-GPU check: ``python -m benchmarks.gpucheck --out DIR [--quick]`` (or ``make gpu-check``).

perfmon's CUDA promises (device time from events without a sync, host vs device split, the event pool,
graph capture skipped, allocator and NVML telemetry, captures with kernels, generation) are unit-tested
on fakes. A GPU machine is lent rarely, for minutes, so this package measures them in one run and writes
``DIR/gpucheck.md`` (a table with one verdict line per check, then the figures) and ``DIR/gpucheck.json``
(the same, every figure with its unit, plus the device, driver, CUDA, torch and perfmon versions).

Exit status: 0 every check passed or was skipped; 1 a check failed; 2 bad arguments (argparse);
3 no CUDA device (nothing is written).

Each check is a function ``(Rig) -> Check``; the runner catches its exceptions, so a failing check never
stops the others. The device work goes through a ``Rig`` (a ``CudaBackend`` plus a way to queue known
device work and to wait for the device), so the checks' logic also runs on CPU against
``perfmon.testing.FakeCuda`` (tests/test_gpucheck.py). Only the stdlib, torch, prometheus_client,
pynvml and perfmon are used; perfmon itself needs structlog (see README, "Real GPU check").

This is a developer's measuring harness, not the agent, so it lives in benchmarks/, outside the installed
package: it calls ``torch.cuda.synchronize()`` to close its own reference event pairs and to wait for known
work, always outside the monitored calls, which are what it checks for never syncing. Its progress and
report go to the terminal with ``print`` (a command's output, as in perfmon's cli.py), not through
perfmon's logs.

    rig.py        the device: ``Rig`` (what the checks need of it) and ``TorchRig`` (torch.cuda, device 0)
    common.py     ``Check``, a quiet monitor on the rig, figures read back from its registry
    timing.py     timing truth, host vs device, no sync, overhead
    agent_cost.py the serving thread's cost with the monitor running (stopped / unwrapped / wrapped), generate()
    pools.py      the event pool (small and default) under threads and streams, CUDA graph capture
    telemetry.py  allocator gauges and NVML against torch and nvidia-smi
    captures.py   a capture's trace holds kernels; roofline verdict and MFU
    occupancy.py  occupancy and the launch-bound verdict: a device-bound matmul vs a launch-bound encoder
    models.py     torch.compile, generate() of a tiny GPT-2
    report.py     Markdown and JSON, the environment
    runner.py     ``CHECKS``, ``run_checks``, ``main`` (``__main__.py`` runs it)
"""

from __future__ import annotations

from .agent_cost import check_agent_cost
from .captures import check_capture, check_roofline
from .common import Check
from .models import check_compile, check_generation
from .occupancy import check_occupancy
from .pools import check_event_pool, check_event_pool_default, check_graph_capture
from .report import build_report, environment
from .rig import Rig, TorchRig
from .runner import CHECKS, EXIT_FAILED, EXIT_NO_GPU, EXIT_OK, main, run_checks
from .telemetry import check_allocator, check_nvml
from .timing import check_host_vs_device, check_no_sync, check_overhead, check_timing_truth

__all__ = [
    "CHECKS", "EXIT_FAILED", "EXIT_NO_GPU", "EXIT_OK", "Check", "Rig", "TorchRig", "build_report",
    "check_agent_cost", "check_allocator", "check_capture", "check_compile", "check_event_pool",
    "check_event_pool_default",
    "check_generation", "check_graph_capture", "check_host_vs_device", "check_no_sync", "check_nvml",
    "check_occupancy", "check_overhead", "check_roofline", "check_timing_truth", "environment", "main", "run_checks",
]
