"""Captures uploaded to a real S3-compatible server (moto's standalone server on 127.0.0.1) by two agent
processes, through a server outage and an agent restart: nothing lost, nothing duplicated, serving never waits."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from perfmon.cli import main

from .conftest import wait_until

pytest.importorskip("s3fs")
pytest.importorskip("moto")

ROOT = Path(__file__).resolve().parents[1]
BUCKET = "perfmon-fleet"


def _json_line(line: str) -> bool:
    try:
        json.loads(line)
        return True
    except ValueError:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Moto:
    """moto's S3 server in a subprocess, every request recorded to a file, so that a server killed and
    started again on the same port replays its state (moto itself keeps objects in memory only)."""

    def __init__(self, port: int, recording: Path) -> None:
        self.port, self.recording = port, recording
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, *, replay: bool = False, frozen: tuple[Agent, ...] = ()) -> None:
        """Start the server; with ``replay``, rebuild the state it had from the recording, with the ``frozen``
        agents stopped (SIGSTOP) meanwhile: requests served during a replay are not recorded, so an upload
        landing then would be missing after the next restart (moto's limit, not the uploader's)."""
        if replay:
            # A SIGKILL can tear the recording's last line: keep the whole ones.
            lines = self.recording.read_text().splitlines()
            self.recording.write_text("".join(line + "\n" for line in lines if _json_line(line)))
        env = {**os.environ, "MOTO_ENABLE_RECORDING": "1", "MOTO_RECORDER_FILEPATH": str(self.recording)}
        with open(self.recording.with_suffix(".log"), "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                                          str(self.port)], env=env, stdout=log, stderr=log)
        wait_until(self._up, timeout=30, what="moto's server")
        if replay:
            for agent in frozen:
                os.kill(agent.proc.pid, signal.SIGSTOP)
            try:
                urllib.request.urlopen(urllib.request.Request(f"{self.url}/moto-api/recorder/replay-recording",
                                                              method="POST", data=b""), timeout=60).read()
            finally:
                for agent in frozen:
                    os.kill(agent.proc.pid, signal.SIGCONT)

    def _up(self) -> bool:
        """Accepting connections (a TCP connect: an HTTP probe would be recorded and replayed)."""
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
            return True
        except OSError:
            return False

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()  # SIGKILL: no goodbye to in-flight requests
            self.proc.wait(10)
            self.proc = None


class Agent:
    """One serving process (tests/apps/upload_agent.py) answering JSON commands."""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.apps.upload_agent"], cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True)
        assert self._read()["ready"]

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # every command is bounded inside the agent (60 s at most)
        assert line, "the agent exited"
        out: dict[str, Any] = json.loads(line)
        return out

    def ask(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(Exception):
                self.ask(cmd="quit")
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()


@pytest.fixture
def fleet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Moto, Any]]:
    """A moto server with a bucket, the AWS variables pointing at it, and a factory of agents (all stopped after)."""
    moto = Moto(_free_port(), tmp_path / "moto-recording.jsonl")
    aws = {"AWS_ENDPOINT_URL": moto.url, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1"}
    for k, v in aws.items():
        monkeypatch.setenv(k, v)
    moto.start()
    import s3fs

    s3fs.S3FileSystem(skip_instance_cache=True).mkdir(BUCKET)
    agents: list[Agent] = []

    def agent(pod: str) -> Agent:
        env = {**os.environ, **aws, "POD_NAME": pod, "PERFMON_TRACE_DIR": str(tmp_path / pod / "traces"),
               "PERFMON_TRACE_STORE": f"s3://{BUCKET}/fleet", "PYTHONPATH": str(ROOT)}
        a = Agent(env)
        agents.append(a)
        return a

    try:
        yield moto, agent
    finally:
        for a in agents:
            a.close()
        moto.kill()


def _listed(capsys: pytest.CaptureFixture[str], *args: str) -> list[str]:
    """Capture ids that `perfmon profiles --store` prints."""
    capsys.readouterr()
    assert main(["profiles", "--store", f"s3://{BUCKET}/fleet", *args]) == 0
    captured = capsys.readouterr()
    assert "skipped" not in captured.err, captured.err  # every metadata object read (retried if need be)
    return [line.split()[0] for line in captured.out.splitlines()[1:] if line and line[0] != "n"]


def _drained(agent: Agent, *, frozen: Agent | None = None) -> None:
    """Wait until ``agent`` has uploaded its spool, with ``frozen`` stopped (SIGSTOP) meanwhile.

    One agent uploads at a time because moto's recorder (what lets the killed server come back with its
    objects) appends each request to its file through a buffered file, several writes for a large body:
    two large PUTs at once could interleave into one torn line that the next restart cannot replay. That
    would be moto's loss, not the uploader's. (A capture once went missing from this test's final
    listing under load; the likelier cause was the listing, which dropped a failed read silently, fixed
    in upload.list_remote. This guard removes the other possible cause.)"""
    if frozen is not None:
        os.kill(frozen.proc.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: agent.ask(cmd="stats")["spool_files"] == 0, timeout=60, what="the spool drained")
    finally:
        if frozen is not None:
            os.kill(frozen.proc.pid, signal.SIGCONT)


def _objects() -> list[str]:
    import s3fs

    return sorted(s3fs.S3FileSystem(skip_instance_cache=True).find(f"{BUCKET}/fleet"))


def test_two_agents_upload_through_an_outage_and_a_restart(fleet: tuple[Moto, Any], tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Two processes' captures are listed by the CLI; a server killed and restarted mid-run loses and
    duplicates nothing while model calls go on unstalled; a capture spooled by a stopped agent goes up
    from its next process."""
    moto, agent = fleet
    a, b = agent("pod-a"), agent("pod-b")
    ids = [a.ask(cmd="capture")]
    _drained(a)  # one agent uploads at a time: see _drained
    ids.append(b.ask(cmd="capture"))
    assert [c["outcome"] for c in ids] == ["ok", "ok"]
    expected = {c["id"] for c in ids}
    wait_until(lambda: set(_listed(capsys)) == expected, timeout=30, what="both agents' captures listed")
    assert set(_listed(capsys, "--host", "pod-a")) == {ids[0]["id"]}

    # The server dies (SIGKILL) as the next captures finish: their uploads fail and are retried.
    third = a.ask(cmd="capture")
    moto.kill()
    fourth = b.ask(cmd="capture")
    expected |= {third["id"], fourth["id"]}
    wait_until(lambda: b.ask(cmd="stats")["uploads"]["failed"] >= 1, timeout=30, what="a failed upload attempt")
    served = a.ask(cmd="serve", seconds=1.5)  # model calls while the uploads keep failing
    # Never waiting on the store: the p99 call is a model call's, and no call took anything like an SDK
    # timeout (the slowest can still be one preemption on a loaded 2-core box).
    assert served["calls"] > 100 and served["p99_seconds"] < 0.05 and served["max_seconds"] < 1.0, served

    moto.start(replay=True, frozen=(a, b))  # the same port, the state replayed: what went up before is there
    _drained(a, frozen=b)
    _drained(b)
    assert set(_listed(capsys)) == expected

    # A capture spooled while the store is down, by an agent that then stops, goes up from its next process.
    moto.kill()
    fifth = a.ask(cmd="capture")
    assert fifth["outcome"] == "ok", fifth
    # Its outcome is known before its files are handed to the uploader (under load, a stats read came between).
    wait_until(lambda: a.ask(cmd="stats")["spool_files"] == 2, timeout=30, what="the fifth capture spooled")
    a.close()
    moto.start(replay=True, frozen=(b,))
    a2 = agent("pod-a")  # same POD_NAME and trace_dir: the restarted pod with its volume
    expected.add(fifth["id"])
    wait_until(lambda: a2.ask(cmd="stats")["spool_files"] == 0, timeout=60, what="the restarted agent's upload")

    listed = _listed(capsys)
    if sorted(listed) != sorted(expected):  # say what is where: the store's objects, each agent's counters
        raise AssertionError(f"listed {sorted(listed)} expected {sorted(expected)}; ids {ids}, third "
                             f"{third['id']}, fourth {fourth['id']}, fifth {fifth['id']}; objects {_objects()}; "
                             f"a2 {a2.ask(cmd='stats')}; b {b.ask(cmd='stats')}")
    assert len(listed) == len(set(listed)) == 5
    objects = _objects()
    metas = [o for o in objects if o.endswith(".meta.json")]
    traces = [o for o in objects if o.endswith(".pt.trace.json.gz")]
    assert len(metas) == len(traces) == 5  # every listed capture has its trace; no copy under another key
    assert {m.rsplit("/", 1)[1][:22] for m in metas} == expected
    out = tmp_path / "download"
    capsys.readouterr()
    assert main(["profiles", "--store", f"s3://{BUCKET}/fleet", "--download", fifth["id"], "--out", str(out)]) == 0
    got = capsys.readouterr().out.split()
    assert len(got) == 2 and all(Path(p).stat().st_size > 0 for p in got)
    meta = json.loads(next(Path(p) for p in got if p.endswith(".meta.json")).read_text())
    assert meta["id"] == fifth["id"] and meta["host"] == "pod-a"
