"""Orphan traces: a crash between a capture's two puts, with its spool lost, leaves a trace without metadata
that no listing shows. The uploader's sweep removes it once it is older than the grace, and nothing else:
not a capture with its metadata, not an upload in flight, not an object perfmon did not write."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import fsspec
import pytest

from perfmon.store.files import new_id
from perfmon.store.remote import capture_key, download_remote, list_remote, open_store, orphan_traces
from perfmon.store.traces import TraceStore
from perfmon.store.uploader import TraceUploader

from .conftest import HandClock
from .stores import AWS_ENV, s3_server, save_capture

HOUR = 3600.0


class CrashBeforeMeta:
    """A store whose metadata puts fail, as if the process died between a capture's two puts; the rest is
    the wrapped store's. ``before_info(path)`` runs before each ``info`` (what a sweep asks just before it
    removes), so a test can put a capture up whole at that moment."""

    def __init__(self, inner: Any, *, crash: bool = True) -> None:
        self.inner = inner
        self.crash = crash
        self.before_info: Any = None

    def pipe_file(self, path: str, data: bytes) -> None:
        if self.crash and path.endswith(".meta.json"):
            raise ConnectionError("killed before the metadata went up")
        self.inner.pipe_file(path, data)

    def info(self, path: str, **kwargs: Any) -> Any:
        if self.before_info is not None:
            self.before_info(path)
        return self.inner.info(path, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name == "async_impl":  # a synchronous store to perfmon, so that its calls go through the methods above
            raise AttributeError(name)
        return getattr(self.inner, name)


def _orphan(spool: Path, fs: Any, root: str, url: str) -> tuple[str, str, TraceStore]:
    """A capture whose trace went up and whose metadata did not, spooled in ``spool`` (its only capture):
    (id, its trace object, the store)."""
    store = TraceStore(spool, max_files=10, max_bytes=10**9)
    cid = save_capture(store)
    up = TraceUploader(store, url, fs=CrashBeforeMeta(fs), root=root, clock=HandClock(), jitter=lambda: 1.0)
    assert up.step() > 0 and up.stats.uploads["failed"] == 1
    store.on_saved.clear()
    store.on_evicted.clear()
    meta = store.get(cid) or {}
    trace = f"{root}/{capture_key(meta)}/{meta['trace_file']}"
    assert fs.exists(trace)
    return cid, trace, store


def _age(path: str, seconds: float) -> None:
    """Make a local object look written ``seconds`` ago."""
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_the_sweep_removes_an_orphan_older_than_the_grace_and_nothing_else(tmp_path: Path) -> None:
    """Against a file:// store: another pod's uploader, with the default hour of grace, removes the orphan
    trace written two hours ago, and keeps one written now, a whole capture of two hours ago, and objects
    that are not perfmon's. The listing and a download of the whole capture are unchanged."""
    dest = tmp_path / "bucket"
    url, local = f"file://{dest}", fsspec.filesystem("file", auto_mkdir=True)
    root = str(dest)
    crashed = TraceStore(tmp_path / "crashed", max_files=10, max_bytes=10**9)
    whole = save_capture(crashed)
    up = TraceUploader(crashed, url, clock=HandClock(), jitter=lambda: 1.0)
    assert up.step() == 0.0 and up.stats.uploads["ok"] == 1
    crashed.on_saved.clear()
    crashed.on_evicted.clear()
    old_orphan, old_trace, _ = _orphan(tmp_path / "crashed-1", local, root, url)
    young_orphan, young_trace, _ = _orphan(tmp_path / "crashed-2", local, root, url)
    for spool in ("crashed", "crashed-1", "crashed-2"):
        shutil.rmtree(tmp_path / spool)  # the pods are gone, and their spools with them
    whole_key = next(e["key"] for e in list_remote(url))
    foreign = [f"{root}/{whole_key}/notes.txt", f"{root}/{whole_key.rsplit('/', 1)[0]}/{Path(old_trace).name}"]
    for path in foreign:
        local.pipe_file(path, b"not perfmon's")
    for path in [old_trace, *foreign, *local.find(f"{root}/{whole_key}")]:
        _age(path, 2 * HOUR)

    clock = HandClock()
    sweeper = TraceUploader(TraceStore(tmp_path / "other-pod", max_files=10, max_bytes=10**9), url, clock=clock,
                            jitter=lambda: 1.0)
    assert sweeper.step() <= HOUR and local.exists(old_trace)  # not due yet: nothing removed
    clock.t += HOUR
    sweeper.step()
    assert not local.exists(old_trace)
    assert local.exists(young_trace)  # written within the grace: perhaps an upload in flight
    assert all(local.exists(p) for p in foreign)
    assert sweeper.stats.orphans_removed == 1
    assert [e["id"] for e in list_remote(url)] == [whole]
    assert len(download_remote(url, whole, str(tmp_path / "dl"))) == 2
    assert {old_orphan, young_orphan}.isdisjoint(e["id"] for e in list_remote(url))
    # The next sweep, an hour on, finds nothing new to remove (the young orphan is still within its hour).
    clock.t += HOUR
    sweeper.step()
    assert sweeper.stats.orphans_removed == 1 and local.exists(young_trace)


def test_an_orphan_that_goes_up_whole_during_the_sweep_is_kept(tmp_path: Path) -> None:
    """Between the sweep's listing and its removal, the crashed pod comes back with its spool and puts the
    capture up whole: the sweep asks again just before removing, and keeps the trace."""
    dest = tmp_path / "bucket"
    url, local = f"file://{dest}", fsspec.filesystem("file", auto_mkdir=True)
    cid, trace, store = _orphan(tmp_path / "t", local, str(dest), url)
    _age(trace, 2 * HOUR)
    returning = TraceUploader(store, url, clock=HandClock())  # the restarted pod, the same spool
    watched = CrashBeforeMeta(local, crash=False)

    def comes_back(path: str) -> None:
        watched.before_info = None
        assert returning.step() == 0.0 and returning.stats.uploads["ok"] == 1

    watched.before_info = comes_back
    clock = HandClock()
    sweeper = TraceUploader(TraceStore(tmp_path / "other-pod", max_files=10, max_bytes=10**9), url, fs=watched,
                            root=str(dest), clock=clock, jitter=lambda: 1.0)
    clock.t += HOUR
    sweeper.step()
    assert watched.before_info is None  # the sweep did ask again
    assert local.exists(trace) and sweeper.stats.orphans_removed == 0
    assert [e["id"] for e in list_remote(url)] == [cid]


def test_orphans_are_only_perfmons_traces_in_perfmons_layout() -> None:
    """orphan_traces reads one listing: a trace in a capture folder without metadata, older than the cutoff;
    an object with no time, a trace beside its metadata, or anything off the layout is never one."""
    cid, other = new_id(), new_id()
    trace = "h_1.1.pt.trace.json.gz"
    folder = f"/r/enc/h/h_1/20260101T000000Z-{cid}"
    whole = f"/r/enc/h/h_1/20260101T000000Z-{other}"
    objects = {
        f"{folder}/{trace}": {"type": "file", "mtime": 100.0},
        f"{whole}/{trace}": {"type": "file", "mtime": 100.0},
        f"{whole}/{other}.meta.json": {"type": "file", "mtime": 100.0},
        f"/r/enc/h/h_1/not-a-capture/{trace}": {"type": "file", "mtime": 100.0},
        f"/r/enc/h/{trace}": {"type": "file", "mtime": 100.0},
        f"/r/enc/h/h_2/20260101T000000Z-{new_id()}/{trace}": {"type": "file"},  # no time: never removed
        f"/r/enc/h/h_3/20260101T000000Z-{new_id()}/{trace}": {"type": "directory", "mtime": 100.0},
    }
    assert orphan_traces(object(), "/r", objects, written_before=200.0) == [f"{folder}/{trace}"]
    assert orphan_traces(object(), "/r", objects, written_before=50.0) == []


def test_an_orphan_on_s3_is_removed_after_the_grace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Against moto's S3 API through s3fs (its LastModified, its async calls): the orphan is kept while its
    trace is younger than the grace, removed after it; the whole capture beside it stays listed."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    with s3_server(port) as endpoint:
        for k, v in {**AWS_ENV, "AWS_ENDPOINT_URL": endpoint}.items():
            monkeypatch.setenv(k, v)
        bucket = f"perfmon-orphans-{new_id()[:12]}"
        url = f"s3://{bucket}/fleet"
        fs, root = open_store(url, timeout_seconds=5.0)
        fs.mkdir(bucket)
        store = TraceStore(tmp_path / "t", max_files=10, max_bytes=10**9)
        whole = save_capture(store)
        assert TraceUploader(store, url, clock=HandClock()).step() == 0.0
        _, trace, _ = _orphan(tmp_path / "crashed", fs, root, url)
        shift = [0.0]
        clock = HandClock()
        sweeper = TraceUploader(TraceStore(tmp_path / "other-pod", max_files=10, max_bytes=10**9), url, clock=clock,
                                jitter=lambda: 1.0, timeout_seconds=5.0, wall=lambda: time.time() + shift[0])
        clock.t += HOUR
        sweeper.step()
        assert fs.exists(trace) and sweeper.stats.orphans_removed == 0  # written seconds ago: within the grace
        shift[0] = 2 * HOUR
        clock.t += HOUR
        sweeper.step()
        fs.invalidate_cache()
        assert not fs.exists(trace) and sweeper.stats.orphans_removed == 1
        assert [e["id"] for e in list_remote(url)] == [whole]
        assert len(fs.find(root)) == 2  # the whole capture's trace and metadata
