"""Shared fixtures: monitors that always stop, and metric readers."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

import perfmon


@pytest.fixture
def make_monitor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., perfmon.Monitor]]:
    """Build monitors (no HTTP unless asked, logs to JSON) and stop them all afterwards."""
    made: list[perfmon.Monitor] = []

    def make(**kw: Any) -> perfmon.Monitor:
        kw.setdefault("port", None)
        kw.setdefault("log_format", "json")
        kw.setdefault("log_level", "error")
        kw.setdefault("registry", CollectorRegistry())
        # Opt-in per test: no background detector, no profiler warm-up, traces under pytest's tmp.
        kw.setdefault("regression", None)
        kw.setdefault("prepare_profiler", False)
        kw.setdefault("trace_dir", str(tmp_path_factory.mktemp("traces")))
        m = perfmon.Monitor(**kw)
        made.append(m)
        return m

    yield make
    for m in made:
        m.stop()


def value(monitor: perfmon.Monitor, name: str, **labels: str) -> float | None:
    """One sample's value from the monitor's registry."""
    return monitor.registry.get_sample_value(name, labels)


def hist_count(monitor: perfmon.Monitor, model: str, phase: str, device: str = "cpu",
               name: str = "perfmon_forward_duration_seconds") -> float:
    v = value(monitor, f"{name}_count", model=model, phase=phase, device=device)
    return 0.0 if v is None else v


def buckets(monitor: perfmon.Monitor, model: str, phase: str, device: str = "cpu") -> list[tuple[float, float]]:
    """Cumulative (le, count) pairs of the duration histogram."""
    out = []
    for metric in monitor.registry.collect():
        if metric.name != "perfmon_forward_duration_seconds":
            continue
        for s in metric.samples:
            if (s.name.endswith("_bucket") and s.labels.get("model") == model
                    and s.labels.get("phase") == phase and s.labels.get("device") == device):
                out.append((float(s.labels["le"]), s.value))
    return out


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool not installed (make test installs Debian's prometheus package when it can)")
    return path


def promtool_check(text: bytes) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([promtool(), "check", "metrics"], input=text, capture_output=True, timeout=60)
