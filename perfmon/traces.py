"""The trace directory: private, atomic files named like torch's ``tensorboard_trace_handler``.

Files are written to a temp name and renamed, so a crash never leaves a half-written file under its
final name; the directory is created 0700 and files 0600 (traces and allocator snapshots reveal
model structure and input shapes). Names are generated here, never taken from a caller.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

__all__ = ["worker_name", "write_private"]


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
