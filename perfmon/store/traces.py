"""The trace directory: captures stored as private, atomic files named like torch's ``tensorboard_trace_handler``.

Files are written to a temp name and renamed, so a crash never leaves a half-written file under its
final name; the directory is created 0700 and files 0600 (traces and allocator snapshots reveal
model structure and input shapes). Names are generated here and in ``files.py``, never taken from a caller.

The directory may be shared with other local users, so nothing in it is trusted (``files.py`` says how
each file is opened): a directory that is a symbolic link, not a directory, another user's or writable by
others is refused with ``UnsafeTraceDir``, and only names matching the store's own patterns
(``{id}.meta.json``, ``{worker}.{time_ns}.pt.trace.json.gz``, its temp names) are ever read, served or
deleted, and only regular files owned by this user.
"""

from __future__ import annotations

import json
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .files import (
    _OPEN_NEW,
    TEMP_NAME,
    TRACE_NAME,
    UnsafeTraceDir,
    _read_at,
    host_name,
    meta_json,
    open_private_dir,
    open_regular,
    temp_name,
    valid_id,
    worker_name,
    write_at,
)

__all__ = ["META_NAME", "TraceStore"]

#: Metadata files: a capture id (see ``files.new_id``) and the suffix.
META_NAME = re.compile(r"^(?P<id>[0-9a-f]{22})\.meta\.json$")
#: A temp file older than this is swept even if its pid is alive (a reused pid, another host's); so is a trace no
#: metadata names (a process killed between the two writes).
TEMP_MAX_AGE_SECONDS = 3600.0
#: When this process loaded the store (Unix seconds): a temp file of this pid written before it is an earlier
#: process's, the same pid reused (a container's pid 1 restarted after a kill).
_BORN = time.time()
#: Metadata files are small (an op summary of <= 25 rows, a per-step table of <= 201 op names and a
#: comparison of <= 402 rows: well under 1 MiB); a bigger one is not ours.
META_MAX_BYTES = 4 * 2**20


class TraceStore:
    """Captures on disk: ``{id}.meta.json`` (metadata + op summary) and the gzipped Chrome trace.

    The metadata file is written last, so a capture is listed only once everything it names exists.
    Retention keeps at most ``max_files`` captures and ``max_bytes`` of traces; the oldest go first,
    and the newest capture is kept whatever its size. So is each model's newest successful baseline
    capture (trigger ``baseline``, outcome ``ok``): later captures are compared with it, so a burst
    of captures must not push it out. Kept baselines count toward both limits and other captures go
    first; the store exceeds a limit only when the baselines (one per model) and the newest capture
    alone do. Reads of an unsafe directory see nothing; writes raise ``UnsafeTraceDir`` (see the
    module docstring).
    """

    def __init__(self, directory: str | os.PathLike[str], *, max_files: int, max_bytes: int) -> None:
        self.directory = Path(directory)
        self.max_files = max_files
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        #: Called (never raising into ``save``) with each capture's stored metadata once it is in place, and
        #: with the metadata of each capture retention removed: the uploader's wake-up and drop count.
        self.on_saved: list[Callable[[dict[str, Any]], None]] = []
        self.on_evicted: list[Callable[[dict[str, Any]], None]] = []

    @contextmanager
    def opened(self, *, create: bool = True) -> Iterator[int | None]:
        """The checked directory's descriptor for the duration of the block (None: absent, not created)."""
        dfd = open_private_dir(self.directory, create=create)
        try:
            yield dfd
        finally:
            if dfd is not None:
                os.close(dfd)

    def problem(self) -> str | None:
        """Why the directory cannot be used, or None (absent is fine: it is created on first write)."""
        try:
            with self.opened(create=False):
                return None
        except OSError as exc:
            return f"trace_dir {str(self.directory)!r}: {exc}"
        except UnsafeTraceDir as exc:
            return str(exc)

    def new_temp(self, suffix: str) -> tuple[str, Path]:
        """Create an empty private temp file for an export in progress; returns (name, path).

        The path is for writers that only take a path (``export_chrome_trace``): the directory is
        checked private, so nobody else can swap the entry the name points at.
        """
        name = temp_name(suffix)
        with self.opened() as dfd:
            os.close(os.open(name, _OPEN_NEW, 0o600, dir_fd=dfd))
        return name, self.directory / name

    def open_temp(self, name: str, flags: int) -> int:
        """Open one of this store's temp files (``os.O_RDONLY`` or ``os.O_WRONLY``) without following links."""
        if not TEMP_NAME.fullmatch(name):
            raise ValueError(f"not a temp name of this store: {name!r}")
        with self.opened() as dfd:
            return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)

    def remove_temp(self, name: str) -> None:
        """Delete one of this store's temp files; never raises."""
        if not TEMP_NAME.fullmatch(name):
            return
        try:
            with self.opened(create=False) as dfd:
                if dfd is not None:
                    os.unlink(name, dir_fd=dfd)
        except (OSError, ValueError):
            pass

    def save(self, meta: dict[str, Any], trace: bytes | None, trace_name: str | None,
             *, trace_temp: str | None = None) -> dict[str, Any]:
        """Write the trace (``trace`` bytes, or the finished temp file ``trace_temp`` moved into place),
        then the metadata; apply retention; returns the stored metadata."""
        if trace_name is not None and not TRACE_NAME.fullmatch(trace_name):
            raise ValueError(f"not a trace name of this store: {trace_name!r}")
        with self._lock, self.opened() as dfd:
            assert dfd is not None
            if trace_name is not None and trace is not None:
                write_at(dfd, trace_name, trace)
                meta = {**meta, "trace_file": trace_name, "trace_bytes": len(trace)}
            elif trace_name is not None and trace_temp is not None:
                if not TEMP_NAME.fullmatch(trace_temp):
                    raise ValueError(f"not a temp name of this store: {trace_temp!r}")
                size = os.stat(trace_temp, dir_fd=dfd, follow_symlinks=False).st_size
                os.replace(trace_temp, trace_name, src_dir_fd=dfd, dst_dir_fd=dfd)
                meta = {**meta, "trace_file": trace_name, "trace_bytes": size}
            # Where it was made travels with it: an upload after a restart keys it as its maker would have.
            meta = {"host": host_name(), "worker": worker_name(), **meta}
            try:
                write_at(dfd, f"{meta['id']}.meta.json", meta_json(meta))
            except BaseException:
                # No metadata, no capture: its trace would be listed nowhere and never removed by retention (a
                # full disk, where the trace fits and its metadata does not, left one such file per capture).
                if "trace_file" in meta:
                    self._unlink_own(dfd, meta["trace_file"])
                raise
            self._retain(dfd)
        _notify(self.on_saved, meta)
        return meta

    def ids(self) -> list[str]:
        """Ids of the stored captures, newest first, from the directory listing alone (no file is read);
        none while the directory is absent or unsafe."""
        try:
            with self.opened(create=False) as dfd:
                return [] if dfd is None else [n[: -len(".meta.json")] for n in _meta_names(dfd)]
        except (UnsafeTraceDir, OSError):
            return []

    def list(self) -> list[dict[str, Any]]:
        """Stored captures, newest first (none while the directory is absent or unsafe)."""
        out = []
        try:
            with self.opened(create=False) as dfd:
                if dfd is None:
                    return []
                for name in _meta_names(dfd):
                    meta = self._meta(dfd, name)
                    if meta is not None:
                        out.append(meta)
        except (UnsafeTraceDir, OSError):
            return []
        return out

    def get(self, capture_id: str) -> dict[str, Any] | None:
        """A stored capture's metadata, or None (unknown or malformed id, unsafe directory)."""
        if not valid_id(capture_id):
            return None
        try:
            with self.opened(create=False) as dfd:
                return None if dfd is None else self._meta(dfd, f"{capture_id}.meta.json")
        except (UnsafeTraceDir, OSError):
            return None

    def _meta(self, dfd: int, name: str) -> dict[str, Any] | None:
        body = _read_at(dfd, name, META_MAX_BYTES)
        try:
            meta = json.loads(body) if body is not None else None
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth: not a capture of ours
            return None
        return meta if isinstance(meta, dict) else None

    def _trace_name(self, capture_id: str) -> str | None:
        meta = self.get(capture_id)
        name = meta.get("trace_file") if meta else None
        return name if isinstance(name, str) and TRACE_NAME.fullmatch(name) else None

    def read_trace(self, capture_id: str) -> tuple[str, bytes] | None:
        """(file name, gzipped bytes) of a stored capture's trace, or None; never through a link."""
        name = self._trace_name(capture_id)
        if name is None:
            return None
        try:
            with self.opened(create=False) as dfd:
                data = None if dfd is None else _read_at(dfd, name, None)
        except (UnsafeTraceDir, OSError):
            return None
        return None if data is None else (name, data)

    def trace_path(self, capture_id: str) -> Path | None:
        """The trace file of a stored capture, or None (unknown id, failed capture, file gone or not
        a regular file of this user). Prefer ``read_trace``, which reads through the checked descriptor."""
        name = self._trace_name(capture_id)
        if name is None:
            return None
        try:
            with self.opened(create=False) as dfd:
                fd = None if dfd is None else open_regular(dfd, name)
        except (UnsafeTraceDir, OSError):
            return None
        if fd is None:
            return None
        os.close(fd)
        return self.directory / name

    def _retain(self, dfd: int) -> None:
        entries = []
        baselines: set[str] = set()  # models whose newest ok baseline is already pinned
        for meta_name in _meta_names(dfd):  # newest first
            meta = self._meta(dfd, meta_name) or {}
            size = meta.get("trace_bytes")
            size = size if isinstance(size, int) and not isinstance(size, bool) and size >= 0 else 0
            model = meta.get("model")
            pinned = False
            if meta.get("trigger") == "baseline" and meta.get("outcome") == "ok" and isinstance(model, str):
                pinned = model not in baselines
                baselines.add(model)
            entries.append((meta_name, meta, size, pinned))
        kept_files = sum(1 for e in entries if e[3])
        kept_bytes = sum(e[2] for e in entries if e[3])
        for i, (meta_name, meta, size, pinned) in enumerate(entries):
            if pinned:
                continue
            # The newest capture is always kept: the one an operator just asked for must be fetchable.
            if i == 0 or (kept_files < self.max_files and kept_bytes + size <= self.max_bytes):
                kept_files += 1
                kept_bytes += size
                continue
            name = meta.get("trace_file")
            if isinstance(name, str) and TRACE_NAME.fullmatch(name):
                self._unlink_own(dfd, name)
            self._unlink_own(dfd, meta_name)
            _notify(self.on_evicted, {**meta, "id": meta_name[: -len(".meta.json")]})

    @staticmethod
    def _unlink_own(dfd: int, name: str) -> None:
        """Delete ``name`` if it is a regular file of this user (a link or someone else's file stays)."""
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
                os.unlink(name, dir_fd=dfd)
        except OSError:
            pass

    def sweep_temp(self) -> str | None:
        """Remove temp files an interrupted export left (their process is gone, or is this one reborn under the
        same pid, or they are over an hour old), and traces over an hour old that no metadata names (a kill
        between a capture's two writes); never raises. Returns why the directory is unusable, or None."""
        try:
            with self.opened(create=False) as dfd:
                if dfd is None:
                    return None
                now = time.time()
                names = os.listdir(dfd)
                metas = [self._meta(dfd, n) for n in names if META_NAME.fullmatch(n)]
                named = {m.get("trace_file") for m in metas if m is not None}
                # A metadata file that cannot be read (torn, an I/O error) may name any trace: remove none then.
                orphans = None not in metas
                for name in names:
                    m = TEMP_NAME.fullmatch(name)
                    if m is None and (not orphans or name in named or not TRACE_NAME.fullmatch(name)):
                        continue
                    try:
                        mtime = os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mtime
                    except OSError:
                        continue
                    if now - mtime > TEMP_MAX_AGE_SECONDS or (m is not None and _dead(int(m["pid"]), mtime)):
                        self._unlink_own(dfd, name)
        except (UnsafeTraceDir, OSError) as exc:
            return str(exc)
        return None


def _notify(listeners: list[Callable[[dict[str, Any]], None]], meta: dict[str, Any]) -> None:
    for listener in list(listeners):
        try:
            listener(meta)
        except Exception:  # a listener's bug must not fail the capture that is being stored
            pass


def _meta_names(dfd: int) -> list[str]:
    """Metadata file names in the directory, newest first (ids are time-ordered)."""
    return sorted((n for n in os.listdir(dfd) if META_NAME.fullmatch(n)), reverse=True)


def _dead(pid: int, mtime: float) -> bool:
    """Whether the process that wrote a temp file of ``pid`` last at ``mtime`` (Unix seconds) is gone."""
    if pid == os.getpid():
        return mtime < _BORN  # an earlier process's, under the same pid; this one's own are in use
    return not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, another user's
    return True
