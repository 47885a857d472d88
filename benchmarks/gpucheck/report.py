"""The report: Markdown and JSON from the checks' outcomes (pure), and the environment they ran on."""

from __future__ import annotations

import contextlib
import platform
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from perfmon import __version__

from .common import Check, fmt

__all__ = ["build_report", "environment"]


def _cell(text: str) -> str:
    """Markdown table cell text: pipes escaped, one line."""
    return text.replace("|", "\\|").replace("\n", " ")


def build_report(checks: Sequence[Check], env: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """(Markdown, JSON-ready dict) for ``checks`` run on ``env`` (device, driver, versions). Pure."""
    counts = {v: sum(c.verdict == v for c in checks) for v in ("pass", "fail", "skip")}
    overall = "fail" if counts["fail"] else "pass"
    data: dict[str, Any] = {
        "env": dict(env),
        "verdict": overall,
        "counts": counts,
        "checks": [{"name": c.name, "verdict": c.verdict, "summary": c.summary, "seconds": c.seconds,
                    "figures": {k: {"value": v, "unit": u} for k, (v, u) in c.figures.items()}} for c in checks],
    }
    lines = ["# perfmon real-GPU check", ""]
    lines += [f"- {k}: {_cell(str(v))}" for k, v in env.items()]
    lines += ["", f"**Overall: {overall}** — {counts['pass']} passed, {counts['fail']} failed, "
              f"{counts['skip']} skipped.", "", "| check | verdict | summary |", "| --- | --- | --- |"]
    lines += [f"| {c.name} | {c.verdict} | {_cell(c.summary)} |" for c in checks]
    lines += ["", "## Figures", ""]
    for c in checks:
        if not c.figures:
            continue
        lines += [f"### {c.name}", "", "| figure | value | unit |", "| --- | --- | --- |"]
        lines += [f"| {k} | {fmt(v)} | {u} |" for k, (v, u) in c.figures.items()]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n", data


def environment() -> dict[str, Any]:
    """Device name, driver, CUDA and library versions (what each figure was taken on)."""
    env: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "driver": None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "perfmon": __version__,
        "python": platform.python_version(),
        "taken_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    with contextlib.suppress(Exception):
        import pynvml

        pynvml.nvmlInit()
        try:
            driver = pynvml.nvmlSystemGetDriverVersion()
            env["driver"] = driver.decode() if isinstance(driver, bytes) else str(driver)
        finally:
            pynvml.nvmlShutdown()
    return env
