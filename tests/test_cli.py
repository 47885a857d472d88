"""The `perfmon` command line and the demos (encoder, streaming generation)."""

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


def test_demo_generate_serves_generation_metrics() -> None:
    """`demo --generate` streams requests to a random GPT-2: /metrics has requests, TTFT, ITL, prefill and decode."""
    pytest.importorskip("transformers")
    out = io.StringIO()
    stop = threading.Event()
    result: dict[str, int] = {}
    t = threading.Thread(target=lambda: result.setdefault(
        "rc", run_demo(port=0, duration=60, rps=20, threads=2, generate=True, out=out, install_signals=False,
                       stop=stop, log_level="error", sample_rate=0.2)))
    t.start()
    try:
        url = wait_until(lambda: re.search(r"metrics:\s+(http://\S+)", out.getvalue()), what="the demo's URLs").group(1)

        def sample(text: str, name: str) -> float:
            found = re.search(rf"^{re.escape(name)} (\S+)$", text, flags=re.M)
            return float(found.group(1)) if found else 0.0

        def generating() -> str | None:
            text = urllib.request.urlopen(url, timeout=5).read().decode()
            ok = sample(text, 'perfmon_generation_requests_total{model="decoder",outcome="ok"}')
            ttft = sample(text, 'perfmon_time_to_first_token_seconds_count{model="decoder"}')
            return text if ok >= 3 and ttft >= 3 else None

        text = wait_until(generating, timeout=60, what="finished generation requests")
    finally:
        stop.set()
        t.join(60)
    assert result.get("rc") == 0
    assert sample(text, 'perfmon_inter_token_latency_seconds_count{model="decoder"}') >= 3 * 7  # >= 8 tokens each
    assert sample(text, 'perfmon_generated_tokens_total{model="decoder"}') >= 3 * 8
    assert sample(text, 'perfmon_prompt_tokens_total{model="decoder"}') >= 3 * 4
    assert sample(text, 'perfmon_forward_calls_total{model="decoder",stage="prefill"}') >= 3
    assert sample(text, 'perfmon_forward_calls_total{model="decoder",stage="decode"}') >= 3 * 7
    assert re.search(r"decoder: \d+ ok / 0 error / \d+ cancelled requests, TTFT p50 [\d.]+ ms", out.getvalue())
    assert "perfmon demo: stopped" in out.getvalue()


def test_cli_demo_generate_without_transformers_says_how_to_install(monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Without transformers, `perfmon demo --generate` exits 1 naming the package to install, serving nothing."""
    monkeypatch.setitem(sys.modules, "transformers", None)  # what `import transformers` sees when it is absent
    assert main(["demo", "--generate", "--port", "0", "--duration", "1"]) == 1
    captured = capsys.readouterr()
    assert "pip install 'transformers>=4.45'" in captured.err and "metrics:" not in captured.out


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
    assert main(["demo", "--generate", "--slow-after", "5"]) == 2  # the simulated regression is the encoder's
    assert "--generate" in capsys.readouterr().err
