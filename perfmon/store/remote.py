"""The store itself (any fsspec URL) and the fleet's view of it: opening it, its layout, listing every pod's
captures and downloading one (``perfmon profiles --store``), and finding the traces a crash left unlisted.

The store is written by every pod of the fleet and may be writable by more than perfmon (a shared
bucket, a hand-made file:// tree), so nothing read from it is trusted: a metadata object is capped in
size and checked field by field before it is listed, and a download writes only perfmon's own names,
only regular files of the store, never more than a cap, and never through a link already in --out.
The layout (``capture_key``) is what the uploader (``uploader.py``) writes and everything here reads.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import stat
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from ..backoff import backoff_seconds
from ..exceptions import ConfigError
from .files import TRACE_NAME, replacing_at, valid_id

__all__ = [
    "LIST_READ_TRIES", "LIST_RETRY_SECONDS", "REMOTE_META_MAX_BYTES", "REMOTE_TRACE_MAX_BYTES", "capture_key",
    "check_usable", "download_remote", "iso_seconds", "list_remote", "open_store", "orphan_traces", "redact",
    "scrub", "written_at",
]

_FOLDER = re.compile(r"^(?P<stamp>[0-9]{8}T[0-9]{6}Z)-(?P<id>[0-9a-f]{22})$")
#: A metadata object bigger than this is not one perfmon wrote (``TraceStore`` keeps them well under it):
#: the listing skips it unread, a download refuses it.
REMOTE_META_MAX_BYTES = 2**20
#: A download refuses a trace bigger than this (a capture's trace is bounded by ``capture_max_bytes``,
#: far below it): a hostile or corrupt object must not fill the disk of whoever fetches it.
REMOTE_TRACE_MAX_BYTES = 2 * 2**30
#: Reads of listed metadata objects that failed (not "not found"): tries in all, and the pause before the first
#: retry (doubled for the next: 0.5 s, then 1 s).
LIST_READ_TRIES = 3
LIST_RETRY_SECONDS = 0.5
_CHUNK = 4 * 2**20
#: Listed fields shown by ``perfmon profiles --store`` or used by its filters: each a string or null.
_TEXT_FIELDS = ("model", "host", "trigger", "status", "outcome", "armed_at", "ended_at")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def redact(url: str) -> str:
    """``url`` without user-info, query or fragment: what may be logged or shown."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable URL>"
    netloc = parts.hostname or ""
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def _part(value: Any, default: str) -> str:
    """One key segment: [A-Za-z0-9._-], at most 100 characters, never empty, never a dot-name."""
    text = _UNSAFE.sub("-", value if isinstance(value, str) else "")[:100].lstrip(".")
    return text or default


def capture_key(meta: dict[str, Any]) -> str | None:
    """The capture's folder under the store's prefix, ``{model}/{host}/{worker}/{YYYYmmddTHHMMSSZ}-{id}``;
    None when the metadata has no valid id. A function of the metadata alone, so every retry, restart or
    sibling process computes the same key (time from the id, which starts with its ``time_ns``)."""
    cid = meta.get("id")
    if not isinstance(cid, str) or not valid_id(cid):
        return None
    stamp = datetime.fromtimestamp(int(cid[:16], 16) / 1e9, tz=timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    host = _part(meta.get("host"), "host")
    worker = meta.get("worker")
    trace = meta.get("trace_file")
    if not isinstance(worker, str) and isinstance(trace, str):
        worker = trace.split(".", 1)[0]  # {worker}.{time_ns}.pt.trace.json.gz, as torch names it
    return f"{_part(meta.get('model'), 'unknown')}/{host}/{_part(worker, host)}/{stamp}-{cid}"


def open_store(url: str, *, timeout_seconds: float = 30.0) -> tuple[Any, str]:
    """(fsspec filesystem, root path) for ``url``; a private instance with timeouts set where the SDK has them.

    Raises ``ConfigError`` when fsspec or the protocol's package is missing. For S3 the SDK's own retries
    are off (one try, ``timeout_seconds`` to connect and to read): retrying is the uploader's, with its
    backoff. These bound the SDK's connects and reads, not a request: an S3 PUT (``Expect: 100-continue``)
    to an endpoint that accepts and never answers outlived both, so the uploader puts its own deadline on
    every call (``calls.StoreCalls``). For GCS a request gets ``timeout_seconds`` to connect and to read
    and ten times that in all, and the bucket-layout lookup ``timeout_seconds``; gcsfs's own retries of a
    refused or failed request (six tries, 1-16 s apart) stay: they are fixed when its class is defined.
    """
    protocol = check_usable(url)
    from fsspec.core import url_to_fs

    options: dict[str, Any] = {"skip_instance_cache": True}
    if protocol in ("s3", "s3a"):
        options["config_kwargs"] = {"connect_timeout": timeout_seconds, "read_timeout": timeout_seconds,
                                    "retries": {"max_attempts": 1}}
    elif protocol in ("gs", "gcs"):
        # gcsfs hands requests_timeout to aiohttp as it is (default: aiohttp's 5 minutes for a whole request)
        # and does not retry a request that timed out: bound connecting and each read like S3's, and the
        # whole request (a trace body included, up to 50 MiB a request) by ten of them.
        options["requests_timeout"] = _aiohttp_timeout(timeout_seconds)
        # Its default class first looks up the bucket's layout over gRPC, retrying for up to 60 s.
        options["retry_timeout"] = timeout_seconds
    elif protocol in ("file", "local"):
        options["auto_mkdir"] = True
    fs, root = url_to_fs(url, **options)
    if protocol in ("s3", "s3a") and hasattr(fs, "retries"):
        fs.retries = 1  # s3fs's own retry loop (5 tries by default) would multiply an attempt's length
    return fs, str(root).rstrip("/")


def _aiohttp_timeout(seconds: float) -> Any:
    """An ``aiohttp.ClientTimeout`` (connect and read ``seconds``, all ``10 * seconds``), or ``seconds``."""
    try:
        import aiohttp
    except ImportError:
        return seconds
    return aiohttp.ClientTimeout(total=10 * seconds, sock_connect=seconds, sock_read=seconds)

def check_usable(url: str) -> str:
    """The URL's protocol; ``ConfigError`` when fsspec or the protocol's package is missing. Builds nothing."""
    try:
        import fsspec
        from fsspec.core import split_protocol
    except ImportError:
        raise ConfigError("trace_store needs fsspec: pip install 'perfmon[s3]' (or fsspec and your store's "
                          "package)") from None
    protocol, _ = split_protocol(url)
    if not protocol:
        raise ConfigError(f"trace_store={redact(url)!r}: expected a URL such as s3://bucket/prefix")
    try:
        fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError) as exc:
        extra = " (pip install 'perfmon[s3]')" if protocol in ("s3", "s3a") else ""
        raise ConfigError(f"trace_store {protocol}:// is not usable here{extra}: {exc}") from None
    return str(protocol)


def scrub(text: str, url: str) -> str:
    """An SDK's error message with the configured URL replaced by its redaction, and any piece of its user-info or
    query that the SDK quoted on its own (s3fs names ``AKID:SECRET@bucket`` as the bucket) by ``<redacted>``."""
    if not url:
        return text
    text = text.replace(url, redact(url))
    try:
        parts = urlsplit(url)
        userinfo = parts.netloc.rpartition("@")[0]
        pieces = {userinfo, parts.username or "", parts.password or "", parts.query}
    except ValueError:
        return text
    for piece in sorted({q for p in pieces for q in (p, unquote(p)) if len(q) >= 4}, key=len, reverse=True):
        text = text.replace(piece, "<redacted>")  # longest first: a password inside the user-info goes with it
    return text


def _relative(path: str, root: str) -> str:
    return path[len(root) + 1:] if path.startswith(root + "/") else path.lstrip("/")


def _check_bucket(fs: Any, root: str, url: str) -> None:
    """``LookupError`` when the bucket of a listing that found nothing does not exist: a typo, not a fleet without
    captures. Only a clear "not found" counts: a role allowed to list a prefix may not read the bucket itself (a
    403), a probe may fail, and such a listing's empty answer stands."""
    bucket = root.strip("/").split("/", 1)[0]
    if not bucket:
        return
    try:
        fs.info(bucket)
    except FileNotFoundError:
        raise LookupError(f"{redact(url)}: no such bucket") from None
    except Exception:  # no access to the bucket's own metadata, throttled, ...: the listing said what it could
        pass


def _bucketed(fs: Any) -> bool:
    """An object store whose path starts with a bucket or container (S3, GCS, Azure)."""
    return bool(_protocols(fs) & {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl"})


def _is_local(fs: Any) -> bool:
    """fsspec's local filesystem (``file://``), where a store is a directory that must exist."""
    return bool(_protocols(fs) & {"file", "local"})


def _protocols(fs: Any) -> set[str]:
    protocol = getattr(fs, "protocol", ())
    return {protocol} if isinstance(protocol, str) else set(protocol)


def _regular(fs: Any, path: str, info: Any, root: str) -> bool:
    """Whether ``path`` is a regular file of the store, not reached through a link. fsspec's local
    ``info`` reports a link's *target* type, so a local store is checked on the file system itself:
    the object must not be a link and must resolve inside the store's root."""
    if not isinstance(info, dict) or info.get("type") != "file":
        return False
    if _is_local(fs):
        local = str(fs._strip_protocol(path))
        if info.get("islink") or os.path.islink(local):
            return False
        real_root = os.path.realpath(str(fs._strip_protocol(root)))
        return os.path.realpath(local).startswith(real_root.rstrip("/") + "/")
    return True


def _listing_entry(meta: Any, cid: str, key: str) -> dict[str, Any] | None:
    """A listed capture: the metadata with ``id`` and ``key`` from its folder, or None when malformed.

    The folder's name is what the store is indexed by (and what ``--download`` takes), so the id comes
    from it whatever the metadata says; each field the listing shows or filters on must have the type
    perfmon writes (a string or null; ``steps_recorded`` a count; ``comparison`` an object of strings),
    so one hand-edited object cannot break the listing of the others."""
    if not isinstance(meta, dict):
        return None
    for name in _TEXT_FIELDS:
        if not isinstance(meta.get(name), (str, type(None))):
            return None
    steps = meta.get("steps_recorded", 0)
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        return None
    comparison = meta.get("comparison")
    if comparison is not None:
        if not isinstance(comparison, dict):
            return None
        if not all(isinstance(comparison.get(k), (str, type(None))) for k in ("baseline", "summary", "error")):
            return None
    return {**meta, "id": cid, "key": key}


def list_remote(url: str, *, model: str | None = None, host: str | None = None, trigger: str | None = None,
                since: float | None = None, limit: int = 100, fs: Any = None, root: str | None = None,
                on_skip: Callable[[str, str], None] | None = None,
                meta_max_bytes: int = REMOTE_META_MAX_BYTES,
                retry_seconds: float = LIST_RETRY_SECONDS, timeout_seconds: float = 30.0) -> list[dict[str, Any]]:
    """Captures in the store, newest first: each one's metadata plus ``key`` (its folder under the prefix).

    ``model`` and ``host`` match the key's segments (as ``capture_key`` spells them), ``since`` is Unix
    seconds (from the capture id's time), ``trigger`` is read from the metadata; at most ``limit``.
    Only metadata objects are read (in batches), never traces. ``id`` is the folder's (the metadata's own is
    not trusted). A metadata object that is not a regular file, is over ``meta_max_bytes`` (by default
    ``REMOTE_META_MAX_BYTES``), is not a JSON object or has a listed field of the wrong type (``_listing_entry``)
    is skipped, and ``on_skip(key, reason)`` called for it. A metadata read that fails is retried
    (``LIST_READ_TRIES`` tries, ``retry_seconds`` then doubling between them) before it is skipped. Raises
    ``LookupError`` for a local directory or an object store's bucket that does not exist. ``timeout_seconds``: the
    SDK's connect and read timeouts (``open_store``).
    """
    if fs is None or root is None:
        fs, root = open_store(url, timeout_seconds=timeout_seconds)
    if _is_local(fs) and not fs.isdir(root):  # a typo, not an empty store (an object store's prefix has no folder)
        raise LookupError(f"{redact(url)}: no such directory")
    pattern = f"{root}/{_part(model, '*') if model else '*'}/{_part(host, '*') if host else '*'}/*/*/*.meta.json"

    def skip(key: str, reason: str) -> None:
        if on_skip is not None:
            on_skip(key, reason)

    found = []
    for path, info in fs.glob(pattern, detail=True).items():
        parts = _relative(str(path), root).split("/")
        if len(parts) != 5:
            continue
        m = _FOLDER.fullmatch(parts[3])
        if m is None or parts[4] != f"{m['id']}.meta.json":
            continue
        if since is not None and int(m["id"][:16], 16) / 1e9 < since:
            continue
        key = "/".join(parts[:4])
        if not _regular(fs, str(path), info, root):
            skip(key, "not a regular file")
            continue
        size = info.get("size")
        if isinstance(size, int) and size > meta_max_bytes:
            skip(key, f"{size} bytes, over {meta_max_bytes}")
            continue
        found.append((m["id"], key, str(path)))
    if not found and _bucketed(fs):
        _check_bucket(fs, root, url)
    found.sort(reverse=True)  # ids start with time_ns: newest first
    out: list[dict[str, Any]] = []
    for start in range(0, len(found), 32):
        batch = found[start:start + 32]
        bodies = _read_all(fs, [p for _, _, p in batch], retry_seconds)
        for cid, key, path in batch:
            body = bodies.get(path)
            if body is None:
                continue  # removed since the listing: not malformed, just gone
            if isinstance(body, Exception):  # still failing after the retries: say so, never drop it silently
                skip(key, f"unreadable: {type(body).__name__}: {scrub(str(body), url)}"[:300])
                continue
            if len(body) > meta_max_bytes:  # grown since the listing said its size
                skip(key, f"over {meta_max_bytes} bytes")
                continue
            try:
                meta = json.loads(body)
            except (ValueError, RecursionError):  # RecursionError: "[[[[..." nested past the parser's depth
                skip(key, "not JSON")
                continue
            entry = _listing_entry(meta, cid, key)
            if entry is None:
                skip(key, "not a perfmon metadata object (a field of the wrong type)")
                continue
            if trigger is not None and entry.get("trigger") != trigger:
                continue
            out.append(entry)
            if len(out) >= limit:
                return out
    return out


def _read_all(fs: Any, paths: list[str], retry_seconds: float) -> dict[str, bytes | Exception]:
    """``fs.cat`` of ``paths``: bytes, or the exception that still stood after ``LIST_READ_TRIES`` tries;
    objects gone since the listing are left out. The stores are opened with the SDK's own retries off
    (the uploader's backoff retries), so a listing retries here: one transient error (a reset, a 5xx)
    once dropped a capture from the fleet listing silently (found by a loaded test run against moto)."""
    out: dict[str, bytes | Exception] = {}
    todo = list(paths)
    for attempt in range(LIST_READ_TRIES):
        if attempt:
            time.sleep(backoff_seconds(attempt, initial=retry_seconds, cap=5.0))
        got = fs.cat(todo, on_error="return") if todo else {}
        failed = []
        for path in todo:
            body = got.get(path)
            if isinstance(body, FileNotFoundError):
                continue  # gone since the listing
            if isinstance(body, Exception):
                failed.append(path)
                out[path] = body
            elif isinstance(body, (bytes, bytearray)):
                out[path] = bytes(body)
        todo = failed
        if not todo:
            break
    return out


def download_remote(url: str, capture_id: str, out_dir: str, *, fs: Any = None, root: str | None = None,
                    on_skip: Callable[[str, str], None] | None = None,
                    trace_max_bytes: int = REMOTE_TRACE_MAX_BYTES,
                    meta_max_bytes: int = REMOTE_META_MAX_BYTES, timeout_seconds: float = 30.0) -> list[str]:
    """Fetch one capture's objects (trace and metadata) into ``out_dir``; returns the local paths written.

    Only names perfmon writes are fetched (``{id}.meta.json`` and trace names), only regular files of the
    store (a link or a directory under such a name is skipped, ``on_skip(key/name, reason)`` called), the
    metadata last. Each lands under a fresh 0600 temp name in ``out_dir`` (``O_EXCL | O_NOFOLLOW``) and is
    renamed onto its name, which replaces a regular file already there (a download again is idempotent)
    but is refused when the name is a link, a directory or anything else: a link planted in a shared
    ``out_dir`` is never written through.

    Raises ``LookupError`` when the store has no capture with that id or has it under more than one key
    ("ambiguous id"), ``ValueError`` for a malformed id, an object over its cap (``trace_max_bytes``,
    ``meta_max_bytes``: by default ``REMOTE_TRACE_MAX_BYTES``, ``REMOTE_META_MAX_BYTES``) or a name in ``out_dir``
    that is not a regular file.
    """
    if not valid_id(capture_id):
        raise ValueError(f"not a capture id: {capture_id[:80]!r}")
    if fs is None or root is None:
        fs, root = open_store(url, timeout_seconds=timeout_seconds)
    meta_name = f"{capture_id}.meta.json"
    folders: dict[str, dict[str, str]] = {}  # key -> {name: path}, regular files with perfmon's names only
    for path, info in sorted(fs.glob(f"{root}/*/*/*/*-{capture_id}/*", detail=True).items()):
        parts = _relative(str(path), root).split("/")
        if len(parts) != 5:
            continue
        m = _FOLDER.fullmatch(parts[3])
        name = parts[4]
        if m is None or m["id"] != capture_id or not (name == meta_name or TRACE_NAME.fullmatch(name)):
            continue  # only names perfmon writes: a planted "../x" never becomes a local path
        key = "/".join(parts[:4])
        if not _regular(fs, str(path), info, root):
            if on_skip is not None:
                on_skip(f"{key}/{name}", "not a regular file")
            continue
        folders.setdefault(key, {})[name] = str(path)
    keys = sorted(k for k, objects in folders.items() if meta_name in objects)
    if not keys:
        raise LookupError(f"no capture {capture_id} in {redact(url)}")
    if len(keys) > 1:  # which one is meant cannot be told; writing both would overwrite one with the other
        raise LookupError(f"ambiguous id {capture_id}: in {redact(url)} under {' and '.join(keys)}")
    objects = folders[keys[0]]
    os.makedirs(out_dir, exist_ok=True)
    dfd = os.open(out_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    written = []
    try:
        for name in sorted(objects, key=lambda n: (n == meta_name, n)):  # the metadata last, as uploaded
            cap = meta_max_bytes if name == meta_name else trace_max_bytes
            _fetch_to(fs, objects[name], f"{keys[0]}/{name}", dfd, name, cap, local=_is_local(fs))
            written.append(os.path.join(out_dir, name))
    finally:
        os.close(dfd)
    return written


def _open_source(fs: Any, path: str, what: str, cap: int, local: bool) -> Any:
    """A binary reader of a store object after checking its size against ``cap``; a local one is opened
    with ``O_NOFOLLOW`` and checked regular on its descriptor (no swap between the check and the read)."""
    if local:
        fd = os.open(str(fs._strip_protocol(path)), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise ValueError(f"{what} is not a regular file; refusing it")
        size: Any = st.st_size
        os.set_blocking(fd, True)
        reader: Any = os.fdopen(fd, "rb")
    else:
        size = fs.info(path).get("size")
        reader = None
    if isinstance(size, int) and size > cap:
        if reader is not None:
            reader.close()
        raise ValueError(f"{what} is {size} bytes, over the {cap}-byte limit for it; refusing it")
    return reader if reader is not None else fs.open(path, "rb")


def _fetch_to(fs: Any, path: str, what: str, dfd: int, name: str, cap: int, *, local: bool) -> None:
    """Copy the store object ``path`` to ``name`` in the directory ``dfd``: streamed (at most ``cap`` bytes)
    into a new private temp file, then renamed onto ``name`` unless that is not a regular file."""

    def only_onto_a_regular_file() -> None:
        try:
            st = os.lstat(name, dir_fd=dfd)
        except FileNotFoundError:
            return
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{name} in the download directory is not a regular file (a symbolic link?); "
                             "refusing to replace it: remove it or choose another --out")

    # The rename replaces the entry itself: a link swapped in since the check is replaced, never followed.
    with replacing_at(dfd, f".{name}.{secrets.token_hex(8)}.part", name, before_replace=only_onto_a_regular_file) \
            as out, _open_source(fs, path, what, cap, local) as src:
        total = 0
        while chunk := src.read(_CHUNK):
            total += len(chunk)
            if total > cap:  # the object grew past what its size said, or the store did not say
                raise ValueError(f"{what} is over the {cap}-byte limit for it; refusing it")
            out.write(chunk)


def orphan_traces(fs: Any, root: str, objects: dict[str, Any], *, written_before: float) -> list[str]:
    """Trace objects that no listing shows and nothing else removes: in a capture folder with no metadata
    object, and last written before ``written_before`` (Unix seconds); oldest first.

    ``objects`` is ``fs.find(root, detail=True)`` (path -> info). A crash (a kill, an OOM, a lost node)
    between a capture's two puts leaves its trace without its metadata; the capture goes up whole again only
    if its spool outlives the pod. A trace written within the grace may be an upload in flight, so only
    older ones are returned; one whose time cannot be read is never returned. Only perfmon's own names, in
    perfmon's own layout, as regular files of the store (``_regular``), are considered.
    """
    with_meta: set[str] = set()
    found: list[tuple[float, str, str]] = []
    for path, info in objects.items():
        parts = _relative(str(path), root).split("/")
        if len(parts) != 5:
            continue
        m = _FOLDER.fullmatch(parts[3])
        if m is None:
            continue
        folder = "/".join(parts[:4])
        if parts[4] == f"{m['id']}.meta.json":
            with_meta.add(folder)  # whatever it holds: a malformed one is the listing's to report, not ours to act on
        elif TRACE_NAME.fullmatch(parts[4]):
            written = written_at(info)
            if written is not None and written < written_before and _regular(fs, str(path), info, root):
                found.append((written, folder, str(path)))
    return [path for _, folder, path in sorted(found) if folder not in with_meta]


def written_at(info: Any) -> float | None:
    """When a store object was last written, Unix seconds, from its ``info``/``find`` entry; None if it has no
    such field. Each SDK names it its own way: s3fs ``LastModified`` (a datetime), adlfs ``last_modified``,
    the local store ``mtime`` (seconds), gcsfs ``mtime`` (a datetime; ``updated``, ISO 8601 text, in older
    versions), the memory store ``created``."""
    if not isinstance(info, dict):
        return None
    for name in ("LastModified", "last_modified", "mtime", "updated", "created"):
        value = info.get(name)
        if isinstance(value, datetime):
            return (value if value.tzinfo else value.replace(tzinfo=timezone.utc)).timestamp()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and (seconds := iso_seconds(value)) is not None:
            return seconds
    return None


def iso_seconds(text: Any) -> float | None:
    """ISO 8601 text (UTC unless it says otherwise) as Unix seconds; None for anything else."""
    if not isinstance(text, str):
        return None
    try:
        parsed = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return (parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)).timestamp()
