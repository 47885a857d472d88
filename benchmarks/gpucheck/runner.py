"""Running the checks, and the command line: ``python -m benchmarks.gpucheck --out DIR [--quick] [--only ...]``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from .agent_cost import check_agent_cost
from .captures import check_capture, check_roofline
from .common import Check, CheckFn
from .models import check_compile, check_generation
from .occupancy import check_occupancy
from .pools import check_event_pool, check_event_pool_default, check_graph_capture
from .report import build_report, environment
from .rig import Rig, TorchRig
from .telemetry import check_allocator, check_nvml
from .timing import check_host_vs_device, check_no_sync, check_overhead, check_timing_truth

__all__ = ["CHECKS", "EXIT_FAILED", "EXIT_NO_GPU", "EXIT_OK", "main", "run_checks"]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_NO_GPU = 3


#: Every check, timing first; each takes ``(rig, quick=...)``.
CHECKS: tuple[tuple[str, CheckFn], ...] = (
    ("timing_truth", check_timing_truth),
    ("host_vs_device", check_host_vs_device),
    ("no_sync", check_no_sync),
    ("overhead", check_overhead),
    ("agent_cost", check_agent_cost),
    ("event_pool", check_event_pool),
    ("event_pool_default", check_event_pool_default),
    ("graph_capture", check_graph_capture),
    ("allocator", check_allocator),
    ("nvml", check_nvml),
    ("capture", check_capture),
    ("roofline", check_roofline),
    ("occupancy", check_occupancy),
    ("compile", check_compile),
    ("generation", check_generation),
)


def run_checks(checks: Sequence[tuple[str, CheckFn]], rig: Rig, *, quick: bool = False,
               progress: Callable[[str], None] | None = None) -> list[Check]:
    """Run each check; an exception becomes that check's ``fail`` (never stops the others)."""
    out: list[Check] = []
    for name, fn in checks:
        t0 = time.perf_counter()
        try:
            result = fn(rig, quick=quick)
        except Exception as exc:
            result = Check(name, "fail", f"raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                           [:300])
        result = Check(result.name, result.verdict, result.summary, result.figures,
                       seconds=time.perf_counter() - t0)
        out.append(result)
        if progress is not None:
            progress(f"{result.verdict.upper():4} {name} ({result.seconds:.1f} s): {result.summary}")
    return out


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None, *, checks: Sequence[tuple[str, CheckFn]] = CHECKS,
         rig: Callable[[], Rig] = TorchRig, env: Callable[[], dict[str, Any]] = environment,
         cuda_available: Callable[[], bool] = torch.cuda.is_available) -> int:
    """Run the checks and write the report; returns the exit status (the package docstring).

    The keywords are what a test replaces (a fake rig, a fixed environment, a few checks, CUDA present or
    not): injected, not patched.
    """
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpucheck",
                                     description="perfmon's real-GPU check: one verdict per check, then the figures")
    parser.add_argument("--out", required=True, help="directory for gpucheck.md and gpucheck.json")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (about a minute)")
    parser.add_argument("--only", default="", help="comma-separated check names (default: all)")
    args = parser.parse_args(argv)
    if not cuda_available():
        print("gpucheck needs a CUDA GPU (torch.cuda.is_available() is False); nothing was run", file=sys.stderr)
        return EXIT_NO_GPU
    wanted = {n.strip() for n in args.only.split(",") if n.strip()}
    unknown = wanted - {n for n, _ in checks}
    if unknown:
        parser.error(f"unknown checks: {sorted(unknown)}")
    chosen = [(n, f) for n, f in checks if not wanted or n in wanted]
    results = run_checks(chosen, rig(), quick=args.quick, progress=_say)
    markdown, data = build_report(results, {**env(), "quick": args.quick})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpucheck.md").write_text(markdown, encoding="utf-8")
    (out / "gpucheck.json").write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(markdown)
    return EXIT_FAILED if data["verdict"] == "fail" else EXIT_OK
