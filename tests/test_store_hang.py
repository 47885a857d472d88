"""A trace store that accepts connections and never answers: every upload attempt ends by its deadline, counts
as failed and backs off, abandoned calls do not pile up, and the spool drains once the store answers again."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import fsspec
import pytest

from perfmon.store.files import new_id
from perfmon.store.remote import list_remote
from perfmon.store.traces import TraceStore
from perfmon.store.uploader import TraceUploader

from .conftest import HandClock, wait_until
from .stores import AWS_ENV, SilentServer, s3_server, save_capture

#: The configured timeout of these tests (seconds), and what a loaded 2-core box may add to an attempt.
TIMEOUT = 1.0
SLACK = 1.5


def test_an_s3_store_that_never_answers_fails_each_attempt_in_time_then_the_spool_drains(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """s3fs against an endpoint that accepts and never answers: each attempt is a failure within the timeout
    (before: the PUT never ended, uploads read ok=0 failed=0), its connection is closed, the capture stays
    spooled; a store answering on the same endpoint then gets it, listed, within seconds."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    silent = SilentServer()
    for k, v in {**AWS_ENV, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{silent.port}"}.items():
        monkeypatch.setenv(k, v)
    bucket = f"perfmon-hang-{new_id()[:12]}"
    store = TraceStore(tmp_path / "t", max_files=10, max_bytes=10**9)
    cid = save_capture(store)
    up = TraceUploader(store, f"s3://{bucket}/fleet", timeout_seconds=TIMEOUT, backoff_initial_seconds=0.05,
                       backoff_max_seconds=0.2, poll_seconds=0.2)
    try:
        started = time.monotonic()
        up.start()
        failed_at = []  # when each failed attempt was counted, read from the public counters
        for n in range(1, 4):
            wait_until(lambda n=n: up.stats.uploads["failed"] >= n, timeout=TIMEOUT + SLACK + 0.2,
                       what=f"failed attempt {n} counted within the timeout (a PUT that never ends counts nothing)")
            failed_at.append(time.monotonic())
        gaps = [b - a for a, b in zip([started, *failed_at], failed_at, strict=False)]
        # An attempt, plus at most the 0.2 s backoff before it: never the SDK's unbounded wait.
        assert all(TIMEOUT - 0.05 <= g <= TIMEOUT + 0.2 + SLACK for g in gaps), gaps
        assert up.stats.uploads["ok"] == 0 and up.stats.spool_files == 2
        assert up.last_error is not None and up.last_error.startswith("TimeoutError"), up.last_error
        # Abandoned attempts were cancelled, their connections closed: at most the one in flight is open.
        wait_until(lambda: silent.open_connections() <= 1, timeout=5, what="abandoned connections closed")

        # The store comes back on the same endpoint.
        port = silent.port
        silent.close()
        with s3_server(port):
            import s3fs

            s3fs.S3FileSystem(skip_instance_cache=True).mkdir(bucket)
            back = time.monotonic()
            wait_until(lambda: up.stats.spool_files == 0, timeout=30, what="the spool drained once the store answers")
            drained = time.monotonic() - back
            assert up.stats.uploads["ok"] == 1 and up.failures == 0
            assert [e["id"] for e in list_remote(f"s3://{bucket}/fleet")] == [cid]
            up.stop(TIMEOUT + SLACK)
        print(f"attempts against the silent store: {[round(g, 2) for g in gaps]} s; drained {drained:.2f} s after "
              "the store came back")
    finally:
        up.stop(TIMEOUT + SLACK)
        silent.close()


class HangingFs:
    """A synchronous store whose writes block until ``release`` is set (30 s at most, so no test hangs on it):
    a call that cannot be cancelled, only abandoned. ``blocked`` is how many are in it now."""

    def __init__(self) -> None:
        self.inner = fsspec.filesystem("memory")
        self.release = threading.Event()
        self.blocked = 0
        self.most_blocked = 0
        self._lock = threading.Lock()

    def pipe_file(self, path: str, data: bytes) -> None:
        with self._lock:
            self.blocked += 1
            self.most_blocked = max(self.most_blocked, self.blocked)
        try:
            if not self.release.wait(30):
                raise TimeoutError("never released")
            self.inner.pipe_file(path, data)
        finally:
            with self._lock:
                self.blocked -= 1


def _step_within(up: TraceUploader, limit: float) -> tuple[float, float]:
    """(step()'s return, seconds it took), failing if it is still running after ``limit`` seconds."""
    out: list[Any] = []
    t0 = time.monotonic()
    worker = threading.Thread(target=lambda: out.append(up.step()), daemon=True)
    worker.start()
    worker.join(limit)
    took = time.monotonic() - t0
    assert not worker.is_alive(), f"an upload attempt still running after {took:.1f} s"
    return out[0], took


def test_calls_that_cannot_be_cancelled_are_abandoned_and_bounded(tmp_path: Path) -> None:
    """A sync store whose writes never return: each attempt fails within the timeout; at most
    max_abandoned_calls of its calls are left running, later attempts fail at once without adding one;
    once the store answers, the capture goes up on the next attempt."""
    fs, root = HangingFs(), f"/perfmon-hang-{new_id()}"
    store = TraceStore(tmp_path / "t", max_files=10, max_bytes=10**9)
    cid = save_capture(store)
    clock = HandClock()
    up = TraceUploader(store, "memory://bucket/fleet", fs=fs, root=root, clock=clock, jitter=lambda: 1.0,
                       timeout_seconds=0.3, max_abandoned_calls=2)
    try:
        took = []
        for _ in range(5):
            delay, seconds = _step_within(up, limit=0.3 + SLACK + 5)
            took.append(seconds)
            clock.t += delay  # the backoff, on the uploader's own (hand) clock
        assert all(t <= 0.3 + SLACK for t in took), took
        assert up.stats.uploads == {"ok": 0, "failed": 5}
        assert fs.most_blocked == 2 and fs.blocked == 2  # the cap, never more: later attempts start nothing
        assert up.last_error is not None and "still running" in up.last_error
        fs.release.set()
        wait_until(lambda: fs.blocked == 0, timeout=10, what="the abandoned calls ended")
        delay, _ = _step_within(up, limit=0.3 + SLACK + 5)
        assert delay == 0.0 and up.stats.uploads["ok"] == 1 and up.stats.spool_files == 0
        assert [e["id"] for e in list_remote("memory://bucket/fleet", fs=fs.inner, root=root)] == [cid]
    finally:
        fs.release.set()
        if fs.inner.exists(root):
            fs.inner.rm(root, recursive=True)
