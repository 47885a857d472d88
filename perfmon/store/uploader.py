"""Captures copied to object storage, so they outlive the pod: the trace directory becomes a spool.

::

    capture export ─► TraceStore.save (trace, then metadata) ─► on_saved: wake the uploader
    uploader thread (daemon): pending = stored ids not in the manifest, oldest first, one capture per attempt
        ─► put the trace ─► put the metadata ─► manifest (atomic write) ─► the next one
        a failure: counted, the capture stays spooled, the next attempt after min(cap, 1 s · 2^n) · jitter
        (``perfmon.backoff``); an attempt that has not ended by its deadline is abandoned and is a failure
    idle, about hourly: traces a crash left without their metadata, older than the grace, removed from the store
    TraceStore retention removes a capture not yet uploaded ─► on_evicted: counted as dropped

Any fsspec URL is a destination (``s3://``, ``gs://``, ``az://``, ``file://``, ``memory://``); fsspec and the
cloud SDK (``perfmon[s3]`` = s3fs) are imported only when ``trace_store`` is set. Endpoint and
credentials come from the SDK's own chain (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, instance roles...);
perfmon never logs them, nor a URL's user-info or query.

Idempotent: a capture's object key is a function of its stored metadata alone
(``{prefix}/{model}/{host}/{worker}/{YYYYmmddTHHMMSSZ}-{id}/``, ``capture_key``), so a retry after a
partial upload, a second process sharing the directory, or a restart overwrites the same objects and
never adds a copy. The metadata goes last, and a listing reads metadata only: a listed capture has its
trace. Durable: ``perfmon-uploads.json`` in the trace directory (written atomically, 0600, pruned to the
captures still there) says which captures are up; what it does not name is uploaded after a restart.
A capture is marked only after both objects are written, so a crash in between uploads it again (the
same keys): at least once, never twice under two keys. If the spool is lost too, the orphan trace (no
listing shows it) is removed by a sweep once ``orphan_grace_seconds`` old. Every call to the store ends by
a deadline (``StoreCalls``): an attempt that has not ended by it is abandoned and counts as failed.

Bounded: the spool is the trace directory, whose retention (``trace_max_files``, ``trace_max_bytes``)
already bounds it; a capture it removes before its upload is counted as dropped, never kept. Serving
never waits: the request thread does not touch this module; the export thread only sets an event.

Opening the store, its layout, and the fleet's view of it (``perfmon profiles --store``) are ``remote.py``.
"""

from __future__ import annotations

import json
import math
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..backoff import backoff_seconds
from ..exceptions import ConfigError
from ..faults import InternalErrors
from ..selfcost import AgentCpu
from .calls import StoreCalls, count_io, io_thread_cpu
from .files import TRACE_NAME, _read_at, meta_json, write_at
from .remote import capture_key, check_usable, iso_seconds, open_store, orphan_traces, redact, scrub, written_at
from .traces import TraceStore

__all__ = ["DROP_REASONS", "MANIFEST_NAME", "MIN_BYTES_PER_SECOND", "OUTCOMES", "TraceUploader", "UploadStats",
           "upload_view"]

#: The durable record of what is uploaded, in the trace directory (not a name TraceStore lists or removes).
MANIFEST_NAME = "perfmon-uploads.json"
#: perfmon_trace_uploads_total{outcome}: a capture's trace and metadata written, or an attempt that failed.
OUTCOMES = ("ok", "failed")
#: perfmon_trace_spool_dropped_total{reason}: removed by retention before its upload, or unreadable here.
DROP_REASONS = ("retention", "unreadable")
#: An attempt's deadline is ``timeout_seconds`` plus its bodies at this rate (bytes per second): a 1 MiB trace
#: adds 1 s, the largest capture (``capture_max_bytes``, 256 MiB) 256 s. A store slower than this for a whole
#: trace fails it; one that does not answer fails at the deadline.
MIN_BYTES_PER_SECOND = 2**20
#: A sweep for orphan traces removes at most this many, within this many ``timeout_seconds`` in all.
ORPHANS_PER_SWEEP = 100
SWEEP_TIMEOUTS = 10


@dataclass
class UploadStats:
    """What the uploader has done, for metrics; read from other threads (plain values, no lock needed)."""

    uploads: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    dropped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DROP_REASONS, 0))
    #: Captures waiting for upload: their files (trace and metadata) and bytes.
    spool_files: int = 0
    spool_bytes: int = 0
    #: ``clock()`` of the last successful upload; before any, of the uploader's start, or of when the oldest capture
    #: waiting was saved if that is earlier (spooled before a restart: a restart does not make a backlog young).
    last_ok: float = 0.0
    #: Traces without metadata (a crash between a capture's two puts) removed from the store by the sweep.
    orphans_removed: int = 0


class TraceUploader:
    """Uploads each finished capture of ``store`` to ``url`` on a daemon thread; fail-soft.

    ``clock`` (monotonic seconds), ``jitter`` (0..1) and ``fs`` (an fsspec filesystem, with ``root``) are
    injectable, so tests drive ``step()`` by hand. ``backoff_initial_seconds`` doubles per consecutive
    failure up to ``backoff_max_seconds``; ``poll_seconds`` is how often the spool is rescanned when idle
    (a capture saved here wakes the thread at once; the rescan finds other processes' captures). The thread's CPU
    seconds are added to ``cpu`` as ``thread="upload"``. An attempt ends by ``timeout_seconds`` plus its bodies at
    ``MIN_BYTES_PER_SECOND`` (``StoreCalls``, with ``max_abandoned_calls``). Idle, every ``orphan_sweep_seconds``
    (jittered), traces without metadata written over ``orphan_grace_seconds`` ago (``wall``: Unix seconds) are
    removed (at least 2 timeouts: no upload in flight is; the default hour outlasts a 256 MiB capture's ~5 min).
    """

    def __init__(self, store: TraceStore, url: str, *, internal: InternalErrors | None = None, log: Any = None,
                 timeout_seconds: float = 30.0, backoff_initial_seconds: float = 1.0,
                 backoff_max_seconds: float = 300.0, poll_seconds: float = 30.0,
                 clock: Callable[[], float] = time.monotonic, jitter: Callable[[], float] = random.random,
                 fs: Any = None, root: str | None = None, cpu: AgentCpu | None = None,
                 orphan_grace_seconds: float = 3600.0, orphan_sweep_seconds: float = 3600.0,
                 max_abandoned_calls: int = 2, wall: Callable[[], float] = time.time) -> None:
        for name, value, least in (("timeout_seconds", timeout_seconds, 0.0), ("orphan_sweep_seconds",
                                   orphan_sweep_seconds, 0.0), ("orphan_grace_seconds", orphan_grace_seconds,
                                   2 * timeout_seconds)):  # an upload in flight must never look orphaned
            if not (isinstance(value, (int, float)) and value > least and math.isfinite(value)):
                raise ConfigError(f"{name} must be a finite number of seconds > {least}, got {value!r}")
        self.store = store
        self._cpu = cpu if cpu is not None else AgentCpu()
        self.url = url
        self.destination = redact(url)
        self.timeout_seconds = timeout_seconds
        self.backoff_initial_seconds = backoff_initial_seconds
        self.backoff_max_seconds = backoff_max_seconds
        self.poll_seconds = poll_seconds
        self._internal = internal if internal is not None else InternalErrors()
        self._log = log
        self.clock = clock
        self._jitter = jitter
        if fs is None:
            check_usable(url)  # a missing package is a ConfigError now; the filesystem is built on the thread
        self._fs, self._root = fs, root
        self._fs_injected = fs is not None
        self.stats = UploadStats(last_ok=clock())
        self._started = self.stats.last_ok
        self.orphan_grace_seconds = orphan_grace_seconds
        self.orphan_sweep_seconds = orphan_sweep_seconds
        self._wall = wall
        self._calls = StoreCalls(max_abandoned=max_abandoned_calls, cpu=self._cpu)
        self._sweep_at = clock() + orphan_sweep_seconds * (0.5 + 0.5 * jitter())  # a fleet does not sweep in step
        self._uploaded: dict[str, str] = {}  # capture id -> its key
        self._gone: set[str] = set()  # unreadable here: never retried
        self._sizes: dict[str, tuple[int, int, float | None]] = {}  # pending id -> (files, bytes, saved), read once
        self._loaded = False
        self._uploading: str | None = None  # the capture an attempt is sending
        self._evicted_in_flight = False  # ... which retention removed meanwhile
        self.failures = 0
        self.retry_at = 0.0
        self.last_error: str | None = None
        self._init_threading()
        store.on_saved.append(self._saved)
        store.on_evicted.append(self._evicted)

    def _init_threading(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()  # the running thread's own: a restart gives the next thread a new one
        self._thread: threading.Thread | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the upload thread (idempotent); what an earlier process spooled goes up first."""
        if self._thread is not None and self._thread.is_alive():
            return
        # A new event, not the old one cleared: a thread stop() gave up on (an attempt hung past the join) still
        # sees its own set and ends after that attempt; clearing it kept one more thread alive per restart.
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(self._stop,), name="perfmon-trace-upload",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout_seconds: float) -> None:
        """Ask the thread to end and wait up to ``timeout_seconds``; an upload in flight is abandoned
        (its capture stays spooled: the next start uploads it again, under the same key)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_seconds)
        self._thread = None

    def reset_after_fork(self) -> None:
        """In a forked child: the parent's thread is gone and its locks may be held; the filesystem
        instance holds the parent's connections. Start afresh (the manifest is reloaded)."""
        self._init_threading()
        self._calls = StoreCalls(max_abandoned=self._calls.max_abandoned, cpu=self._cpu)  # no thread of it is here
        if not self._fs_injected:
            self._fs = self._root = None
        self._loaded = False

    def notify(self) -> None:
        """Look at the spool now (a capture was saved)."""
        self._wake.set()

    def _saved(self, meta: dict[str, Any]) -> None:
        self._wake.set()  # the export thread: one Event.set, nothing else

    def _evicted(self, meta: dict[str, Any]) -> None:
        cid = meta.get("id")
        if cid == self._uploading:  # its upload decides: a success is no drop (step() counts a failure)
            self._evicted_in_flight = True
        elif isinstance(cid, str) and cid not in self._uploaded and cid not in self._gone:
            self.stats.dropped["retention"] += 1
            if self._log is not None:
                self._log.warning("trace_upload_dropped", id=cid, reason="retention",
                                  note="removed by trace_max_files/trace_max_bytes before it was uploaded")

    def _run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self._wake.clear()
            self._cpu.woke("upload")
            try:
                # Its CPU (trace reads, a sync SDK's requests) is the agent's own cost too; an async SDK's
                # requests run on fsspec's IO thread, added per attempt by calls.count_io.
                with self._cpu.measure("upload"):
                    wait = self.step()
            except Exception as exc:  # a bug here must not end the thread: count it, slow down
                self._internal.report("trace_upload", exc)
                wait = self.poll_seconds
            self._wake.wait(wait)

    # -- one attempt ---------------------------------------------------------------------------

    def step(self) -> float:
        """Upload at most one capture; returns seconds until the next step is due (0: go on at once)."""
        with self._lock:
            pending = self._scan()  # the spool gauges stay current through an outage too
            now = self.clock()
            if now < self.retry_at:
                return self.retry_at - now
            if not pending:
                if now >= self._sweep_at:
                    _sweep(self)
                    self._sweep_at = self.clock() + self.orphan_sweep_seconds * (0.5 + 0.5 * self._jitter())
                return min(self.poll_seconds, max(0.0, self._sweep_at - self.clock()))
            cid = pending[0]
            self._evicted_in_flight = False  # first: an eviction after the next line is this attempt's
            self._uploading = cid
            try:
                ok = self._upload(cid)
            finally:
                self._uploading = None
            if self._evicted_in_flight and not ok:
                self.stats.dropped["retention"] += 1  # removed while it went up, and it did not get there
            if ok is None:  # nothing to send (gone, unreadable): on to the next one
                return 0.0
            if ok:
                self.failures = 0
                self.retry_at = 0.0
                try:
                    self._scan()  # refresh the spool gauges first: a reader that sees the upload counted sees it
                finally:  # gone from the spool too (the stats are read without the lock)
                    self.stats.uploads["ok"] += 1
                    self.stats.last_ok = self.clock()
                return 0.0
            self.failures += 1
            self.stats.uploads["failed"] += 1
            delay = backoff_seconds(self.failures, initial=self.backoff_initial_seconds,
                                    cap=self.backoff_max_seconds, jitter=self._jitter())
            self.retry_at = self.clock() + delay
            return delay

    def _scan(self) -> list[str]:
        """Ids waiting for upload, oldest first; updates the spool gauges (each capture's size read once)."""
        if not self._loaded:
            self._load_manifest()
        ids = self.store.ids()
        pending = [i for i in reversed(ids) if i not in self._uploaded and i not in self._gone]
        sizes = {}
        for cid in pending:
            size = self._sizes.get(cid)
            if size is None:
                meta = self.store.get(cid) or {}
                tb = meta.get("trace_bytes")
                trace_bytes = tb if isinstance(tb, int) and not isinstance(tb, bool) else None
                size = (1 if trace_bytes is None else 2, len(meta_json(meta)) + (trace_bytes or 0),
                        _saved_clock(meta, self._wall(), self.clock()))
            sizes[cid] = size
        self._sizes = sizes
        self.stats.spool_files = sum(f for f, _, _ in sizes.values())
        self.stats.spool_bytes = sum(b for _, b, _ in sizes.values())
        if not self.stats.uploads["ok"]:  # before the first upload: since the start, or the oldest still waiting
            self.stats.last_ok = min([self._started, *(t for _, _, t in sizes.values() if t is not None)])
        return pending

    def _filesystem(self) -> tuple[Any, str]:
        if self._fs is None or self._root is None:
            # Built lazily, on this thread: an SDK that resolves credentials slowly never holds up start().
            self._fs, self._root = open_store(self.url, timeout_seconds=self.timeout_seconds)
        return self._fs, self._root

    def _upload(self, cid: str) -> bool | None:
        """Put one capture's trace, then its metadata; True done, False failed (retry), None nothing to send."""
        meta = self.store.get(cid)
        if meta is None:
            self._missing(cid)
            return None
        key = capture_key(meta)
        trace_name = meta.get("trace_file")
        data = None
        if isinstance(trace_name, str):
            found = self.store.read_trace(cid) if TRACE_NAME.fullmatch(trace_name) else None
            if found is None:
                self._missing(cid)
                return None
            data = found[1]
        if key is None:
            self._missing(cid)
            return None
        body = meta_json(meta)
        # Real time (not self.clock, a test's hand clock): how long this thread may wait.
        deadline = time.monotonic() + self.timeout_seconds + (len(body) + len(data or b"")) / MIN_BYTES_PER_SECOND
        io_before = io_thread_cpu()
        try:
            fs, root = self._filesystem()
            if data is not None:
                self._calls.call(fs, "pipe_file", f"{root}/{key}/{trace_name}", data, deadline=deadline)
            # Last, so a listed capture has its trace; a crash before it leaves an orphan, swept after the grace.
            self._calls.call(fs, "pipe_file", f"{root}/{key}/{cid}.meta.json", body, deadline=deadline)
        except Exception as exc:
            first = self.failures == 0
            self.last_error = f"{type(exc).__name__}: {scrub(str(exc), self.url)}"[:300]
            if first and self._log is not None:  # once per outage, not per retry
                self._log.warning("trace_upload_failed", store=self.destination, id=cid, error=self.last_error,
                                  note="the capture stays in trace_dir and is retried with backoff")
            count_io(self._cpu, io_before)
            return False
        count_io(self._cpu, io_before)
        if self.failures and self._log is not None:
            self._log.info("trace_upload_recovered", store=self.destination, failed_attempts=self.failures)
        self._uploaded[cid] = key
        self._write_manifest()
        return True

    def _missing(self, cid: str) -> None:
        """The capture cannot be read: removed by retention meanwhile (already counted) or unreadable."""
        if cid in self.store.ids():
            self.stats.dropped["unreadable"] += 1
            self._gone.add(cid)
            self._write_manifest()

    # -- the manifest --------------------------------------------------------------------------

    def _load_manifest(self) -> None:
        self._loaded = True
        uploaded, gone = _manifest_marks(self.store, self.destination)
        self._uploaded.update(uploaded)
        self._gone.update(gone)

    def _write_manifest(self) -> None:
        """Atomically replace the manifest, pruned to the captures still in the directory (so it stays
        as small as the spool); a failure is counted and the marks are kept in memory (at worst a capture
        is uploaded again after a restart, under the same key)."""
        present = set(self.store.ids())
        self._uploaded = {k: v for k, v in self._uploaded.items() if k in present}
        self._gone &= present
        body = json.dumps({"version": 1, "destination": self.destination, "uploaded": self._uploaded,
                           "unreadable": sorted(self._gone)}, indent=1, sort_keys=True).encode()
        try:
            with self.store.opened() as dfd:
                assert dfd is not None
                write_at(dfd, MANIFEST_NAME, body)
        except Exception as exc:
            self._internal.report("trace_upload_manifest", exc)


def upload_view(up: TraceUploader) -> tuple[str, dict[str, Any]]:
    """/stats' ``trace_upload``: where to, what waits, the counts, and the last error while failing (None after a
    success); it was only in /metrics, and the error in one log line an outage."""
    st = up.stats
    return "trace_upload", {"store": up.destination, "spool_files": st.spool_files, "spool_bytes": st.spool_bytes,
                            "uploads": dict(st.uploads), "dropped": dict(st.dropped),
                            "age_seconds": max(0.0, up.clock() - st.last_ok), "failing": up.failures,
                            "last_error": up.last_error if up.failures else None}


def _sweep(up: TraceUploader) -> None:
    """Remove orphan traces (``remote.orphan_traces``) older than the grace: at most ``ORPHANS_PER_SWEEP``,
    within ``SWEEP_TIMEOUTS * timeout_seconds`` in all; a failure is logged and left to the next sweep."""
    deadline, io_before, removed = time.monotonic() + SWEEP_TIMEOUTS * up.timeout_seconds, io_thread_cpu(), 0
    try:
        fs, root = up._filesystem()
        # The whole prefix, every pod's (one that crashed may never return), in one flat listing (S3 pages
        # 1000 keys a request; a five-level glob would list folder by folder).
        objects = up._calls.call(fs, "find", root, detail=True, deadline=deadline)
        cutoff = up._wall() - up.orphan_grace_seconds
        for path in orphan_traces(fs, root, objects, written_before=cutoff)[:ORPHANS_PER_SWEEP]:
            folder = path.rsplit("/", 1)[0]
            meta = f"{folder}/{folder.rsplit('-', 1)[1]}.meta.json"
            # Asked again just before: a restarted pod may have put the whole capture up since the listing.
            written = written_at(up._calls.call(fs, "info", path, deadline=deadline))
            if written is not None and written < cutoff and not up._calls.call(fs, "exists", meta,
                                                                                 deadline=deadline):
                up._calls.call(fs, "rm_file", path, deadline=deadline)
                removed += 1
                up.stats.orphans_removed += 1
    except Exception as exc:  # the store's or the SDK's: the next sweep tries again
        if up._log is not None:
            up._log.warning("trace_store_sweep_failed", store=up.destination, removed=removed,
                              error=f"{type(exc).__name__}: {scrub(str(exc), up.url)}"[:300])
    count_io(up._cpu, io_before)
    if removed and up._log is not None:
        up._log.info("trace_store_orphans_removed", store=up.destination, removed=removed)


def _saved_clock(meta: dict[str, Any], wall_now: float, clock_now: float) -> float | None:
    """When a waiting capture was saved, on the uploader's clock (``meta``'s end or arm time; None without one).

    Before a process's first upload its age dates back to the oldest: a crash-looping or redeployed pod with a
    broken store restarted the age at every start, and its alert (over 15 min with files spooled) never fired
    while its captures aged in the spool."""
    saved = iso_seconds(meta.get("ended_at") or meta.get("armed_at"))
    return None if saved is None else clock_now - max(0.0, wall_now - saved)


def _manifest_marks(store: TraceStore, destination: str) -> tuple[dict[str, str], set[str]]:
    """The manifest's marks for ``destination``: uploaded ids (-> key), unreadable ids. A manifest written for
    another destination says nothing about this one: none (everything is uploaded again)."""
    data = _read_manifest(store)
    if data.get("destination") != destination:
        return {}, set()
    up, gone = data.get("uploaded"), data.get("unreadable")
    return ({k: v for k, v in up.items() if isinstance(k, str) and isinstance(v, str)} if isinstance(up, dict) else {},
            {g for g in gone if isinstance(g, str)} if isinstance(gone, list) else set())


def _read_manifest(store: TraceStore) -> dict[str, Any]:
    try:
        with store.opened(create=False) as dfd:
            body = None if dfd is None else _read_at(dfd, MANIFEST_NAME, 16 * 2**20)
        data = json.loads(body) if body else {}
    except Exception:  # absent, unsafe directory, torn by hand: start from nothing (uploads are idempotent)
        return {}
    return data if isinstance(data, dict) else {}
