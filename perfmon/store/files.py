"""Safe-file primitives for a directory other local users may reach: checked descriptors, atomic private writes.

The trace directory (``traces.py``) and a download's ``--out`` (``remote.py``) are built on these. The
directory may be shared with other local users (a path in /tmp, a volume), so nothing in it is trusted:

* it must be a real directory, not a symbolic link, owned by this process's user and not writable by
  group or others; otherwise ``open_private_dir`` refuses it with ``UnsafeTraceDir`` (no repair: files
  another user planted while it was open would stay). Symbolic links in its *parent* path are the
  administrator's choice and are followed;
* every file is opened relative to a descriptor of that checked directory (``dir_fd``), with
  ``O_NOFOLLOW``; new files are created ``O_CREAT | O_EXCL`` under unpredictable temp names and moved
  into place with ``os.replace(src_dir_fd=, dst_dir_fd=)``, which replaces a planted link itself,
  never its target; a file is written 0600, a directory created 0700.

Also here: the names perfmon gives its files (torch's ``{worker}.{time_ns}.pt.trace.json.gz``, temp names)
and capture ids, generated here, never taken from a caller.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import secrets
import socket
import stat
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..exceptions import ConfigError

__all__ = [
    "TEMP_NAME", "TRACE_NAME", "UnsafeTraceDir", "host_name", "meta_json", "new_id", "open_private_dir", "open_regular",
    "replacing_at", "temp_name", "valid_id", "worker_name", "write_at", "write_private",
]

#: Trace files: ``{hostname}_{pid}.{time_ns}.pt.trace.json.gz`` as ``worker_name`` spells the hostname.
TRACE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,254}_[0-9]{1,10}\.[0-9]{1,20}\.pt\.trace\.json\.gz$")
#: Temp files: ``.tmp.{pid}.{16 hex}.{suffix}``; the pid says whose they are (see ``TraceStore.sweep_temp``).
TEMP_NAME = re.compile(r"^\.tmp\.(?P<pid>[0-9]{1,10})\.[0-9a-f]{16}\.[a-z.]{1,16}$")

_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # NONBLOCK: a planted FIFO
_OPEN_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafeTraceDir(ConfigError):
    """``trace_dir`` is a symbolic link, not a directory, owned by another user or writable by others."""


def worker_name() -> str:
    """``{hostname}_{pid}``, the worker part of torch's trace file names (hostname reduced to [A-Za-z0-9._-])."""
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:200].lstrip("._-") or "host"
    return f"{host}_{os.getpid()}"


def host_name() -> str:
    """This pod or host, reduced to [A-Za-z0-9._-]: ``POD_NAME`` (the downward API), else ``HOSTNAME``, else
    the kernel's host name. It names a capture's uploads (``perfmon.store.uploader``), so it is stored with
    each capture."""
    raw = os.environ.get("POD_NAME") or os.environ.get("HOSTNAME") or socket.gethostname()
    return re.sub(r"[^A-Za-z0-9._-]", "-", raw)[:200].lstrip("._-") or "host"


def _problem(st: os.stat_result, uid: int) -> str | None:
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    if st.st_uid != uid:
        return f"owned by uid {st.st_uid}, not by this process's uid {uid}"
    if st.st_mode & 0o022:
        return f"writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def open_private_dir(directory: str | os.PathLike[str], *, create: bool, uid: int | None = None) -> int | None:
    """A descriptor of ``directory`` after checking it is safe to use; None if absent and not ``create``.

    ``create`` makes it (and missing parents) first, the directory itself 0700. Raises
    ``UnsafeTraceDir`` for a symbolic link, a non-directory, another owner, or group/other write
    permission; other ``OSError`` as they come. The caller closes the descriptor.
    """
    path = Path(directory)
    uid = os.geteuid() if uid is None else uid
    if create:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
    try:
        fd = os.open(path, _OPEN_DIR)
    except FileNotFoundError:
        if create:
            raise
        return None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            what = "a symbolic link" if path.is_symlink() else "not a directory"
            raise UnsafeTraceDir(f"trace_dir {str(path)!r} is {what}; perfmon refuses it "
                                 "(set trace_dir to a real directory of this user)") from exc
        raise
    try:
        problem = _problem(os.fstat(fd), uid)
    except BaseException:
        os.close(fd)
        raise
    if problem is not None:
        os.close(fd)
        raise UnsafeTraceDir(f"trace_dir {str(path)!r} is {problem}; perfmon refuses it (another local user "
                             f"could plant or swap files there). Fix: `chmod 700` it as its owner, or point "
                             f"trace_dir at a path that does not exist yet: perfmon creates it 0700")
    return fd


def temp_name(suffix: str) -> str:
    """An unpredictable dot-prefixed name (never listed) that ``sweep_temp`` recognises as ours."""
    return f".tmp.{os.getpid()}.{secrets.token_hex(8)}.{suffix}"


@contextmanager
def replacing_at(dir_fd: int, tmp: str, name: str, *,
                 before_replace: Callable[[], None] | None = None) -> Iterator[Any]:
    """A new private (0600) temp file ``tmp`` in the directory ``dir_fd``, opened for the block to write
    (binary). When the block ends cleanly the file is fsynced, ``before_replace`` runs (it may raise to
    refuse) and the file is renamed onto ``name``; on any failure the temp file is removed."""
    fd = os.open(tmp, _OPEN_NEW, 0o600, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        if before_replace is not None:
            before_replace()
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise


def write_at(dir_fd: int, name: str, data: bytes) -> None:
    """Write ``data`` to ``name`` in the directory ``dir_fd`` atomically: a fresh 0600 temp file, fsync, rename."""
    if "/" in name or name.startswith(".") or not name:
        raise ValueError(f"not a plain file name: {name!r}")
    with replacing_at(dir_fd, temp_name("write"), name) as f:
        f.write(data)


def write_private(directory: str | os.PathLike[str], name: str, data: bytes) -> Path:
    """Write ``data`` to ``directory/name`` atomically; directory checked (or created 0700), file 0600."""
    dfd = open_private_dir(directory, create=True)
    assert dfd is not None
    try:
        write_at(dfd, name, data)
    finally:
        os.close(dfd)
    return Path(directory) / name


def open_regular(dir_fd: int, name: str) -> int | None:
    """Open ``name`` for reading if it is a regular file of this user (never through a link); else None."""
    try:
        fd = os.open(name, _OPEN_READ, dir_fd=dir_fd)
    except OSError:
        return None  # absent, a symbolic link (ELOOP), unreadable
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        return None
    os.set_blocking(fd, True)
    return fd


def _read_at(dir_fd: int, name: str, limit: int | None) -> bytes | None:
    fd = open_regular(dir_fd, name)
    if fd is None:
        return None
    with os.fdopen(fd, "rb") as f:
        if limit is not None and os.fstat(f.fileno()).st_size > limit:
            return None
        return f.read()


_ID = re.compile(r"^[0-9a-f]{22}$")


def meta_json(meta: dict[str, Any]) -> bytes:
    """A capture's metadata as strict JSON (the stored and uploaded form): NaN and infinities, which Python
    writes as bare ``NaN`` that other JSON readers refuse, become null; anything else unknown a string."""
    try:
        return json.dumps(meta, indent=1, sort_keys=True, default=str, allow_nan=False).encode()
    except ValueError:  # a non-finite float somewhere: the rare case pays for the walk
        return json.dumps(_finite(meta, 0), indent=1, sort_keys=True, default=str, allow_nan=False).encode()


def _finite(value: Any, depth: int) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if depth > 64:  # metadata is shallow; deeper is not worth keeping
        return None
    if isinstance(value, dict):
        return {str(k): _finite(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v, depth + 1) for v in value]
    return value


def new_id() -> str:
    """A capture id: time-ordered (16 hex digits of time_ns) plus 6 random hex digits."""
    return f"{time.time_ns():016x}{secrets.token_hex(3)}"


def valid_id(text: str) -> bool:
    """True for ids this store generates; anything else (paths, dots, encodings) is not an id."""
    return bool(_ID.fullmatch(text))
