"""What every check shares: its outcome (``Check``), a quiet monitor on the rig, and reading figures back
from the monitor's registry or from a reference event pair."""

from __future__ import annotations

import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from prometheus_client import CollectorRegistry

from perfmon import Monitor

from .rig import Rig

__all__ = ["Check", "CheckFn", "Figure", "MatMuls", "Verdict", "device_seconds", "encoder", "fmt", "host_seconds",
           "quiet_monitor", "ref_ms", "total"]

Verdict = Literal["pass", "fail", "skip"]
Figure = tuple[Any, str]  # (value, unit); unit "" for a count, "1" for a ratio


@dataclass(frozen=True)
class Check:
    """One check's outcome: a verdict, a one-line summary and its figures as ``name -> (value, unit)``."""

    name: str
    verdict: Verdict
    summary: str
    figures: dict[str, Figure] = field(default_factory=dict)
    seconds: float = 0.0  # wall time the check took (filled in by the runner)


#: A check: ``(rig, *, quick=False) -> Check``.
CheckFn = Callable[..., Check]


def quiet_monitor(rig: Rig, trace_dir: str | None = None, **settings: Any) -> Monitor:
    """A quiet monitor on the rig's backend: no HTTP, no regression detector, NVML off unless asked."""
    settings.setdefault("port", None)
    settings.setdefault("log_format", "json")
    settings.setdefault("log_level", "error")
    settings.setdefault("nvml", False)
    settings.setdefault("prepare_profiler", False)
    settings.setdefault("trace_dir", trace_dir or tempfile.mkdtemp(prefix="perfmon-gpucheck-"))
    with warnings.catch_warnings():
        # sample_rate=1.0 warns that production uses 1-5%; here timing every call is the point.
        warnings.simplefilter("ignore")
        return Monitor(registry=CollectorRegistry(), cuda=rig.backend, regression=None, **settings)


def total(mon: Monitor, sample: str, **labels: str) -> float:
    """Sum of every sample named ``sample`` whose labels include ``labels`` (over phases, stages...)."""
    out = 0.0
    for family in mon.registry.collect():
        for s in family.samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                out += s.value
    return out


def device_seconds(mon: Monitor, model: str) -> tuple[float, float]:
    """(sum of device seconds, count) of a model's forward histogram over every phase."""
    return (total(mon, "perfmon_forward_duration_seconds_sum", model=model),
            total(mon, "perfmon_forward_duration_seconds_count", model=model))


def host_seconds(mon: Monitor, model: str) -> tuple[float, float]:
    """(sum of host seconds, count) of a model's host-time histogram over every phase."""
    return (total(mon, "perfmon_forward_host_duration_seconds_sum", model=model),
            total(mon, "perfmon_forward_host_duration_seconds_count", model=model))


def ref_ms(rig: Rig, call: Callable[[], Any]) -> float:
    """Device milliseconds of ``call`` by a reference event pair around it, after a device wait."""
    stream = rig.backend.current_stream(0)
    start, end = rig.backend.new_event(), rig.backend.new_event()
    start.record(stream)
    call()
    end.record(stream)
    rig.synchronize()
    return start.elapsed_time(end)


def fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "—" if value is None else str(value)


class MatMuls(torch.nn.Module):
    """Four back-to-back ``n``x``n`` bf16 matmuls on CUDA: a few big kernels, device-bound (the roofline and
    occupancy checks' model)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(n, n, device="cuda", dtype=torch.bfloat16) / n ** 0.5,
                                    requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(4):
            x = x @ self.w
        return x


def encoder(dtype: torch.dtype) -> torch.nn.Module:
    """A 4-layer Transformer encoder (d=512) on CUDA in ``dtype``: many small kernels, launch-bound at small
    inputs (the overhead and occupancy checks' model)."""
    layer = torch.nn.TransformerEncoderLayer(d_model=512, nhead=8, dim_feedforward=2048, batch_first=True)
    return torch.nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False).to("cuda", dtype).eval()
