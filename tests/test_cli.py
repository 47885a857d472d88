"""The `perfmon` command line and the demo."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from perfmon.cli import main
from perfmon.demo import run_demo

from .conftest import wait_until

ROOT = Path(__file__).resolve().parents[1]


def test_demo_serves_metrics_while_running() -> None:
    """The demo drives a real model; while it runs /stats shows calls with cold and steady samples."""
    out = io.StringIO()
    result: dict[str, int] = {}
    t = threading.Thread(target=lambda: result.setdefault(
        "rc", run_demo(port=0, duration=8, rps=200, threads=2, out=out, install_signals=False,
                       log_level="error", sample_rate=0.2)))
    t.start()
    found = wait_until(lambda: re.search(r"stats:\s+(http://\S+)", out.getvalue()), what="the demo's URLs")
    url = found.group(1)

    def warmed_up() -> dict | None:
        s = json.loads(urllib.request.urlopen(url, timeout=5).read())
        lat = s["models"]["encoder"]["latency"]
        return s if lat.get("steady") and lat.get("cold", {}).get("duration", {}).get("count", 0) >= 4 else None

    stats = wait_until(warmed_up, what="cold and steady samples")
    t.join(60)
    assert result.get("rc") == 0
    enc = stats["models"]["encoder"]
    assert enc["calls"] >= 5 and enc["errors"] == {}
    assert enc["latency"]["steady"]["duration"]["p50_seconds"] > 0
    assert {"pipeline", "preprocess", "encoder"} <= set(stats["models"])
    assert "perfmon demo: stopped" in out.getvalue()


def test_cli_demo_stops_cleanly_on_sigterm() -> None:
    """`perfmon demo` exits 0 promptly on SIGTERM and printed its URLs."""
    env = {**os.environ, "PERFMON_LOG_LEVEL": "error"}
    with subprocess.Popen([sys.executable, "-m", "perfmon", "demo", "--port", "0", "--rps", "20"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT) as proc:
        try:
            line = ""
            deadline = time.monotonic() + 60
            while "stats:" not in line and time.monotonic() < deadline:
                line = proc.stdout.readline()  # type: ignore[union-attr]
                if not line and proc.poll() is not None:
                    break
            assert "stats:" in line, proc.stderr.read()  # type: ignore[union-attr]
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_cli_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    """A negative duration or port out of range is a usage error naming the option."""
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--duration", "-1"])
    assert exc.value.code == 2 and "--duration" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["demo", "--port", "70000"])
