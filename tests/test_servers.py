"""perfmon inside real servers: gunicorn --preload (workers killed and respawned) and uvicorn --workers.

Each server runs as a subprocess on 127.0.0.1 with every wait bounded; what is checked is what users
hit: workers that exit cleanly (no hang, no abort) after a pre-fork start(), exact counts per worker,
a respawned worker with a port of its own, and a worker with no free port that still serves and times.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import http, wait_until

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="pre-fork servers need fork()")


def _free_range(n: int) -> int:
    """A base port with ``n`` consecutive free ports on 127.0.0.1."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base + n >= 65000:
            continue
        try:
            for p in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return base
    raise RuntimeError("no free port range")


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERFMON_")}
    # PYTHONFAULTHANDLER: a server that hangs is sent SIGABRT by _server and writes every thread's stack to its log.
    env.update(PYTHONPATH=str(ROOT), PERFMON_TRACE_DIR=str(tmp_path / "traces"), PERFMON_LOG_LEVEL="info",
               PERFMON_REGRESSION="off", PYTHONWARNINGS="ignore", PYTHONFAULTHANDLER="1")
    env.update(extra)
    return env


def _get_json(url: str) -> Any:
    status, _, body = http(url, timeout=5)
    assert status == 200, (url, status, body[:200])
    return json.loads(body)


def _calls(port: int) -> float:
    text = http(f"http://127.0.0.1:{port}/metrics", timeout=5)[2].decode()
    for line in text.splitlines():
        if line.startswith('perfmon_forward_calls_total{model="mlp",stage=""}'):
            return float(line.split()[-1])
    return 0.0


@contextlib.contextmanager
def _server(cmd: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A server subprocess with its stderr in ``log``; if the block fails, sent SIGABRT (with the environment's
    PYTHONFAULTHANDLER, every thread's stack goes to the log: where a hung start stood), killed, and its log
    printed."""
    with log.open("wb") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        yield proc
    except BaseException:
        if proc.poll() is None:
            proc.send_signal(signal.SIGABRT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        proc.kill()
        proc.wait(timeout=10)
        print(log.read_text(errors="replace")[-8000:])
        raise


def _stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 20.0) -> float:
    """Signal the server and wait (bounded) for it to exit; returns the seconds it took."""
    t0 = time.monotonic()
    proc.send_signal(sig)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
        raise AssertionError(f"server did not exit within {timeout} s of the signal") from None
    return time.monotonic() - t0


def _agents(ports: range) -> dict[int, int]:
    """pid -> port of every agent listening in ``ports``."""
    out = {}
    for port in ports:
        if _listening(port):
            try:
                out[int(_get_json(f"http://127.0.0.1:{port}/stats")["pid"])] = port
            except (OSError, AssertionError, ValueError):
                continue
    return out


def _booted(log: Path) -> list[int]:
    """Worker pids from gunicorn's "Booting worker with pid: N" lines."""
    return [int(line.rsplit(":", 1)[1]) for line in log.read_text(errors="replace").splitlines()
            if "Booting worker with pid:" in line]


def _events(stderr: str, name: str) -> list[dict[str, Any]]:
    """perfmon's JSON log events called ``name`` in a server's stderr."""
    out = []
    for line in stderr.splitlines():
        if line.startswith("{") and f'"{name}"' in line:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return [e for e in out if e.get("event") == name]


@pytest.mark.parametrize("worker_class", ["sync", "gthread"])
def test_gunicorn_preload_workers_count_exactly_respawn_and_exit_cleanly(tmp_path: Path, worker_class: str) -> None:
    """gunicorn --preload, 3 workers, a monitor started in the master: exact per-worker counts, a SIGKILLed
    worker respawned with its own port, and on SIGTERM every worker exits promptly with no hang or abort."""
    pytest.importorskip("gunicorn")  # the dev extras install it; a bare Python (the GPU machines) may not
    app_port = _free_range(1)
    base = _free_range(5)
    ports = range(base, base + 5)
    cmd = [sys.executable, "-m", "gunicorn", "--preload", "--no-control-socket", "-w", "3", "-k", worker_class,
           *(["--threads", "2"] if worker_class == "gthread" else []),  # threads turn sync into gthread
           "-b", f"127.0.0.1:{app_port}", "--graceful-timeout", "15", "--timeout", "60",
           "tests.apps.wsgi_model:app"]
    # Master + 3 workers + one respawn while the killed worker's port may still be held: 5 ports.
    env = _env(tmp_path, PERFMON_PORT=str(base), PERFMON_PORT_RANGE="5")
    log = tmp_path / "gunicorn.log"
    with _server(cmd, env, log) as proc:
        # Which process serves which agent port: every agent's /stats names its pid.
        agents = wait_until(lambda: a if len(a := _agents(ports)) == 4 else None, timeout=60,
                            what="the master's and three workers' agents")
        assert proc.pid in agents  # the master started one too (before the fork)
        workers = set(agents) - {proc.pid}
        # A worker's agent can answer before gunicorn's "Booting worker" line for it reaches the log (CI saw it).
        wait_until(lambda: set(_booted(log)) == workers, timeout=30, what="a boot line for each agent's worker")
        wait_until(lambda: _try(f"http://127.0.0.1:{app_port}/whoami"), timeout=30, what="gunicorn to serve")
        sent = 0
        for _ in range(60):
            assert _get_json(f"http://127.0.0.1:{app_port}/predict")["pid"] in workers
            sent += 1
        # Every call counted once, by the worker that served it; the master counts none.
        calls = {pid: _calls(port) for pid, port in agents.items()}
        assert calls[proc.pid] == 0 and sum(calls.values()) == sent
        # Kill one worker the hard way: gunicorn respawns it, and the new one gets a port of its own.
        victim = next(iter(workers))
        os.kill(victim, signal.SIGKILL)
        new = wait_until(lambda: set(_booted(log)) - workers or None, timeout=60, what="a respawned worker")
        (new_pid,) = new
        respawned = wait_until(lambda: (a := _agents(ports)).get(new_pid) and a, timeout=30,
                               what="the respawned worker's agent")
        assert victim not in respawned and set(respawned) == (workers - {victim}) | {new_pid, proc.pid}
        assert _get_json(f"http://127.0.0.1:{respawned[new_pid]}/healthz")["http"] == "listening"
        # Each worker prepares its profiler in the background after the fork (1-3 s, longer on a loaded
        # box): wait for the respawned one's too, or a prompt SIGTERM races it.
        wait_until(lambda: len(_events(log.read_text(errors="replace"), "profiler_ready")) >= 4, timeout=60,
                   what="every worker's profiler_ready, the respawned one's included")
    took = _stop(proc)
    stderr = log.read_text(errors="replace")
    assert proc.returncode == 0, stderr[-3000:]
    for bad in ("terminate called", "system_error", "Aborted", "WORKER TIMEOUT", "Traceback"):
        assert bad not in stderr, stderr[-3000:]
    # A worker that hung would be killed by the master at --graceful-timeout (15 s): well under that is prompt.
    assert took < 12, f"workers took {took:.1f} s to exit"
    # The master deferred the profiler to its workers; each worker prepared its own after the fork.
    assert _events(stderr, "profiler_prepare_deferred")
    assert len(_events(stderr, "profiler_ready")) >= 4  # three workers and the respawned one
    assert not _events(stderr, "fork_after_profiler")


def test_gunicorn_preload_workers_boot_before_their_profiler_is_ready_and_exit_on_sigterm(tmp_path: Path) -> None:
    """The fork hook runs inside os.fork(), before gunicorn sets up the worker (its signal handlers come later): the
    profiler's preparation there (1-8 s a worker here) delayed every worker's "Booting worker" line and made a
    SIGTERM meanwhile land in the master's copied handlers, which ignore it (SIGKILL at --graceful-timeout, 3 of 3).
    It now runs on a thread of its own: each worker boots first and says profiler_ready later, and a SIGTERM while
    the workers still prepare is obeyed at once (their exits wait for the preparation, bounded)."""
    pytest.importorskip("gunicorn")  # the dev extras install it; a bare Python (the GPU machines) may not
    app_port = _free_range(1)
    base = _free_range(3)
    cmd = [sys.executable, "-m", "gunicorn", "--preload", "--no-control-socket", "-w", "2", "-k", "sync",
           "-b", f"127.0.0.1:{app_port}", "--graceful-timeout", "30", "tests.apps.wsgi_model:app"]
    log = tmp_path / "gunicorn.log"
    # No FLOP counting: nothing in the master imports torch.profiler, so each worker's preparation imports it and
    # starts Kineto (~0.8 s here, as in an application that never imported it; 9 ms once the master had).
    env = _env(tmp_path, PERFMON_PORT=str(base), PERFMON_PORT_RANGE="3", PERFMON_COUNT_FLOPS="false")
    with _server(cmd, env, log) as proc:
        wait_until(lambda: len(_booted(log)) == 2, timeout=60, what="both workers' boot lines")
        took = _stop(proc, timeout=40)
    text = log.read_text(errors="replace")
    lines = text.splitlines()
    assert proc.returncode == 0, "\n".join(lines[-40:])
    # By their own stamps (the processes' lines reach the shared log out of order): the workers' agents started (the
    # master's first) before either profiler was ready. In the hook, each worker's was ready before it started.
    started = sorted(e["timestamp"] for e in _events(text, "started"))[1:]
    ready = sorted(e["timestamp"] for e in _events(text, "profiler_ready"))
    assert len(started) == 2 and len(ready) == 2 and max(started) < min(ready), "\n".join(lines[-40:])
    assert took < 15, f"workers took {took:.1f} s to exit (--graceful-timeout 30: ignored SIGTERMs wait it out)"
    for bad in ("terminate called", "system_error", "Aborted", "Traceback", "Segmentation"):
        assert bad not in "\n".join(lines), "\n".join(lines[-40:])


def _samples(port: int, model: str) -> dict[str, float]:
    """A model's forward calls (summed over its stages) and items, from an agent's /metrics."""
    text = http(f"http://127.0.0.1:{port}/metrics", timeout=5)[2].decode()
    out = {"calls": 0.0, "items": 0.0}
    for line in text.splitlines():
        if line.startswith(f'perfmon_forward_calls_total{{model="{model}",'):
            out["calls"] += float(line.split()[-1])
        elif line.startswith(f'perfmon_forward_items_total{{model="{model}"}}'):
            out["items"] = float(line.split()[-1])
    return out


def test_gunicorn_workers_forked_after_a_generate_warm_up_count_their_own_forwards_and_items(tmp_path: Path) -> None:
    """gunicorn --preload with a tiny GPT-2 warmed up in the master (cached and ``use_cache=False`` generate() calls):
    each worker's agent counts the forwards that worker ran and their rows, as its own forward hook counted them
    (before the fix a worker counted its items into the master's copies of the signatures: 6 for 36 rows)."""
    pytest.importorskip("gunicorn")  # the dev extras install it; a bare Python (the GPU machines) may not
    pytest.importorskip("transformers")
    app_port = _free_range(1)
    base = _free_range(3)
    cmd = [sys.executable, "-m", "gunicorn", "--preload", "--no-control-socket", "-w", "2", "-k", "sync",
           "-b", f"127.0.0.1:{app_port}", "--graceful-timeout", "15", "--timeout", "60",
           "tests.apps.generate_model:app"]
    env = _env(tmp_path, PERFMON_PORT=str(base), PERFMON_PORT_RANGE="3", PERFMON_COUNT_FLOPS="false",
               PERFMON_PREPARE_PROFILER="false")
    log = tmp_path / "gunicorn.log"
    with _server(cmd, env, log) as proc:
        wait_until(lambda: _try(f"http://127.0.0.1:{app_port}/perfmon/healthz"), timeout=90, what="gunicorn to serve")
        last: dict[int, dict[str, Any]] = {}
        for i in range(8):  # each worker's latest answer holds its totals (a sync worker serves one at a time)
            got = _get_json(f"http://127.0.0.1:{app_port}/generate" + ("?nocache" if i % 2 else ""))
            assert got["tokens"] == 5 + 6
            last[got["pid"]] = got
        assert proc.pid not in last and last
        for pid, got in last.items():
            port = int(got["url"].rsplit(":", 1)[1])
            assert got["forwards"] >= 6 and got["rows"] == 2 * got["forwards"]
            assert _samples(port, "gpt2") == {"calls": got["forwards"], "items": got["rows"]}, (pid, got)
    _stop(proc)
    stderr = log.read_text(errors="replace")
    assert proc.returncode == 0, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]


def test_gunicorn_worker_without_a_free_port_serves_times_and_says_so(tmp_path: Path) -> None:
    """A port range one short (the master took a port too): the last worker logs an error naming the range,
    serves and times its calls, and its mounted /healthz says the port is unbound."""
    pytest.importorskip("gunicorn")  # the dev extras install it; a bare Python (the GPU machines) may not
    app_port = _free_range(1)
    base = _free_range(2)
    cmd = [sys.executable, "-m", "gunicorn", "--preload", "--no-control-socket", "-w", "2", "-k", "sync",
           "-b", f"127.0.0.1:{app_port}", "--graceful-timeout", "15", "tests.apps.wsgi_model:app"]
    env = _env(tmp_path, PERFMON_PORT=str(base), PERFMON_PORT_RANGE="2", PERFMON_SAMPLE_RATE="1.0")
    log = tmp_path / "server.log"
    with _server(cmd, env, log) as proc:
        wait_until(lambda: _try(f"http://127.0.0.1:{app_port}/whoami"), timeout=60, what="gunicorn to serve")

        def portless() -> dict[str, Any] | None:
            # The kernel hands each connection to whichever sync worker accepts first, and on a loaded box
            # one worker can take hundreds in a row (a count of 200 once missed the other): poll until
            # the worker without a port has served a call, bounded by the deadline.
            who = _who_is(app_port, _get_json(f"http://127.0.0.1:{app_port}/predict")["pid"])
            return who if who["url"] is None else None

        unbound = wait_until(portless, timeout=90, what="the worker without a port to serve a call")
        assert unbound["health"]["http"] == "unbound" and f"{base}..{base + 1}" in unbound["health"]["error"]
        # Its calls are counted and timed: read its own mounted /stats until it has answered with them.
        stats = wait_until(lambda: _stats_of(app_port, unbound["pid"]), timeout=30, what="the worker's /stats")
        mlp = stats["models"]["mlp"]
        assert mlp["calls"] >= 1 and mlp["sampled"] == mlp["calls"]
    _stop(proc)
    stderr = log.read_text(errors="replace")
    assert proc.returncode == 0, stderr[-3000:]
    errors = _events(stderr, "port_unavailable")
    assert errors and errors[0]["level"] == "error" and errors[0]["port_range"] == f"{base}..{base + 1}"


def test_uvicorn_workers_start_even_when_the_port_is_taken(tmp_path: Path) -> None:
    """uvicorn --workers 2 with the example app and a one-port range: both workers serve; the one without
    a port reports it and keeps its routes; SIGTERM stops them all."""
    pytest.importorskip("uvicorn")
    pytest.importorskip("fastapi")
    app_port = _free_range(1)
    base = _free_range(1)
    cmd = [sys.executable, "-m", "uvicorn", "examples.server:app", "--host", "127.0.0.1", "--port", str(app_port),
           "--workers", "2", "--log-level", "warning"]
    env = _env(tmp_path, PERFMON_PORT=str(base), PERFMON_PORT_RANGE="1")
    log = tmp_path / "server.log"
    with _server(cmd, env, log) as proc:
        states: set[str] = set()
        wait_until(lambda: _try(f"http://127.0.0.1:{app_port}/perfmon/healthz"), timeout=90,
                   what="uvicorn to serve")

        def both_seen() -> bool:
            # Connections are spread over the workers only once both accept: the second may still be
            # importing torch when the first serves, so poll (bounded by the deadline), not a count.
            states.add(_get_json(f"http://127.0.0.1:{app_port}/perfmon/healthz")["http"])
            return states == {"listening", "unbound"}

        wait_until(both_seen, timeout=90, what="one worker listening and one unbound")
        assert states == {"listening", "unbound"}
        assert _listening(base)
    _stop(proc)
    stderr = log.read_text(errors="replace")
    assert "Traceback" not in stderr, stderr[-3000:]
    assert _events(stderr, "port_unavailable")


def _try(url: str) -> bool:
    try:
        return http(url, timeout=2)[0] == 200
    except OSError:
        return False


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def _who_is(app_port: int, pid: int) -> dict[str, Any]:
    """Ask /whoami until the worker with ``pid`` answers it (the kernel spreads connections unevenly:
    bounded by a deadline, not a count)."""
    who: dict[str, Any] = wait_until(
        lambda: w if (w := _get_json(f"http://127.0.0.1:{app_port}/whoami"))["pid"] == pid else None,
        timeout=60, what=f"worker {pid} to answer /whoami")
    return who


def _new_worker(app_port: int, old: set[int]) -> int | None:
    try:
        pid = int(_get_json(f"http://127.0.0.1:{app_port}/whoami")["pid"])
    except (OSError, AssertionError):
        return None
    return pid if pid not in old else None


def _stats_of(app_port: int, pid: int) -> dict[str, Any] | None:
    """The /perfmon/stats of worker ``pid`` once it shows calls (None if another worker answered)."""
    stats = _get_json(f"http://127.0.0.1:{app_port}/perfmon/stats")
    if stats.get("pid") == pid and stats["models"]["mlp"]["calls"] >= 1:
        return stats  # type: ignore[no-any-return]
    return None
