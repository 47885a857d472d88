"""A real Prometheus server for tests: started by hand on 127.0.0.1 with a temp config."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest


def stop_process(proc: subprocess.Popen[Any]) -> None:
    """Terminate a child, then kill it if it has not exited within 10 s."""
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


@contextmanager
def module_server(module: str, port: int, *, cwd: Path, env: dict[str, str], log: Path,
                  timeout: float = 60.0) -> Iterator[subprocess.Popen[bytes]]:
    """``python -m module port`` as a child (stderr to ``log``), up once it answers ``/healthz`` with 200 within
    ``timeout`` seconds (an exit meanwhile fails with its log's tail); stopped on leaving."""
    import contextlib
    import sys

    from .conftest import http, wait_until

    with log.open("wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", module, str(port)], cwd=cwd, env=env,
                                stdout=subprocess.DEVNULL, stderr=err)
    try:
        def up() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"{module} exited {proc.returncode}: {log.read_text(errors='replace')[-3000:]}")
            with contextlib.suppress(OSError):
                return http(f"http://127.0.0.1:{port}/healthz", timeout=2)[0] == 200
            return False

        wait_until(up, timeout=timeout, what=f"{module} to answer /healthz")
        yield proc
    finally:
        stop_process(proc)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def query(self, promql: str) -> list[dict[str, Any]]:
        """Instant query; returns the result vector (raises on a PromQL error)."""
        qs = urllib.parse.urlencode({"query": promql})
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/query?{qs}", timeout=10) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise AssertionError(f"PromQL error for {promql!r}: {e.read().decode()[:500]}") from None
        assert body["status"] == "success", body
        return body["data"]["result"]  # type: ignore[no-any-return]

    def query_exemplars(self, promql: str, start: float, end: float) -> list[dict[str, Any]]:
        """/api/v1/query_exemplars over [start, end] (Unix seconds): series with their exemplars."""
        qs = urllib.parse.urlencode({"query": promql, "start": f"{start:.3f}", "end": f"{end:.3f}"})
        with urllib.request.urlopen(f"{self.url}/api/v1/query_exemplars?{qs}", timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"] or []  # type: ignore[no-any-return]

    def alerts(self) -> list[dict[str, Any]]:
        """/api/v1/alerts: every pending and firing alert, with its labels, annotations and state."""
        with urllib.request.urlopen(f"{self.url}/api/v1/alerts", timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]["alerts"]  # type: ignore[no-any-return]

    def wait_for(self, promql: str, timeout: float = 40.0) -> list[dict[str, Any]]:
        """Poll an instant query until it returns a non-empty vector, or fail at the deadline."""
        from .conftest import wait_until

        return wait_until(lambda: self.query(promql), timeout=timeout, what=f"data for {promql!r}")  # type: ignore[no-any-return]


@contextmanager
def running_prometheus(tmp: Path, targets: list[str], scrape_interval: str = "1s",
                       rule_files: list[str] | None = None, features: tuple[str, ...] = ()) -> Iterator[Prometheus]:
    """Start prometheus scraping ``targets`` (host:port), with ``--enable-feature`` flags; stop it afterwards."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus not installed (make test installs Debian's prometheus package when it can)")
    port = free_port()
    cfg = tmp / "prometheus.yml"
    cfg.write_text(
        "global:\n"
        f"  scrape_interval: {scrape_interval}\n"
        f"  evaluation_interval: {scrape_interval}\n"
        + (f"rule_files: {json.dumps(rule_files)}\n" if rule_files else "")
        + "scrape_configs:\n"
        "  - job_name: perfmon\n"
        "    static_configs:\n"
        f"      - targets: {json.dumps(targets)}\n"
    )
    log = (tmp / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [binary, f"--config.file={cfg}", f"--storage.tsdb.path={tmp / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", *(f"--enable-feature={f}" for f in features)],
        stdout=log, stderr=subprocess.STDOUT)
    prom = Prometheus(f"http://127.0.0.1:{port}")
    try:
        from .conftest import wait_until

        def ready() -> bool:
            if proc.poll() is not None:
                raise AssertionError("prometheus exited: " + (tmp / "prometheus.log").read_text()[-2000:])
            try:
                with urllib.request.urlopen(prom.url + "/-/ready", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        wait_until(ready, timeout=30, what="prometheus to become ready")
        yield prom
    finally:
        stop_process(proc)
        log.close()
