"""Documentation and public surface stay in step with the code."""

from __future__ import annotations

import re
import time
from pathlib import Path

import torch

import perfmon
from perfmon.captures.records import CaptureOptions
from perfmon.metrics.catalog import METRICS
from perfmon.testing import FakeCuda, FakeGpu, FakeNvml, FakeProfiler, FakeTorchMemory, GpuWork

from .conftest import wait_capture, wait_until

ROOT = Path(__file__).resolve().parents[1]


def _doc_rows() -> dict[str, tuple[str, str, tuple[str, ...]]]:
    rows = {}
    for line in (ROOT / "docs" / "metrics.md").read_text().splitlines():
        m = re.match(r"^\| `(perfmon_\w+)` \| (\w+) \| ([^|]+) \| ([^|]+) \|", line)
        if m:
            labels = tuple(re.findall(r"`(\w+)`", m.group(4)))
            rows[m.group(1)] = (m.group(2), m.group(3).strip(), labels)
    return rows


def test_metrics_doc_matches_declarations() -> None:
    """docs/metrics.md lists exactly the declared metrics, with their type, unit and labels."""
    declared = {name: (typ, unit or "—", labels) for name, (typ, unit, labels, _) in METRICS.items()}
    assert _doc_rows() == declared


def test_registry_exposes_exactly_the_documented_perfmon_metrics(make_monitor, tmp_path: Path) -> None:
    """Every perfmon_* family a live monitor exposes is documented, and every documented one is exposed."""
    policy = perfmon.RegressionPolicy(window_seconds=1, min_samples=1, baseline_windows=1)
    gpu = FakeGpu()
    mon = make_monitor(port=0, sample_rate=1.0, nvml=FakeNvml(), memory=FakeTorchMemory(), oom_snapshot=True,
                       trace_dir=str(tmp_path), regression=policy, cuda=FakeCuda(gpu),
                       trace_store="memory://perfmon-docs-test/fleet",  # the upload families
                       profiler_factory=FakeProfiler.factory(gpu),  # a CUDA capture: the occupancy families
                       peak_flops=1e12, peak_bandwidth=1e11).start()  # a peak: the MFU, MBU and peak families
    model = mon.wrap(torch.nn.Linear(2, 2), name="m")
    on_gpu = mon.wrap(GpuWork(gpu, ms=1.0), name="g", device="cuda:0")
    for _ in range(8):  # host time exists on CUDA only; 5 steady calls: the live host/device ratio
        on_gpu(torch.ones(1))
    mon.instrument(lambda x: x, name="tok", items=lambda args, kwargs: (3, 4))(1)  # padded items
    with mon.generation("m", prompt_tokens=3) as g:  # a request with a TTFT and an ITL: every generation family
        g.token()
        g.token()
    with mon.request() as span:  # a request span with a queue and model work: every request family
        span.enqueued()
        model(torch.ones(1, 2))
    gpu.finish()
    for _ in range(5):
        model(torch.ones(1, 2))
    mon.flush()
    mon.detector.tick(time.perf_counter_ns() + 3_000_000_000)  # close the window: a baseline exists
    # A baseline capture first, so that the manual one is compared with it (the comparison gauge has a sample).
    base = mon.captures.baseline(mon.models.pick("m"), CaptureOptions(steps=1), {"test": "docs"})
    assert base is not None
    model(torch.ones(1, 2))
    wait_capture(mon, base.id)
    cap = mon.capture("m", steps=1)
    model(torch.ones(1, 2))
    assert wait_capture(mon, cap["id"])["comparison"]["baseline"] == base.id
    gpu_cap = mon.capture("g", steps=1)  # the fake GPU's kernels: the occupancy families
    on_gpu(torch.ones(1))
    assert wait_capture(mon, gpu_cap["id"])["occupancy"]
    try:
        model(torch.ones(1, 3))
    except RuntimeError:
        pass
    mon.internal.report("test", RuntimeError("a fault, so the family has a sample"))
    mon.models.batch_tokens.add("m", 3, 1)  # a continuous-batching step (real ones: tests/test_continuous_batching.py)
    mon.nvml_poller.nvml.failing.add((1, "nvmlDeviceGetPowerUsage"))  # so the NVML error family has a sample
    mon.nvml_poller.poll()
    mon.flush()
    # m's signature counted (its own thread): the efficiency families have samples
    wait_until(lambda: mon.stats()["models"]["m"]["efficiency"].get("mfu_ratio") is not None, what="m's MFU")
    exposed = {}
    for metric in mon.registry.collect():
        if not (metric.name == "perfmon" or metric.name.startswith("perfmon_")):
            continue
        suffix = {"counter": "_total", "info": "_info"}.get(metric.type, "")
        name = metric.name + suffix
        labels = set()
        for s in metric.samples:
            labels |= set(s.labels) - {"le"}
        exposed[name] = (metric.type, labels)
    documented = {n: (t, set(labels)) for n, (t, _, labels) in _doc_rows().items()}
    assert exposed == documented


def test_public_surface_is_locked() -> None:
    """perfmon.__all__ is exactly the curated public names, without duplicates (ruff's RUF022 keeps it sorted)."""
    assert len(perfmon.__all__) == len(set(perfmon.__all__))
    assert set(perfmon.__all__) == {
        "DEFAULT_BUCKETS", "DEFAULT_HOST_BUCKETS", "DEFAULT_PORT", "CaptureBusy", "CaptureRateLimited", "Config",
        "ConfigError", "CudaBackend", "FINE_BUCKETS", "RegressionPolicy",
        "Monitor", "MonitoredFunction", "MonitoredModule", "PerfmonError", "PortUnavailable", "RequestBatch",
        "RequestMiddleware", "RequestSpan", "Span", "TimingEvent", "WSGIRequestMiddleware", "WrapError",
        "__version__", "log_buckets", "make_asgi_app", "make_wsgi_app",
    }
    for name in perfmon.__all__:
        assert hasattr(perfmon, name)


def test_readme_starts_with_the_two_commands() -> None:
    """README.md shows `make demo` and `make test` before anything else in a code block."""
    text = (ROOT / "README.md").read_text()
    first_block = text.split("```")[1]
    assert "make demo" in first_block and "make test" in first_block


def test_readme_lists_every_setting() -> None:
    """Every Config setting (a keyword argument and a PERFMON_ variable) is named in the README."""
    import dataclasses

    readme = (ROOT / "README.md").read_text()
    missing = [f.name for f in dataclasses.fields(perfmon.Config) if f.name != "extra" and f"`{f.name}`" not in readme]
    assert missing == []


def _holds_code(path: Path) -> bool:
    """Whether a module has any statement besides its docstring (an empty package marker has none)."""
    import ast

    body = ast.parse(path.read_text(encoding="utf-8")).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return bool(body)


def test_design_doc_names_every_module() -> None:
    """docs/design.md names every perfmon module by its path under perfmon/ (agent/resolver.py), bare or prefixed
    with perfmon/; only a package's __init__.py holding no code is exempt."""
    design = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    package = ROOT / "perfmon"
    missing = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        if path.name == "__init__.py" and not _holds_code(path):
            continue
        # `resolver.py` alone does not name agent/resolver.py, nor does `metrics/store.py` name a store.py.
        if not re.search(rf"(?<![\w./-])(?:perfmon/)?{re.escape(rel)}(?![\w/])", design):
            missing.append(rel)
    assert missing == [], f"modules docs/design.md does not name: {missing}"


def test_public_submodules_are_attributes_after_a_bare_import(tmp_path: Path) -> None:
    """`import perfmon` then `perfmon.testing.FakeCuda()` works as the README writes it, and the bare import loads no
    torch (a fresh interpreter: this one has imported perfmon.testing already)."""
    import os
    import subprocess
    import sys

    code = ("import sys, perfmon\n"
            "bare = 'torch' in sys.modules\n"
            "listed = 'testing' in dir(perfmon)\n"
            "perfmon.testing.FakeCuda(), perfmon.testing.FakeNvml(), perfmon.testing.FakeTorchMemory()\n"
            "print(bare, listed, perfmon.testing is sys.modules['perfmon.testing'])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.stdout.split() == ["False", "True", "True"], (done.stdout, done.stderr)
