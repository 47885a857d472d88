"""Captures under thread-per-request servers: the stdlib ``ThreadingHTTPServer`` and werkzeug's threaded server.

Each request runs on a new thread that ends after it, and a new thread often gets the ident of the one that
just ended. perfmon used to take that for the same thread, stop the profiler on another OS thread, and the
export segfaulted (exit 139, 3 of 3 runs). Here the app runs in a subprocess under load from client
threads; automatic captures (the baseline, then a regression) and manual ones over HTTP must all finish
with a valid trace, the process alive throughout and exiting cleanly.
"""

from __future__ import annotations

import gzip
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from .conftest import http, wait_until
from .test_servers import _env, _free_range, _server, _stop, _try

ROOT = Path(__file__).resolve().parent.parent


def _control(port: int, method: str, path: str, body: bytes | None = None) -> tuple[int, Any]:
    headers = {"X-Perfmon": "1"}
    if body is not None:
        headers["Content-Type"] = "application/json"
    status, _, data = http(f"http://127.0.0.1:{port}{path}", body, method=method, headers=headers, timeout=10)
    return status, data


def _profiles(port: int) -> list[dict[str, Any]]:
    status, data = _control(port, "GET", "/profiles")
    assert status == 200, data[:300]
    return json.loads(data)["profiles"]


def _finished(port: int, trigger: str, seen: set[str]) -> dict[str, Any] | None:
    """A capture of ``trigger`` not in ``seen`` that has finished (any outcome), or None."""
    for p in _profiles(port):
        if p["trigger"] == trigger and p["id"] not in seen and p.get("status") == "done":
            return p
    return None


def _accepted(port: int, body: bytes) -> tuple[int, bytes] | None:
    """POST /profile: the answer if 202; None on 409 (busy); anything else fails."""
    status, data = _control(port, "POST", "/profile", body)
    assert status in (202, 409), (status, data[:300])
    return (status, data) if status == 202 else None


def _valid_trace(port: int, capture_id: str) -> int:
    """The capture's trace, downloaded and parsed: returns how many events it holds (fails if invalid)."""
    status, data = _control(port, "GET", f"/profiles/{capture_id}/trace")
    assert status == 200, data[:300]
    trace = json.loads(gzip.decompress(data))
    events = trace["traceEvents"]
    assert any(e.get("name") == "aten::linear" for e in events), "the model's ops are in the trace"
    return len(events)


@pytest.mark.parametrize("kind", ["stdlib", "werkzeug"])
def test_captures_on_a_thread_per_request_server_finish_with_a_valid_trace(tmp_path: Path, kind: str) -> None:
    if kind == "werkzeug":
        pytest.importorskip("werkzeug")
    app_port, agent_port = _free_range(1), _free_range(1)
    env = _env(tmp_path, PERFMON_PORT=str(agent_port), PERFMON_PORT_RANGE="1")
    env.pop("PERFMON_REGRESSION")  # the app sets its own policy: short windows, automatic captures on
    cmd = [sys.executable, "-m", "tests.apps.thread_per_request", kind, str(app_port)]
    log = tmp_path / "server.log"
    stop = threading.Event()
    served = [0]

    def client() -> None:
        for _ in range(20_000):  # bounded, besides the stop event
            if stop.is_set():
                return
            if http(f"http://127.0.0.1:{app_port}/predict", timeout=10)[0] == 200:
                served[0] += 1

    with _server(cmd, env, log) as proc:
        wait_until(lambda: _try(f"http://127.0.0.1:{app_port}/predict"), timeout=60, what="the app to serve")
        clients = [threading.Thread(target=client, daemon=True) for _ in range(4)]
        for t in clients:
            t.start()
        try:
            alive = lambda: proc.poll() is None  # noqa: E731
            seen: set[str] = set()
            # The automatic baseline capture: learned within a few 1 s windows, then taken.
            base = wait_until(lambda: alive() and _finished(agent_port, "baseline", seen), timeout=90,
                              what="the automatic baseline capture", between=lambda: _dead(proc, log))
            seen.add(base["id"])
            done = [base]
            for _ in range(3):  # manual captures, one after the other
                # An automatic one may hold the slot (noise on a loaded box can look like a regression): a 409.
                _, data = wait_until(lambda: _accepted(agent_port, b'{"steps": 5, "max_seconds": 5}'),
                                          timeout=60, what="a manual capture accepted",
                                          between=lambda: _dead(proc, log))
                cid = json.loads(data)["id"]
                cap = wait_until(lambda cid=cid: alive() and next((p for p in _profiles(agent_port)
                                                                  if p["id"] == cid and p.get("status") == "done"),
                                                                 None),
                                 timeout=60, what=f"manual capture {cid}", between=lambda: _dead(proc, log))
                done.append(cap)
            # A regression: the model slows down; the detector arms an automatic capture.
            assert _control(app_port, "POST", "/slow")[0] == 200
            reg = wait_until(lambda: alive() and _finished(agent_port, "regression", seen), timeout=90,
                             what="the automatic regression capture", between=lambda: _dead(proc, log))
            done.append(reg)
            for cap in done:
                assert cap["outcome"] == "ok", cap
                # One request per thread: the capture ends with its thread (or within its steps).
                assert cap["ended_by"] in ("thread_ended", "steps"), cap
                assert cap["steps_recorded"] >= 1
                assert _valid_trace(agent_port, cap["id"]) > 10
            assert proc.poll() is None, "the server died"
            # A new capture is accepted (once any automatic one in flight is done): nothing was left recording.
            wait_until(lambda: _accepted(agent_port, b'{"steps": 2}'), timeout=60,
                       what="a new capture to be accepted", between=lambda: _dead(proc, log))
        finally:
            stop.set()
            for t in clients:
                t.join(timeout=15)
        assert served[0] > 0
    _stop(proc, signal.SIGTERM)
    stderr = log.read_text(errors="replace")
    assert proc.returncode in (0, -signal.SIGTERM), (proc.returncode, stderr[-3000:])
    for bad in ("Segmentation", "terminate called", "Aborted", "Traceback"):
        assert bad not in stderr, stderr[-3000:]


def _dead(proc: subprocess.Popen[bytes], log: Path) -> None:
    """Between polls: fail at once if the server died (with its log), else wait a little."""
    if proc.poll() is not None:
        raise AssertionError(f"the server died with exit code {proc.returncode}:\n"
                             f"{log.read_text(errors='replace')[-3000:]}")
    time.sleep(0.05)
