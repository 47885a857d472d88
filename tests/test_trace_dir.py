"""The trace directory is not trusted: each attack another local user tried, reproduced against the store."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import perfmon
from perfmon.store.files import UnsafeTraceDir, new_id, open_private_dir, write_private
from perfmon.store.traces import TraceStore
from perfmon.telemetry.memory import OomSnapshotter

from .conftest import http, value, wait_capture

TOKEN = "s3cret-token-for-tests"
TRACE = "attackerhost_1.1700000000000000000.pt.trace.json.gz"  # matches the store's trace pattern


def _private(tmp_path: Path, name: str = "traces") -> Path:
    d = tmp_path / name
    d.mkdir(mode=0o700)
    return d


def _secret(tmp_path: Path) -> Path:
    secret = tmp_path / "root-only.txt"
    secret.write_bytes(b"TOP SECRET")
    secret.chmod(0o600)
    return secret


def _meta(capture_id: str, trace_file: str | None) -> bytes:
    return json.dumps({"id": capture_id, "status": "done", "outcome": "ok", "trace_file": trace_file,
                       "trace_bytes": 10}).encode()


def test_planted_symlinks_are_never_served(make_monitor, tmp_path: Path) -> None:
    """A meta file that is a link, and a trace name that is a link to a secret, answer 404 over HTTP."""
    secret = _secret(tmp_path)
    d = _private(tmp_path)
    outside = tmp_path / "outside.meta.json"
    linked_id, planted_id = new_id(), new_id()
    outside.write_bytes(_meta(linked_id, TRACE))
    (d / f"{linked_id}.meta.json").symlink_to(outside)
    (d / f"{planted_id}.meta.json").write_bytes(_meta(planted_id, TRACE))
    (d / TRACE).symlink_to(secret)
    mon = make_monitor(trace_dir=str(d), port=0, token=TOKEN).start()
    assert mon.traces.get(linked_id) is None and mon.profile(linked_id) is None
    assert mon.traces.trace_path(planted_id) is None and mon.traces.read_trace(planted_id) is None
    for cid in (linked_id, planted_id):
        status, _, body = http(mon.url + f"/profiles/{cid}/trace", token=TOKEN)
        assert status == 404 and b"TOP SECRET" not in body, (cid, status, body)
    assert secret.read_bytes() == b"TOP SECRET"


def test_planted_symlinks_at_write_names_leave_their_targets_untouched(tmp_path: Path) -> None:
    """Links planted at the temp and final names of a write are replaced, never written through."""
    secret = _secret(tmp_path)
    d = _private(tmp_path)
    cid = new_id()
    for name in (f".{cid}.meta.json.tmp", f"{cid}.meta.json", ".snap.pickle.tmp", "snap.pickle"):
        (d / name).symlink_to(secret)  # the old writer's predictable temp names, and the final names
    store = TraceStore(d, max_files=5, max_bytes=10**9)
    store.save({"id": cid, "status": "done", "outcome": "failed"}, None, None)
    write_private(d, "snap.pickle", b"snapshot")
    assert secret.read_bytes() == b"TOP SECRET"
    assert not (d / f"{cid}.meta.json").is_symlink() and store.get(cid)["outcome"] == "failed"
    assert not (d / "snap.pickle").is_symlink() and (d / "snap.pickle").read_bytes() == b"snapshot"
    assert oct((d / "snap.pickle").stat().st_mode & 0o777) == oct(0o600)


def test_retention_deletes_only_files_the_store_made(tmp_path: Path) -> None:
    """Retention never deletes a file a planted meta names unless it is the store's own regular trace file."""
    if os.geteuid() != 0:
        pytest.skip("planting a file owned by another user needs root (chown)")
    d = _private(tmp_path)
    secret = _secret(d)  # inside the directory: a name without the trace pattern
    snapshot = d / "host_1.1700000000000000000.oom_snapshot.pickle"
    snapshot.write_bytes(b"snap")
    foreign = d / TRACE
    foreign.write_bytes(b"another user's file")
    os.chown(foreign, 65534, 65534)
    victim = tmp_path / "victim.pt.trace.json.gz"
    victim.write_bytes(b"victim")
    link = d / "linkhost_1.1700000000000000001.pt.trace.json.gz"
    link.symlink_to(victim)
    old = [f"{i:016x}000000" for i in range(1, 5)]  # ids older than any new_id()
    for cid, name in zip(old, [secret.name, snapshot.name, TRACE, link.name]):
        (d / f"{cid}.meta.json").write_bytes(_meta(cid, name))
    store = TraceStore(d, max_files=1, max_bytes=10**9)
    store.save({"id": new_id(), "status": "done", "outcome": "failed"}, None, None)
    assert secret.read_bytes() == b"TOP SECRET" and snapshot.read_bytes() == b"snap"
    assert foreign.read_bytes() == b"another user's file" and victim.read_bytes() == b"victim"
    assert [m["id"] for m in store.list()] == [p.name[:22] for p in d.glob("*.meta.json")]  # old metas went
    assert len(store.list()) == 1


def _refused(mon: perfmon.Monitor, what: str) -> Any:
    """Wrap a model, check its capture is refused with ``what`` in the error and counted, and that it runs."""
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(1, 4)
    want = lin(x)
    model = mon.wrap(lin, name="m")
    with pytest.raises(UnsafeTraceDir, match=what):
        mon.capture("m", steps=1)
    assert value(mon, "perfmon_captures_total", model="m", trigger="manual", outcome="failed") == 1
    assert value(mon, "perfmon_internal_errors_total", stage="trace_store") >= 1
    assert torch.equal(model(x), want)
    assert mon.profiles() == []
    return model


def test_world_writable_dir_is_refused_not_trusted(make_monitor, tmp_path: Path) -> None:
    """A 0777 trace_dir: start() works, captures are refused (HTTP 400 with the reason), planted files unseen."""
    d = _private(tmp_path, "shared")
    d.chmod(0o777)
    cid = new_id()
    (d / f"{cid}.meta.json").write_bytes(_meta(cid, None))
    mon = make_monitor(trace_dir=str(d), port=0, token=TOKEN).start()
    _refused(mon, "writable by group or others")
    status, _, body = http(mon.url + "/profile", b'{"model": "m"}', method="POST", token=TOKEN,
                           headers={"Content-Type": "application/json"})
    assert status == 400 and "writable by group or others" in json.loads(body)["error"]
    assert mon.traces.get(cid) is None
    assert d.stat().st_mode & 0o777 == 0o777  # refused, not silently repaired


def test_symlinked_dir_is_refused(make_monitor, tmp_path: Path) -> None:
    """A trace_dir that is a symbolic link is refused; nothing is written where it points."""
    real = _private(tmp_path, "real")
    link = tmp_path / "link"
    link.symlink_to(real)
    mon = make_monitor(trace_dir=str(link)).start()
    _refused(mon, "symbolic link")
    with pytest.raises(UnsafeTraceDir):
        write_private(link, "x.pickle", b"x")
    assert list(real.iterdir()) == []


def test_dir_owned_by_another_user_is_refused(make_monitor, tmp_path: Path) -> None:
    """A trace_dir owned by another uid (even 0700) is refused."""
    d = _private(tmp_path, "theirs")
    if os.geteuid() == 0:
        os.chown(d, 65534, 65534)
        mon = make_monitor(trace_dir=str(d)).start()
        _refused(mon, "owned by uid 65534")
    with pytest.raises(UnsafeTraceDir, match="owned by uid"):  # the same check, as another process user
        open_private_dir(d, create=False, uid=os.geteuid() + 1)


def test_a_fresh_dir_is_created_private_and_a_capture_works(make_monitor, tmp_path: Path) -> None:
    """A trace_dir that does not exist yet is created 0700 and holds a capture's files, 0600 each."""
    d = tmp_path / "new" / "traces"
    mon = make_monitor(trace_dir=str(d))
    model = mon.wrap(torch.nn.Linear(4, 4), name="m")
    cap = mon.capture("m", steps=1)
    meta = wait_capture(mon, cap["id"], drive=lambda: model(torch.randn(1, 4)))
    assert meta["outcome"] == "ok", meta
    assert d.stat().st_mode & 0o777 == 0o700
    assert {p.stat().st_mode & 0o777 for p in d.iterdir()} == {0o600}
    name, data = mon.traces.read_trace(cap["id"])
    assert name == meta["trace_file"] and data[:2] == b"\x1f\x8b"


class _Snapshots:
    def devices(self) -> list[int]:
        return [0]

    def stats(self, device: int) -> dict[str, Any]:
        return {}

    def snapshot(self) -> Any:
        return {"segments": []}


def test_oom_snapshot_writer_refuses_a_symlinked_dir(tmp_path: Path) -> None:
    """The OOM snapshot writer uses the same checks: a symlinked directory is an error, nothing is written."""
    real = _private(tmp_path, "real")
    link = tmp_path / "link"
    link.symlink_to(real)
    errors: list[BaseException] = []
    snap = OomSnapshotter(_Snapshots(), link, 600.0, on_error=errors.append)
    assert snap(MemoryError("CUDA out of memory"))
    snap.join(10)
    assert len(errors) == 1 and isinstance(errors[0], UnsafeTraceDir) and snap.written == []
    assert list(real.iterdir()) == []


def test_metadata_is_strict_json_and_a_nested_or_broken_file_is_skipped(tmp_path) -> None:
    """NaN in a capture's metadata is stored as null (strict JSON other tools can read); a metadata file nested
    past the parser's depth is skipped by the listing and lookups, not an error."""
    import json as _json

    from perfmon.store.files import new_id
    from perfmon.store.traces import TraceStore

    store = TraceStore(tmp_path, max_files=10, max_bytes=10**9)
    good = new_id()
    store.save({"id": good, "model": "m", "duration_seconds": float("nan"), "compute": {"peak": float("inf")}},
               None, None)
    text = (tmp_path / f"{good}.meta.json").read_text()
    assert "NaN" not in text and "Infinity" not in text
    stored = _json.loads(text)
    assert stored["duration_seconds"] is None and stored["compute"]["peak"] is None
    bad = new_id()
    (tmp_path / f"{bad}.meta.json").write_text("[" * 5000 + "]" * 5000)
    assert [m["id"] for m in store.list()] == [good]
    assert store.get(bad) is None and store.get(good)["model"] == "m"


def _full_disk_save(store: TraceStore, meta: dict[str, Any], trace: bytes, limit: int) -> None:
    """``store.save`` with files capped at ``limit`` bytes (RLIMIT_FSIZE: a write past it fails EFBIG, as on a full
    disk), the cap lifted again after."""
    import resource
    import signal
    import time

    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of the signal's kill
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old[1]))
    try:
        store.save(meta, trace, f"host_1.{time.time_ns()}.pt.trace.json.gz")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, old_handler)


def test_a_save_whose_metadata_does_not_fit_leaves_no_trace_behind(tmp_path: Path) -> None:
    """A full disk where a capture's trace fits and its metadata does not: the save fails, and it used to leave the
    trace under its final name, which no metadata names, no retention removes, and no sweep saw (a helper's run:
    8 trace files on disk for 3 captures listed). The trace is removed with the failure."""
    store = TraceStore(_private(tmp_path), max_files=3, max_bytes=10**9)
    big = {"id": new_id(), "model": "m", "status": "done", "outcome": "ok", "summary": ["x" * 100] * 80}
    with pytest.raises(OSError):
        _full_disk_save(store, big, b"\x1f" * 1024, 4096)
    assert sorted(os.listdir(store.directory)) == []
    small = {"id": new_id(), "model": "m", "status": "done", "outcome": "ok"}
    store.save(small, b"\x1f" * 1024, "host_1.1.pt.trace.json.gz")
    assert [p["id"] for p in store.list()] == [small["id"]]


def test_the_start_sweep_removes_an_unnamed_old_trace_and_an_earlier_process_temp_under_this_pid(
        tmp_path: Path) -> None:
    """Swept at start: a trace over an hour old that no metadata names (a process killed between its trace and its
    metadata), and a temp file carrying this process's own pid written before this process loaded the store (a
    container's pid 1 restarted after a kill mid-export: three restarts left 6 temp files, 8.4 MB, kept for an
    hour because the pid was 'alive'). A named trace, a fresh unnamed one (another process between its two
    writes) and this process's own fresh temp stay."""
    import time

    d = _private(tmp_path)
    store = TraceStore(d, max_files=10, max_bytes=10**9)
    kept = store.save({"id": new_id(), "model": "m", "status": "done", "outcome": "ok"}, b"t" * 10,
                      "host_1.2.pt.trace.json.gz")
    hour_ago = time.time() - 2 * 3600
    orphan, fresh_orphan = d / "host_1.3.pt.trace.json.gz", d / "host_1.4.pt.trace.json.gz"
    for f in (orphan, fresh_orphan):
        f.write_bytes(b"t" * 10)
        f.chmod(0o600)
    os.utime(orphan, (hour_ago, hour_ago))
    os.utime(d / kept["trace_file"], (hour_ago, hour_ago))
    earlier, mine = store.new_temp("json")[1], store.new_temp("json")[1]
    # 50 minutes old: under the hour (only the pid rule can remove it), and before this test process loaded the
    # store (a whole suite runs in ~10).
    before = time.time() - 3000
    os.utime(earlier, (before, before))
    torn = d / f"{new_id()}.meta.json"  # a metadata file that cannot be read: it may name the old trace
    torn.write_bytes(b"{not json")
    torn.chmod(0o600)
    assert store.sweep_temp() is None
    assert orphan.exists() and not earlier.exists()  # no trace removed while one metadata file is unreadable
    torn.unlink()
    assert store.sweep_temp() is None
    assert sorted(os.listdir(d)) == sorted([kept["trace_file"], f"{kept['id']}.meta.json", fresh_orphan.name,
                                            mine.name])


_FAILED_SAVE = r"""
import json, resource, signal, sys, time
import torch, perfmon
torch.set_num_threads(1)
mon = perfmon.Monitor(port=None, log_level="critical", regression=None, prepare_profiler=False, trace_dir=sys.argv[1])
model = mon.wrap(torch.nn.Linear(8, 8), name="m")
model(torch.ones(2, 8))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG, not a kill
old = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (1, old[1]))  # a full disk: no file of this process grows past 1 byte
cid = mon.capture("m", steps=2, max_seconds=5)["id"]
meta = None
for _ in range(3000):  # bounded: 30 s
    model(torch.ones(2, 8))
    meta = mon.profile(cid)
    if meta is None or meta.get("outcome"):
        break
    time.sleep(0.01)
resource.setrlimit(resource.RLIMIT_FSIZE, old)
print(json.dumps({"meta": meta, "listed": [p["id"] for p in mon.profiles()], "cid": cid}))
mon.stop()
"""


def test_a_capture_the_store_could_not_keep_is_still_answered_with_its_error(tmp_path: Path) -> None:
    """A trace_dir where nothing can be written (a full disk; a read-only volume): the capture ran, its export and
    its metadata's save failed, and then GET /profiles/{id} answered 404 "no such capture" (`perfmon profile`: "HTTP
    404"), the reason only in the logs. It is answered from memory now, failed, with the store's error."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", _FAILED_SAVE, str(_private(tmp_path))], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    meta = got["meta"]
    assert meta is not None, "the capture was a 404"
    assert meta["id"] == got["cid"] and meta["outcome"] == "failed" and meta["status"] == "done"
    assert "File too large" in (meta["error"] or "") or "store failed" in (meta["error"] or ""), meta["error"]
    assert got["listed"] == [got["cid"]]
