"""Shared fixtures: monitors that always stop, and metric readers."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import threading
from collections.abc import Callable, Iterator, Sequence
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


def cache_key(model: Any) -> str:
    """The keyword (and output field) a transformers model's forward takes its KV cache under, taken from the
    installed version, not from perfmon: ``cache`` from transformers 5.24, ``past_key_values`` before."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def kv_cache_of(kwargs: dict[str, Any]) -> Any:
    """The KV cache a forward hook saw (under either name: transformers 5.24 renamed ``past_key_values``)."""
    cache = kwargs.get("past_key_values")
    return cache if cache is not None else kwargs.get("cache")


def value(monitor: perfmon.Monitor, name: str, **labels: str) -> float | None:
    """One sample's value from the monitor's registry (``stage`` defaults to "": a model with one stage)."""
    from perfmon.metrics.catalog import METRICS

    family = next((f for f in (name, name.rsplit("_", 1)[0]) if f in METRICS), None)
    if family is not None and "stage" in METRICS[family][2] and family != "perfmon_internal_errors_total":
        labels.setdefault("stage", "")
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


class HandClock:
    """A monotonic clock (seconds) the test moves by hand: ``clock.t += 5``."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def assert_answered_in_time(took: Sequence[float], *, typical: float, worst: float = 1.0,
                            syn_retries: int = 0) -> None:
    """Probe/scrape latencies (seconds) from a test that floods the agent: the median under ``typical`` and
    every one under ``worst`` (default 1 s: kubelet's default probe timeout, and below the 1 s SYN retry
    that a dropped connection costs). The failures these tests guard against took seconds or were reset;
    one probe held ~0.5 s by the GIL among a dozen client threads on a 2-core CI box is not one of them.
    ``syn_retries``: that many probes may take one retransmitted SYN longer (``worst`` + 1 s), where the
    test churns the agent port's accept queue and a loaded box can let it fill."""
    ordered = sorted(took)
    assert ordered[len(ordered) // 2] < typical, ordered
    if syn_retries:
        assert ordered[-1 - syn_retries] < worst and ordered[-1] < worst + 1.0, ordered
    else:
        assert ordered[-1] < worst, ordered


def in_forked_child(body: Callable[[], dict[str, Any]], *, timeout: float = 60.0) -> dict[str, Any]:
    """Run ``body`` in an ``os.fork()`` child and return the dict it returned (sent back as JSON through a pipe).

    The child never returns into pytest (``os._exit``); the parent waits for it with ``timeout`` (SIGKILL past
    it) and asserts that it exited 0, with the child's report in the message.
    """
    import json
    import os
    import signal

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        code = 1
        try:
            os.close(r)
            os.write(w, json.dumps(body()).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    timer = threading.Timer(timeout, lambda: os.kill(pid, signal.SIGKILL))  # a hung child ends the read below
    timer.start()
    try:
        with os.fdopen(r) as f:
            child = json.loads(f.read() or "{}")
        _, status = os.waitpid(pid, 0)
    finally:
        timer.cancel()
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, (status, child)
    return child


def wait_until(predicate: Callable[[], Any], *, timeout: float = 30.0, what: str = "condition",
               between: Callable[[], Any] | None = None) -> Any:
    """Poll ``predicate`` until it returns something truthy (returned), failing after ``timeout`` seconds.

    ``between`` runs between polls (e.g. a model call that lets an armed capture start); without it the
    poll waits 10 ms. Every wait in the tests is bounded this way, never a bare sleep.
    """
    import time

    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        if between is not None:
            between()
        else:
            time.sleep(0.01)


def wait_capture(monitor: perfmon.Monitor, capture_id: str, *, drive: Callable[[], Any] | None = None,
                 timeout: float = 30.0) -> dict[str, Any]:
    """Wait until a capture has an outcome (calling ``drive`` between polls); returns its metadata."""
    return wait_until(lambda: (m := monitor.profile(capture_id)) is not None and m.get("outcome") and m,  # type: ignore[return-value]
                      timeout=timeout, what=f"capture {capture_id}", between=drive)


def http(url: str, body: bytes | None = None, *, method: str | None = None, headers: dict[str, str] | None = None,
         token: str | None = None, timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    """One real HTTP request: (status, lower-cased headers, body); HTTP errors are returned, not raised."""
    import urllib.error
    import urllib.request

    h = dict(headers or {})
    if token:
        h["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=body, method=method, headers=h)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


@contextlib.contextmanager
def churning(port: int, *, threads: int = 10, held: int = 15, per_second: float | None = None,
             also: Sequence[Callable[[threading.Event], None]] = ()) -> Iterator[threading.Event]:
    """Idle connections to ``port`` on 127.0.0.1, reopened as fast as they go (``threads`` threads, each
    keeping its newest ``held`` open), or at most ``per_second`` a thread, plus the ``also`` targets (given
    the stop event); all stopped and joined (bounded) when the block ends. Yields the stop event."""
    stop = threading.Event()

    def churn() -> None:
        mine: list[socket.socket] = []
        for _ in range(100_000):  # bounded, besides the stop event
            if stop.is_set():
                break
            with contextlib.suppress(OSError):
                mine.append(socket.create_connection(("127.0.0.1", port), timeout=1))
            if len(mine) > held:
                mine.pop(0).close()
            if per_second is not None:
                stop.wait(1.0 / per_second)  # pacing the load, not waiting for anything
        for s in mine:
            s.close()

    workers = [threading.Thread(target=churn) for _ in range(threads)]
    workers += [threading.Thread(target=target, args=(stop,)) for target in also]
    for t in workers:
        t.start()
    try:
        yield stop
    finally:
        stop.set()
        for t in workers:
            t.join(10)

