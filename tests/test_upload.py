"""The trace uploader: keys, backoff, spool bound, restart and idempotency, on fsspec's memory and file stores."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from typing import Any, ClassVar

import fsspec
import pytest
from prometheus_client import CollectorRegistry

from perfmon.backoff import backoff_seconds
from perfmon.cli import main
from perfmon.exceptions import ConfigError
from perfmon.metrics.collectors import UploadCollector
from perfmon.store.files import new_id, worker_name
from perfmon.store.remote import capture_key, download_remote, list_remote, redact
from perfmon.store.traces import TraceStore
from perfmon.store.uploader import MANIFEST_NAME, TraceUploader, UploadStats

from .conftest import HandClock, wait_until


class FlakyFs:
    """An fsspec filesystem whose next ``fail`` writes raise; ``fail_after_trace`` fails only metadata writes."""

    def __init__(self, inner: Any, fail: int = 0) -> None:
        self.inner = inner
        self.fail = fail
        self.fail_meta = 0
        self.puts: list[str] = []

    def pipe_file(self, path: str, data: bytes) -> None:
        if self.fail > 0:
            self.fail -= 1
            raise ConnectionError("store unreachable")
        if path.endswith(".meta.json") and self.fail_meta > 0:
            self.fail_meta -= 1
            raise TimeoutError("metadata write timed out")
        self.puts.append(path)
        self.inner.pipe_file(path, data)


def _save(store: TraceStore, model: str = "enc", trigger: str = "manual", size: int = 100) -> str:
    cid = new_id()
    store.save({"id": cid, "model": model, "trigger": trigger, "status": "done", "outcome": "ok"},
               b"\x1f" * size, f"{worker_name()}.{time.time_ns()}.pt.trace.json.gz")
    return cid


def _uploader(store: TraceStore, fs: Any, root: str, clock: HandClock | None = None, **kw: Any) -> TraceUploader:
    return TraceUploader(store, "memory://bucket/fleet", fs=fs, root=root, clock=clock or HandClock(),
                         jitter=lambda: 1.0, **kw)


@pytest.fixture
def mem() -> Any:
    fs = fsspec.filesystem("memory")
    root = f"/perfmon-test-{new_id()}"
    yield fs, root
    if fs.exists(root):
        fs.rm(root, recursive=True)


def test_uploads_trace_then_metadata_under_a_deterministic_key(tmp_path: Path, mem: Any) -> None:
    """One step puts one capture: trace first, metadata last, under {model}/{host}/{worker}/{time}-{id}."""
    fs, root = mem
    store = TraceStore(tmp_path / "t", max_files=10, max_bytes=10**9)
    cid = _save(store)
    flaky = FlakyFs(fs)
    up = _uploader(store, flaky, root)
    assert up.step() == 0.0
    key = capture_key(store.get(cid) or {})
    assert key is not None and key.startswith("enc/") and key.endswith(f"-{cid}")
    assert [p.rsplit("/", 1)[1] for p in flaky.puts] == [store.get(cid)["trace_file"], f"{cid}.meta.json"]
    assert all(p.startswith(f"{root}/{key}/") for p in flaky.puts)
    assert up.stats.uploads == {"ok": 1, "failed": 0}
    assert (up.stats.spool_files, up.stats.spool_bytes) == (0, 0)
    manifest = json.loads((tmp_path / "t" / MANIFEST_NAME).read_text())
    assert manifest["uploaded"] == {cid: key}
    assert up.step() == up.poll_seconds  # nothing left: idle until the next capture or rescan
    assert len(flaky.puts) == 2


def test_failures_back_off_exponentially_up_to_the_cap_then_recover(tmp_path: Path, mem: Any) -> None:
    """Each failed attempt is counted and waits 1, 2, 4 ... s (capped); the capture stays spooled until it goes up."""
    fs, root = mem
    store = TraceStore(tmp_path / "t", max_files=10, max_bytes=10**9)
    _save(store, size=1000)
    clock = HandClock()
    flaky = FlakyFs(fs, fail=5)
    up = _uploader(store, flaky, root, clock=clock, backoff_initial_seconds=1.0, backoff_max_seconds=4.0)
    delays = []
    for _ in range(5):
        delays.append(up.step())
        assert up.step() == pytest.approx(delays[-1])  # not due yet: no attempt, same wait
        clock.t += delays[-1]
    assert delays == [1.0, 2.0, 4.0, 4.0, 4.0]
    assert up.stats.uploads == {"ok": 0, "failed": 5}
    assert up.stats.spool_files == 2 and up.stats.spool_bytes > 1000
    assert clock() - up.stats.last_ok == pytest.approx(sum(delays))  # the age gauge grows through the outage
    assert up.step() == 0.0
    assert up.stats.uploads == {"ok": 1, "failed": 5} and up.failures == 0 and up.stats.last_ok == clock()
    assert backoff_seconds(100_000, initial=1.0, cap=300.0, jitter=0.0) == 150.0  # jitter halves at most


def test_a_partial_upload_is_overwritten_on_retry_never_duplicated(tmp_path: Path, mem: Any) -> None:
    """Trace written, metadata failed: the capture is not listed; the retry writes the same two keys, once each."""
    fs, root = mem
    store = TraceStore(tmp_path / "t", max_files=10, max_bytes=10**9)
    cid = _save(store)
    flaky = FlakyFs(fs)
    flaky.fail_meta = 1
    clock = HandClock()
    up = _uploader(store, flaky, root, clock=clock)
    assert up.step() == 1.0
    assert list_remote("", fs=fs, root=root) == []  # a trace without metadata is never listed
    clock.t += 1.0
    assert up.step() == 0.0
    assert len(set(flaky.puts)) == 2 and len(flaky.puts) == 3  # the trace key written twice, the same object
    listed = list_remote("", fs=fs, root=root)
    assert [p["id"] for p in listed] == [cid]
    assert len(fs.find(root)) == 2


def test_a_restart_uploads_what_was_spooled_and_nothing_twice(tmp_path: Path) -> None:
    """What one process spooled while the store was down goes up from the next process; a third uploads nothing."""
    dest = tmp_path / "bucket"
    store = TraceStore(tmp_path / "t", max_files=10, max_bytes=10**9)
    ids = [_save(store), _save(store, model="dec")]
    down = TraceUploader(store, f"file://{dest}", fs=FlakyFs(fsspec.filesystem("file"), fail=10**6),
                         root=str(dest), clock=HandClock(), jitter=lambda: 1.0)
    assert down.step() == 1.0 and down.stats.uploads["failed"] == 1
    store.on_saved.clear()
    store.on_evicted.clear()
    # "The next process": a fresh store object and uploader over the same directory, through the real URL.
    store2 = TraceStore(tmp_path / "t", max_files=10, max_bytes=10**9)
    up = TraceUploader(store2, f"file://{dest}", clock=HandClock())
    assert [up.step(), up.step()] == [0.0, 0.0]
    assert up.step() == up.poll_seconds
    assert sorted(p["id"] for p in list_remote(f"file://{dest}")) == sorted(ids)
    third = TraceUploader(TraceStore(tmp_path / "t", max_files=10, max_bytes=10**9), f"file://{dest}",
                          clock=HandClock())
    assert third.step() == third.poll_seconds and third.stats.uploads["ok"] == 0


def test_a_restart_does_not_make_a_spooled_backlog_young(tmp_path: Path, mem: Any) -> None:
    """perfmon_trace_upload_age_seconds counted from the uploader's start before any upload, so a pod restarting
    with a broken store read a few seconds at every start and its alert (over 15 min, files spooled) never fired
    while its captures aged. Before the first upload it counts from the oldest waiting capture's save."""
    from datetime import datetime, timezone

    fs, root = mem
    store = TraceStore(tmp_path / "t", max_files=10, max_bytes=10**9)
    wall = 1_800_000_000.0
    for ago in (7200.0, 60.0):  # saved two hours and a minute before this process started
        at = datetime.fromtimestamp(wall - ago, timezone.utc).isoformat(timespec="milliseconds")
        store.save({"id": new_id(), "model": "enc", "trigger": "manual", "status": "done", "outcome": "ok",
                    "armed_at": at, "ended_at": at}, b"\x1f" * 10, f"{worker_name()}.{time.time_ns()}.pt.trace.json.gz")
    clock = HandClock()
    broken = FlakyFs(fs, fail=3)
    up = _uploader(store, broken, root, clock=clock, wall=lambda: wall)
    wait = up.step()
    assert up.stats.uploads == {"ok": 0, "failed": 1}
    assert clock() - up.stats.last_ok == pytest.approx(7200.0)
    clock.t += wait
    assert clock() - up.stats.last_ok == pytest.approx(7200.0 + wait)  # and on from there
    for _ in range(2):  # the store comes back after two more failures
        clock.t += up.step()
    assert up.step() == 0.0 and up.stats.uploads == {"ok": 1, "failed": 3} and up.stats.last_ok == clock()
    # Without the times (a capture stored by hand), it counts from the start, as before.
    bare = TraceStore(tmp_path / "bare", max_files=10, max_bytes=10**9)
    _save(bare)
    plain = _uploader(bare, FlakyFs(fs, fail=1), root + "/b2", wall=lambda: wall)
    plain.step()
    assert plain.stats.uploads["failed"] == 1 and plain.clock() - plain.stats.last_ok == 0.0


def test_retention_bounds_the_spool_and_counts_unuploaded_captures_as_dropped(tmp_path: Path, mem: Any) -> None:
    """With the store down, trace_max_files keeps the spool bounded; each capture it removes unsent is counted."""
    fs, root = mem
    store = TraceStore(tmp_path / "t", max_files=2, max_bytes=10**9)
    up = _uploader(store, FlakyFs(fs, fail=10**6), root)
    for _ in range(5):
        _save(store)
        up.step()
    assert up.stats.dropped == {"retention": 3, "unreadable": 0}
    assert up.stats.spool_files == 4  # two captures, a trace and metadata each
    assert len(store.ids()) == 2


def test_the_thread_uploads_a_saved_capture_without_waiting_for_its_poll(tmp_path: Path, mem: Any) -> None:
    """A saved capture wakes the upload thread at once (poll 1 h); stop() returns within its timeout; the
    thread's CPU is the agent's own cost (`perfmon_agent_cpu_seconds_total{thread="upload"}`)."""
    from perfmon.selfcost import AgentCpu

    from .conftest import wait_until

    fs, root = mem
    store = TraceStore(tmp_path / "t", max_files=10, max_bytes=10**9)
    cpu = AgentCpu()
    up = TraceUploader(store, "memory://x", fs=fs, root=root, poll_seconds=3600.0, cpu=cpu)
    up.start()
    try:
        _save(store)
        wait_until(lambda: up.stats.uploads["ok"] == 1, timeout=10, what="the upload")
        wait_until(lambda: cpu.totals()["upload"] > 0, timeout=10, what="the upload thread's CPU counted")
    finally:
        t0 = time.monotonic()
        up.stop(2.0)
        assert time.monotonic() - t0 < 2.5


def test_an_async_filesystems_io_thread_cpu_counts_as_the_uploads(tmp_path: Path) -> None:
    """s3fs, gcsfs and adlfs run each request on fsspec's IO thread, not the upload thread: an attempt adds
    that thread's CPU to thread="upload" (before: a store burning 0.3 s of CPU counted 0.0001 s)."""
    import fsspec.asyn

    from perfmon.selfcost import AgentCpu
    from perfmon.store.calls import io_thread_cpu

    class BurningFs(fsspec.asyn.AsyncFileSystem):
        """An async store whose every write costs 50 ms of CPU on the thread that runs it."""

        async def _pipe_file(self, path: str, value: bytes, **kwargs: Any) -> None:
            end = time.thread_time() + 0.05
            while time.thread_time() < end:
                pass

    store = TraceStore(tmp_path / "t", max_files=10, max_bytes=10**9)
    cpu = AgentCpu()
    up = TraceUploader(store, "memory://x", fs=BurningFs(skip_instance_cache=True), root="/r", cpu=cpu,
                       clock=HandClock())
    _save(store)
    assert up.step() == 0.0 and up.stats.uploads["ok"] == 1  # step() itself is not measured: only _count_io
    assert io_thread_cpu() is not None
    assert cpu.totals()["upload"] >= 0.08, cpu.totals()  # trace and metadata: 2 x 50 ms, in 10 ms ticks


def test_a_manifest_for_another_destination_is_not_trusted(tmp_path: Path, mem: Any) -> None:
    """Pointing trace_store elsewhere uploads the spooled captures again, to the new destination."""
    fs, root = mem
    store = TraceStore(tmp_path / "t", max_files=10, max_bytes=10**9)
    _save(store)
    assert _uploader(store, fs, root).step() == 0.0
    other = TraceUploader(store, "memory://elsewhere", fs=fs, root=root + "/b", clock=HandClock())
    assert other.step() == 0.0 and other.stats.uploads["ok"] == 1


def test_the_fleet_listing_retries_a_failed_read_and_reports_one_that_keeps_failing(tmp_path: Path) -> None:
    """Stores are opened with the SDK's retries off, so the listing retries a metadata read that failed (a
    reset, a 5xx): once such an error dropped a capture from `perfmon profiles --store` without a word.
    One that keeps failing is reported through on_skip, never silently left out."""
    from fsspec.implementations.memory import MemoryFileSystem


    class Flaky(MemoryFileSystem):
        fail: ClassVar[dict[str, int]] = {}  # path suffix -> reads left to fail

        def cat(self, path: Any, recursive: bool = False, on_error: str = "raise", **kwargs: Any) -> Any:
            got = dict(super().cat(path, recursive=recursive, on_error=on_error, **kwargs))
            for p in list(got):
                for suffix, left in self.fail.items():
                    if p.endswith(suffix) and left > 0:  # fsspec's on_error semantics, as a remote store's
                        self.fail[suffix] = left - 1
                        error = ConnectionResetError("connection reset by peer")
                        if on_error == "raise":
                            raise error
                        if on_error == "omit":
                            del got[p]
                        else:
                            got[p] = error
            return got

    store = TraceStore(tmp_path / "t", max_files=10, max_bytes=10**9)
    ids = [_save(store, model=f"m{i}") for i in range(3)]
    fs, root = Flaky(skip_instance_cache=True), f"/perfmon-flaky-{new_id()}"
    up = _uploader(store, fs, root)
    while up.step() == 0.0 and up.stats.uploads["ok"] < 3:
        pass
    assert up.stats.uploads["ok"] == 3
    try:
        Flaky.fail = {f"{ids[0]}.meta.json": 1}  # one transient failure: retried, listed
        skipped: list[tuple[str, str]] = []
        listed = list_remote("memory://bucket/fleet", fs=fs, root=root, retry_seconds=0.0,
                             on_skip=lambda k, r: skipped.append((k, r)))
        assert sorted(e["id"] for e in listed) == sorted(ids) and skipped == []
        Flaky.fail = {f"{ids[1]}.meta.json": 10}  # keeps failing: reported, the others listed
        listed = list_remote("memory://bucket/fleet", fs=fs, root=root, retry_seconds=0.0,
                             on_skip=lambda k, r: skipped.append((k, r)))
        assert sorted(e["id"] for e in listed) == sorted([ids[0], ids[2]])
        assert len(skipped) == 1 and ids[1] in skipped[0][0]
        assert skipped[0][1].startswith("unreadable: ConnectionResetError")
    finally:
        if fs.exists(root):
            fs.rm(root, recursive=True)


def test_metrics_read_the_uploader() -> None:
    """The collector exports both outcomes and both drop reasons from the start, and the age from the clock."""
    registry = CollectorRegistry()

    class Stub:
        clock = staticmethod(lambda: 50.0)
        stats = UploadStats(uploads={"ok": 2, "failed": 0}, spool_files=2, spool_bytes=300, last_ok=20.0)

    registry.register(UploadCollector(Stub()))
    assert registry.get_sample_value("perfmon_trace_uploads_total", {"outcome": "failed"}) == 0
    assert registry.get_sample_value("perfmon_trace_spool_dropped_total", {"reason": "retention"}) == 0
    assert registry.get_sample_value("perfmon_trace_spool_bytes") == 300
    assert registry.get_sample_value("perfmon_trace_upload_age_seconds") == 30.0


def test_keys_are_sanitised_and_urls_redacted() -> None:
    """A model name cannot climb out of its key segment, and user-info never reaches a log line."""
    cid = new_id()
    key = capture_key({"id": cid, "model": "../../etc/pass wd", "host": "pod-1", "worker": "pod-1_7"})
    assert key is not None and key.split("/")[:3] == ["-..-etc-pass-wd", "pod-1", "pod-1_7"]
    assert capture_key({"id": "../x"}) is None
    assert redact("s3://AKIA:secret@bucket/prefix?token=x") == "s3://bucket/prefix"
    with pytest.raises(ConfigError):
        TraceUploader(TraceStore("/nonexistent-perfmon", max_files=1, max_bytes=1), "nosuchproto://x/y")


def test_cli_lists_filters_and_downloads_from_a_store(tmp_path: Path) -> None:
    """`perfmon profiles --store` lists every host's captures, filters them, and `--download` fetches one."""
    dest = tmp_path / "bucket"
    url = f"file://{dest}"
    a = TraceStore(tmp_path / "a", max_files=10, max_bytes=10**9)
    b = TraceStore(tmp_path / "b", max_files=10, max_bytes=10**9)
    first = _save(a, model="enc", trigger="regression")
    second = _save(b, model="dec", trigger="manual")
    for store in (a, b):
        up = TraceUploader(store, url, clock=HandClock())
        while up.step() == 0.0:
            pass
    out = io.StringIO()
    from perfmon.cli import store_profiles

    assert store_profiles(url, stdout=out) == 0
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and lines[1].startswith(second) and lines[2].startswith(first)  # newest first
    assert [p["id"] for p in list_remote(url, model="enc")] == [first]
    assert [p["id"] for p in list_remote(url, trigger="manual")] == [second]
    assert list_remote(url, since=time.time() + 60) == []
    got = download_remote(url, first, str(tmp_path / "dl"))
    assert sorted(Path(p).name for p in got)[0] == f"{first}.meta.json" and len(got) == 2
    assert main(["profiles", "--store", url, "--download", new_id(), "--out", str(tmp_path / "x")]) == 1
    assert main(["profiles", "--store", url, "--since", "1h", "--host", "no-such-host"]) == 0


class _EvictOnMeta:
    """A store whose metadata PUT first saves a newer capture locally, so retention (max_files=1) removes the one
    going up while its upload is in flight; ``fail`` then fails that PUT."""

    def __init__(self, inner: Any, store: TraceStore, *, fail: bool) -> None:
        self.inner, self.store, self.fail = inner, store, fail

    def pipe_file(self, path: str, data: bytes) -> None:
        if path.endswith(".meta.json") and self.store is not None:
            store, self.store = self.store, None
            _save(store, model="newer")
            if self.fail:
                raise ConnectionError("store unreachable")
        self.inner.pipe_file(path, data)


@pytest.mark.parametrize("fail", [False, True])
def test_a_capture_removed_by_retention_during_its_upload_is_dropped_only_if_it_did_not_get_there(
        tmp_path: Path, mem: Any, fail: bool) -> None:
    """Retention removed a capture while its metadata went up: it was counted dropped, and then ok when the PUT
    succeeded (a helper's run: ok 1 and dropped{retention} 1, the object in the store). Its upload decides."""
    fs, root = mem
    store = TraceStore(tmp_path / "t", max_files=1, max_bytes=10**9)
    first = _save(store)
    up = _uploader(store, _EvictOnMeta(fs, store, fail=fail), root)
    up.step()
    assert first not in store.ids()
    assert up.stats.uploads == {"ok": 0 if fail else 1, "failed": 1 if fail else 0}
    assert up.stats.dropped["retention"] == (1 if fail else 0)


def test_a_restart_during_a_hung_upload_leaves_one_upload_thread(tmp_path: Path) -> None:
    """stop() gives up on a thread whose attempt hangs (its join times out); start() used to clear the stop event
    that thread shared, so it never ended: five stop/start cycles left five upload threads. Each thread has its own
    event now: once the hung attempt returns, the old threads end and one remains."""
    import threading

    release = threading.Event()

    class Hung:
        def pipe_file(self, path: str, data: bytes) -> None:
            release.wait(30)  # bounded; released below
            raise ConnectionError("the store answered at last, with an error")

    def uploads() -> int:
        return sum(t.name == "perfmon-trace-upload" and t.is_alive() for t in threading.enumerate())

    store = TraceStore(tmp_path / "t", max_files=10, max_bytes=10**9)
    _save(store)
    up = TraceUploader(store, "memory://bucket/fleet", fs=Hung(), root="/r", timeout_seconds=20.0,
                       jitter=lambda: 1.0)
    try:
        for _ in range(3):
            up.start()
            wait_until(lambda: any(t.name == "perfmon-trace-upload-call" and t.is_alive()
                                   for t in threading.enumerate()), what="an attempt in flight")
            up.stop(0.05)  # gives up on the hung attempt
        up.start()
        release.set()
        wait_until(lambda: uploads() == 1, timeout=20, what="the threads stop() gave up on to end")
    finally:
        release.set()
        up.stop(5)
    assert uploads() == 0


def test_stats_say_where_uploads_stand_and_why_they_fail(make_monitor, tmp_path: Path) -> None:
    """The upload state was only in /metrics (its error in one log line an outage): /stats' trace_upload says where
    to, what waits, the counts, and the last error while failing."""
    blocked = tmp_path / "dest"
    blocked.write_text("a file where the store's directory should be")
    mon = make_monitor(trace_store=f"file://{blocked}/fleet").start()
    _save(mon.traces)
    mon.uploads.notify()  # type: ignore[union-attr]
    up = wait_until(lambda: (u := mon.stats()["trace_upload"])["failing"] and u, what="a failed upload")
    assert up["store"] == f"file://{blocked}/fleet" and up["uploads"]["ok"] == 0 and up["spool_files"] == 2
    assert up["last_error"] and "Error" in up["last_error"]
    assert "trace_upload" not in make_monitor().stats()  # no store, no section


def test_before_the_first_upload_the_age_is_the_oldest_capture_still_waiting(tmp_path: Path, mem: Any) -> None:
    """The backlog's age is the oldest capture that still waits: one retention removed unsent no longer dates it
    (it kept the age of a capture gone from the spool)."""
    from datetime import datetime, timezone

    fs, root = mem
    store = TraceStore(tmp_path / "t", max_files=2, max_bytes=10**9)
    wall = 1_800_000_000.0
    for ago in (7200.0, 60.0):
        at = datetime.fromtimestamp(wall - ago, timezone.utc).isoformat(timespec="milliseconds")
        store.save({"id": new_id(), "model": "enc", "trigger": "manual", "status": "done", "outcome": "ok",
                    "armed_at": at, "ended_at": at}, b"\x1f" * 10, f"{worker_name()}.{time.time_ns()}.pt.trace.json.gz")
    clock = HandClock()
    up = _uploader(store, FlakyFs(fs, fail=100), root, clock=clock, wall=lambda: wall)
    wait = up.step()
    assert clock() - up.stats.last_ok == pytest.approx(7200.0)
    _save(store)  # a third capture: retention (2 files) removes the two-hour-old one, unsent
    clock.t += wait
    up.step()
    assert up.stats.dropped["retention"] == 1
    assert clock() - up.stats.last_ok == pytest.approx(60.0 + wait)  # the minute-old one, aged on since
