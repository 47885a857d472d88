"""The trace directory: private, atomic files named like torch's ``tensorboard_trace_handler``.

Files are written to a temp name and renamed, so a crash never leaves a half-written file under its
final name; the directory is created 0700 and files 0600 (traces and allocator snapshots reveal
model structure and input shapes). Names are generated here, never taken from a caller.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["TraceStore", "new_id", "valid_id", "worker_name", "write_private"]


def worker_name() -> str:
    """``{hostname}_{pid}``, the worker part of torch's trace file names."""
    return f"{socket.gethostname()}_{os.getpid()}"


def write_private(directory: Path, name: str, data: bytes) -> Path:
    """Write ``data`` to ``directory/name`` atomically; directory 0700, file 0600."""
    if os.sep in name or name.startswith("."):
        raise ValueError(f"not a plain file name: {name!r}")
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    final = directory / name
    tmp = directory / f".{name}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return final


_ID = re.compile(r"^[0-9a-f]{22}$")


def new_id() -> str:
    """A capture id: time-ordered (16 hex digits of time_ns) plus 6 random hex digits."""
    return f"{time.time_ns():016x}{secrets.token_hex(3)}"


def valid_id(text: str) -> bool:
    """True for ids this store generates; anything else (paths, dots, encodings) is not an id."""
    return bool(_ID.fullmatch(text))


class TraceStore:
    """Captures on disk: ``{id}.meta.json`` (metadata + op summary) and the gzipped Chrome trace.

    The metadata file is written last, so a capture is listed only once everything it names exists.
    Retention keeps at most ``max_files`` captures and ``max_bytes`` of traces; the oldest go first,
    and the newest capture is kept whatever its size.
    """

    def __init__(self, directory: str | os.PathLike[str], *, max_files: int, max_bytes: int) -> None:
        self.directory = Path(directory)
        self.max_files = max_files
        self.max_bytes = max_bytes
        self._lock = threading.Lock()

    def temp_path(self, capture_id: str, suffix: str) -> Path:
        """A private scratch path for an export in progress (dot-prefixed: never listed)."""
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        return self.directory / f".{capture_id}.{suffix}.tmp"

    def save(self, meta: dict[str, Any], trace: bytes | None, trace_name: str | None) -> dict[str, Any]:
        """Write the trace (if any) then the metadata; apply retention; returns the stored metadata."""
        with self._lock:
            if trace is not None and trace_name is not None:
                write_private(self.directory, trace_name, trace)
                meta = {**meta, "trace_file": trace_name, "trace_bytes": len(trace)}
            body = json.dumps(meta, indent=1, sort_keys=True, default=str).encode()
            write_private(self.directory, f"{meta['id']}.meta.json", body)
            self._retain()
        return meta

    def list(self) -> list[dict[str, Any]]:
        """Stored captures, newest first."""
        out = []
        try:
            names = sorted((p.name for p in self.directory.glob("*.meta.json")), reverse=True)
        except OSError:
            return []
        for name in names:
            meta = self.get(name[: -len(".meta.json")])
            if meta is not None:
                out.append(meta)
        return out

    def get(self, capture_id: str) -> dict[str, Any] | None:
        if not valid_id(capture_id):
            return None
        try:
            meta: dict[str, Any] = json.loads((self.directory / f"{capture_id}.meta.json").read_bytes())
        except (OSError, ValueError):
            return None
        return meta

    def trace_path(self, capture_id: str) -> Path | None:
        """The trace file of a stored capture, or None (unknown id, failed capture, file gone)."""
        meta = self.get(capture_id)
        name = meta.get("trace_file") if meta else None
        if not isinstance(name, str) or "/" in name or name.startswith("."):
            return None
        path = self.directory / name
        return path if path.is_file() else None

    def _retain(self) -> None:
        metas = sorted(self.directory.glob("*.meta.json"), key=lambda p: p.name, reverse=True)
        kept_bytes = 0
        for i, meta_path in enumerate(metas):
            try:
                meta = json.loads(meta_path.read_bytes())
            except (OSError, ValueError):
                meta = {}
            size = int(meta.get("trace_bytes") or 0)
            # The newest capture is always kept: the one an operator just asked for must be fetchable.
            if i == 0 or (i < self.max_files and kept_bytes + size <= self.max_bytes):
                kept_bytes += size
                continue
            name = meta.get("trace_file")
            if isinstance(name, str) and "/" not in name and not name.startswith("."):
                (self.directory / name).unlink(missing_ok=True)
            meta_path.unlink(missing_ok=True)

    def sweep_temp(self) -> None:
        """Remove scratch files an interrupted export left behind."""
        for p in self.directory.glob(".*.tmp"):
            p.unlink(missing_ok=True)
