"""A real streaming server: outcomes of TextIteratorStreamer responses, counted once, from /metrics.

tests/apps/stream_server.py runs under uvicorn in a subprocess: generate() in a thread with a
TextIteratorStreamer, a StreamingResponse over the streamer (mode=auto: perfmon's automatic tracking alone;
mode=both: also wrapped in monitor.stream(streamer, name=...)). 20 requests from real client threads
(http.client), 5 of which read 3 lines and close the socket: perfmon must count 15 ok and 5 cancelled, 20 in
all (never the same request twice). The truth is the clients' own view (lines received) and the app's
(bodies that reached their end or stopped early, streamers garbage-collected). Cancelled requests settle when
the abandoned streamer is collected after generate() finishes: polled with deadlines, never slept on.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import http as http_get
from .conftest import wait_until
from .prom import free_port, module_server
from .test_servers import _env

pytest.importorskip("transformers")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

ROOT = Path(__file__).resolve().parent.parent
CLIENTS = 5
PER_CLIENT = 4  # 20 requests; each client cancels one of its 4: 5 cancelled
READ_BEFORE_LEAVING = 3


class Server:
    def __init__(self, proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
        self.proc, self.port, self.log = proc, port, log

    def dump(self) -> str:
        """Every server thread's stack (faulthandler on SIGUSR1) and the log's tail, for a failure message."""
        if self.proc.poll() is None:
            size = self.log.stat().st_size
            self.proc.send_signal(signal.SIGUSR1)
            with contextlib.suppress(AssertionError):
                wait_until(lambda: self.log.stat().st_size > size, timeout=5, what="the stack dump")
        return self.log.read_text(errors="replace")[-12000:]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("stream_server")
    port = free_port()
    log = tmp / "server.log"
    with module_server("tests.apps.stream_server", port, cwd=ROOT, env=_env(tmp), log=log) as proc:
        yield Server(proc, port, log)


def request(port: int, mode: str, leave_early: bool) -> int:
    """One streamed response read line by line (all of it, or 3 lines and then the socket closed): lines read."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", f"/generate?mode={mode}")
        resp = conn.getresponse()
        assert resp.status == 200, resp.status
        lines = 0
        while True:
            line = resp.readline()
            if not line:
                return lines
            lines += 1
            if leave_early and lines == READ_BEFORE_LEAVING:
                resp.close()
                return lines
    finally:
        conn.close()


def truth(port: int, mode: str) -> dict[str, Any]:
    status, _, body = http_get(f"http://127.0.0.1:{port}/truth", timeout=5)
    assert status == 200
    data = json.loads(body)
    return {**data["truth"][mode], "new": data["new"]}


def requests_total(port: int, model: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    status, _, body = http_get(f"http://127.0.0.1:{port}/perfmon/metrics", timeout=10)
    assert status == 200, body[:300]
    out = {"ok": 0.0, "error": 0.0, "cancelled": 0.0}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            if s.name == "perfmon_generation_requests_total" and s.labels.get("model") == model:
                out[s.labels["outcome"]] = s.value
    return out


@pytest.mark.parametrize("mode", ["auto", "both"])
def test_stream_server_counts_ok_and_cancelled_once_each(server: Server, mode: str) -> None:
    """20 streamed requests, 5 left after 3 lines: perfmon counts 15 ok + 5 cancelled, 20 in all."""
    try:
        drive_and_check(server.port, mode)
    except BaseException as exc:
        raise AssertionError(f"{exc}\n--- server threads and log ---\n{server.dump()}") from exc


def drive_and_check(port: int, mode: str) -> None:
    deadline = time.monotonic() + 60
    results: list[tuple[bool, int]] = []
    errors: list[str] = []
    lock = threading.Lock()

    def client(index: int) -> None:
        for j in range(PER_CLIENT):
            leave = j == index % PER_CLIENT
            try:
                got = request(port, mode, leave)
            except BaseException as exc:  # reported below
                with lock:
                    errors.append(f"client {index} request {j} (leave={leave}): {exc!r}")
                return
            with lock:
                results.append((leave, got))

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(1.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "clients still running after the deadline"
    assert not errors, errors
    # The clients' view: 15 whole streams (the prompt, one line per token, the end), 5 left after 3 lines.
    new = truth(port, mode)["new"]
    assert sorted(results) == sorted([(False, new + 2)] * 15 + [(True, READ_BEFORE_LEAVING)] * 5), results

    # The app's view settles: every generate() finished and every response body ended (15 at the end, 5 early).
    def settled() -> dict[str, Any] | None:
        t = truth(port, mode)
        return t if t["generate_done"] + t["generate_failed"] == 20 and t["body_done"] + t["body_stopped"] == 20 \
            else None

    # A body the client left ends when its generator is closed, which for a generator left suspended in a cycle is
    # a collection away (a fresh clone's run on a loaded host waited 56 s once): once every generate() is done,
    # collect between polls (before, a collection a poll would only slow the generation down).
    def nudge() -> None:
        t = truth(port, mode)
        if t["generate_done"] + t["generate_failed"] == 20:
            http_get(f"http://127.0.0.1:{port}/gc", b"", method="POST")
        else:
            time.sleep(0.01)  # the poll's pace, as wait_until's own

    app = wait_until(settled, timeout=max(5.0, deadline - time.monotonic()), what=f"the app to settle ({mode})",
                     between=nudge)
    assert (app["body_done"], app["body_stopped"], app["generate_failed"]) == (15, 5, 0), app

    # perfmon: every request ends exactly once (polled: an abandoned streamer ends as it is collected).
    try:
        wait_until(lambda: sum(requests_total(port, mode).values()) >= 20,
                   timeout=max(5.0, deadline - time.monotonic()), what="perfmon to count 20 requests")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: perfmon {requests_total(port, mode)}, app {truth(port, mode)}") from None
    got = requests_total(port, mode)
    assert got == {"ok": 15.0, "error": 0.0, "cancelled": 5.0}, (got, truth(port, mode))


@pytest.mark.parametrize("mode", ["auto", "both"])
def test_stream_server_lets_every_streamer_go(server: Server, mode: str) -> None:
    """Once every generate() finished and every response ended, a full collection frees every streamer: nothing
    in perfmon keeps one alive (a leak per request; and a streamer never collected never ends as cancelled)."""
    try:
        if truth(server.port, mode)["started"] < 4:  # run alone: make a few requests of its own
            for leave in (False, True, False, True):
                request(server.port, mode, leave)

        def ended() -> dict[str, Any] | None:
            t = truth(server.port, mode)
            return t if (t["generate_done"] + t["generate_failed"] == t["started"]
                         and t["body_done"] + t["body_stopped"] == t["started"]) else None

        wait_until(ended, timeout=30, what=f"every {mode} request to end")

        def all_collected() -> dict[str, Any] | None:
            t = truth(server.port, mode)
            return t if t["streamers_collected"] == t["started"] else None

        try:
            wait_until(all_collected, timeout=5, what=f"every {mode} streamer collected",
                       between=lambda: http_get(f"http://127.0.0.1:{server.port}/gc", b"", method="POST"))
        except AssertionError as exc:
            _, _, body = http_get(f"http://127.0.0.1:{server.port}/gc", b"", method="POST")
            raise AssertionError(f"{exc}: app truth {truth(server.port, mode)}; after gc.collect() "
                                 f"{body.decode(errors='replace')}") from None
    except BaseException as exc:
        raise AssertionError(f"{exc}\n--- server threads and log ---\n{server.dump()}") from exc
