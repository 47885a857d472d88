"""The client side of an agent's control API, as ``perfmon profile``, ``profiles`` and ``diff`` use it.

One request, one answer (``Transport``; ``http_request`` is the real one): a total deadline for the whole
exchange however slowly the agent trickles bytes (``_DeadlineSocket``), no redirect followed (the token goes to
the URL given only), nothing decoded, and a size cap on every body (``ANSWER_MAX_BYTES`` of JSON; a trace,
``TRACE_MAX_BYTES``, streamed to disk by ``download``). The agent is not trusted: what it says reaches an error
message only through ``clean``, which the CLI uses for everything it prints too (it lives here, the lower of the
two modules, because these errors quote the agent). No argument parsing, no output: that is ``perfmon.cli``.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import re
import reprlib
import socket
import ssl
import time
import urllib.parse
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol

from .config import SENDABLE_TOKEN
from .store.files import replacing_at, temp_name

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer, WriteableBuffer

__all__ = ["ANSWER_MAX_BYTES", "SENDABLE_TOKEN", "TRACE_MAX_BYTES", "ControlError", "TimedOut", "Transport", "clean",
           "download", "http_request", "json_object", "remaining", "url_problem"]


#: The largest JSON answer read from an agent. A capture's metadata is tens of KiB (at most 4 MiB on the agent's
#: disk, ``perfmon.store.traces.META_MAX_BYTES``) and a listing of the 20 kept captures a few KiB: past this the
#: agent is broken or hostile, and reading on would only cost memory (a 400 MB answer read whole took +760 MiB of
#: RSS; now +0 MiB announced, +7 MiB unannounced). Parsed, 8 MiB of ``{},`` still takes ~210 MiB: JSON's worst case.
ANSWER_MAX_BYTES = 8 * 2**20
#: The largest trace ``perfmon profile`` downloads (streamed to disk, never held): the bound of a download from
#: the fleet's store (``perfmon.store.remote.REMOTE_TRACE_MAX_BYTES``); a capture's own is ``capture_max_bytes``.
TRACE_MAX_BYTES = 2 * 2**30
#: An error answer is read up to this much (its message is cut far shorter) and the rest left unread.
_ERROR_MAX_BYTES = 64 * 2**10
#: Bodies are read in pieces of this size, so memory follows the limit, not the agent's Content-Length.
_CHUNK = 2**16


#: Terminal escape sequences: CSI (ESC [ ... final, or the C1 CSI), OSC / DCS / SOS / PM / APC strings up to
#: their terminator (BEL or ST; an unterminated one runs to the end of the text), and two-character ESC
#: sequences. A capture's fields come from an agent or a store that may be hostile or corrupt; printed raw,
#: these would retitle the window, clear the screen, hide text or forge lines.
_ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]?|\x9b[0-?]*[ -/]*[@-~]?"
                      r"|(?:\x1b[\]P^_X]|[\x90\x98\x9d\x9e\x9f])[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?"
                      r"|\x1b[ -/]*[0-~]?")
#: What is left after the sequences: C0 controls (newline, CR, BS... too: a field is one line), DEL, C1
#: controls, and the bidirectional overrides and isolates that make text display in another order.
_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


#: Non-text values (a list where a name was expected...) are shown through a bounded repr: ``str()`` of a list
#: nested 900 deep, as JSON allows, raises RecursionError, and of a long one prints megabytes.
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 200, 200


def clean(value: Any, limit: int | None = None) -> str:
    """``value`` as text safe to print on a terminal: escape sequences and control characters removed, then cut
    to ``limit`` characters (a megabyte-long field must not flood the listing). The one gate for everything an
    agent or a store says: every such string the CLI prints passes through here."""
    text = value if isinstance(value, str) else str(value) if isinstance(value, BaseException) else _REPR.repr(value)
    if limit is not None:
        text = text[: limit * 8 + 256]  # bound the work; what is cut would not be shown anyway
    text = _CONTROLS.sub("", _ESCAPES.sub("", text))
    return text if limit is None else text[:limit]


def url_problem(url: str) -> str | None:
    """Why ``url`` is not an agent's URL (http or https, a host, no credentials, query, fragment, controls, spaces),
    or None."""
    if _CONTROLS.search(url) or " " in url:
        return "control characters or spaces"
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 -- raises ValueError for a port past 65535 or not a number
    except ValueError as exc:
        return f"not a URL ({exc})"
    if parts.scheme not in ("http", "https"):
        return "not an http:// or https:// URL"
    if "@" in parts.netloc:  # never echoed: it may be a password
        return "credentials in the URL (put the token in $PERFMON_TOKEN)"
    if not parts.hostname:
        return "no host"
    if parts.query or parts.fragment or url.endswith(("?", "#")):
        return "a query or fragment (the CLI appends the API's paths)"
    return None




class ControlError(Exception):
    """The agent refused, could not be reached or answered something unusable; the message says why."""


class TimedOut(ControlError):
    """The exchange did not end by its deadline."""


class Transport(Protocol):
    """How the CLI talks to an agent: one request, one answer.

    ``transport(url, *, token, method="GET", payload=None, timeout=30.0, max_bytes=ANSWER_MAX_BYTES, sink=None)
    -> (status, headers, body)``: ``payload`` is sent as a JSON body; ``token`` as a bearer token; ``timeout``
    bounds the whole exchange; a body over ``max_bytes`` is refused; with ``sink`` (a binary file) the body is
    written there as it arrives and ``b""`` returned (a transport that returns it anyway has it written by the
    caller). An answer the agent refused (HTTP >= 400), a redirect, or a request that could not be made raises
    ``ControlError`` saying why. ``http_request`` is the real one; tests pass a plain function that answers from
    a script, so the client side is exercised against any agent, hostile ones included, without a server.
    """

    def __call__(self, url: str, *, token: str | None, method: str = "GET", payload: Any = None,
                 timeout: float = 30.0, max_bytes: int = ANSWER_MAX_BYTES,
                 sink: BinaryIO | None = None) -> tuple[int, dict[str, str], bytes]: ...


def _left(deadline: float) -> float:
    """Seconds until ``deadline`` (``time.monotonic()``); ``TimeoutError`` once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    return left


class _DeadlineSocket(socket.socket):
    """A socket whose every send and receive may take only what is left until ``deadline``: a timeout per
    operation alone restarts with every byte, so an agent sending one byte a second would hold ``--timeout 2``
    for as long as it liked."""

    deadline = math.inf

    def recv_into(self, buffer: WriteableBuffer, nbytes: int = 0, flags: int = 0) -> int:
        self.settimeout(_left(self.deadline))
        return super().recv_into(buffer, nbytes, flags)

    def sendall(self, data: ReadableBuffer, flags: int = 0) -> None:
        self.settimeout(_left(self.deadline))
        super().sendall(data, flags)


class _DeadlineSSLSocket(ssl.SSLSocket):
    """``_DeadlineSocket`` for https (the handshake is bounded by the timeout set before it: ssl applies a socket
    timeout to a whole call)."""

    deadline = math.inf

    def recv_into(self, buffer: WriteableBuffer, nbytes: int | None = None, flags: int = 0) -> int:
        self.settimeout(_left(self.deadline))
        return super().recv_into(buffer, nbytes, flags)

    def sendall(self, data: ReadableBuffer, flags: int = 0) -> None:
        self.settimeout(_left(self.deadline))
        super().sendall(data, flags)


class _Connection(http.client.HTTPConnection):
    """http.client over a ``_DeadlineSocket`` (TLS for https): the connection, the request and the answer all end
    by ``deadline``. No proxy: the agent is reached directly (as with ``kubectl port-forward``)."""

    def __init__(self, host: str, port: int | None, *, deadline: float, tls: bool) -> None:
        super().__init__(host, port or (443 if tls else 80))
        self.default_port = 443 if tls else 80  # the Host header names a port only when it is not the default
        self._deadline, self._tls = deadline, tls

    def connect(self) -> None:
        error: OSError = OSError(f"{self.host}: no address")
        for family, kind, proto, _, address in socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)[:8]:
            sock = _DeadlineSocket(family, kind, proto)
            sock.deadline = self._deadline
            try:
                sock.settimeout(_left(self._deadline))
                sock.connect(address)
                if self._tls:
                    context = ssl.create_default_context()
                    context.sslsocket_class = _DeadlineSSLSocket
                    tls = context.wrap_socket(sock, server_hostname=self.host)
                    tls.deadline = self._deadline  # type: ignore[attr-defined]  # our sslsocket_class
                    self.sock = tls
                else:
                    self.sock = sock
                return
            except OSError as exc:  # the next address (IPv4 after IPv6...), while time is left
                sock.close()
                error = exc
        raise error


def http_request(url: str, *, token: str | None, method: str = "GET", payload: Any = None, timeout: float = 30.0,
                 max_bytes: int = ANSWER_MAX_BYTES, sink: BinaryIO | None = None) -> tuple[int, dict[str, str], bytes]:
    """The real ``Transport``: one HTTP/1.1 exchange (http.client) that ends within ``timeout`` seconds in all
    (connect, request, head, body), follows no redirect, decodes nothing (no gzip: what is read is what is
    counted) and reads the body in ``_CHUNK`` pieces up to ``max_bytes`` (into ``sink`` when given).

    Redirects are refused rather than followed without the token: the agent never redirects (``http/routes.py``),
    so one means something else answers on its address, and an answer from wherever it points would be trusted
    as the agent's (its trace written to disk) even with no credential sent. ``--url`` can name the final address.
    """
    what = f"{method} {clean(url, 200)}"
    problem = url_problem(url)
    if problem is not None:
        raise ControlError(f"{method}: not an agent's URL: {problem}")
    deadline = time.monotonic() + timeout
    parts = urllib.parse.urlsplit(url)
    data = None if payload is None else json.dumps(payload).encode()
    # X-Perfmon: with no token the agent serves its control routes only to requests carrying it (a web
    # page cannot send it cross-site without a CORS preflight the agent never grants).
    headers = {"User-Agent": "perfmon-cli", "Accept": "application/json", "X-Perfmon": "1"}
    if data is not None:
        headers["Content-Type"] = "application/json"
    if token:
        headers["Authorization"] = f"Bearer {token}"
    conn = _Connection(parts.hostname or "", parts.port, deadline=deadline, tls=parts.scheme == "https")
    try:
        conn.request(method, parts.path or "/", body=data, headers=headers)
        r = conn.getresponse()
        if 300 <= r.status < 400:
            raise ControlError(f"{what}: HTTP {r.status}: a redirect (to {clean(r.getheader('Location'), 200)}), "
                               "not followed: the token goes to --url only (give --url the final address)")
        if r.status >= 400:
            raise ControlError(f"{what}: HTTP {r.status}: {_agent_error(r.read(_ERROR_MAX_BYTES))}")
        if r.status < 200:
            raise ControlError(f"{what}: HTTP {r.status}: not an answer")
        return r.status, dict(r.getheaders()), _read_body(r, max_bytes, sink, what)
    except TimeoutError:
        raise TimedOut(f"{what}: no complete answer in time") from None
    except (OSError, http.client.HTTPException, ValueError) as exc:  # refused, reset, not HTTP, header limits...
        raise ControlError(f"{what}: {type(exc).__name__}: {clean(exc, 200)}") from None
    finally:
        conn.close()


def _size(n: int) -> str:
    return f"{n / 2**30:g} GiB" if n >= 2**30 else f"{n / 2**20:g} MiB"


def _read_body(r: http.client.HTTPResponse, limit: int, sink: BinaryIO | None, what: str) -> bytes:
    """The body in ``_CHUNK`` pieces, into ``sink`` (``b""`` returned) or memory: ``ControlError`` when its
    Content-Length is malformed or over ``limit``, when more than ``limit`` bytes come, or fewer than announced."""
    lengths = r.msg.get_all("Content-Length") or []
    if any(not v.strip().isdigit() for v in lengths) or len({v.strip() for v in lengths}) > 1:
        raise ControlError(f"{what}: malformed Content-Length {clean(lengths, 60)}")
    if r.length is not None and r.length > limit:
        raise ControlError(f"{what}: the answer is {r.length} bytes, over the CLI's limit of {_size(limit)}")
    chunks: list[bytes] = []
    total = 0
    while True:  # ends: each pass reads >= 1 byte of at most limit + 1, and every read is bounded by the deadline
        chunk = r.read(min(_CHUNK, limit + 1 - total))
        if not chunk:
            break
        total += len(chunk)
        if total > limit:
            raise ControlError(f"{what}: the answer is over the CLI's limit of {_size(limit)}; not read further")
        if sink is not None:
            sink.write(chunk)
        else:
            chunks.append(chunk)
    if r.length:  # bytes the Content-Length promised that the connection never brought
        raise ControlError(f"{what}: the answer was cut short ({total} bytes, {r.length} more announced)")
    return b"".join(chunks)


def _agent_error(body: bytes) -> str:
    """What an error answer says: its JSON ``error`` (and ``detail``) when they are text, else its first
    characters; cleaned and cut either way."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        data = None
    if isinstance(data, dict) and isinstance(data.get("error"), str):
        detail = data.get("detail")
        return clean(data["error"], 300) + (f" ({clean(detail, 300)})" if isinstance(detail, str) and detail else "")
    return clean(body[:200].decode("utf-8", "replace"), 200) or "(no message)"


def json_object(body: bytes, what: str) -> dict[str, Any]:
    """The JSON object an agent answered, or ``ControlError``: a body that is not JSON (or nests past the
    parser's depth, a ``RecursionError``) or not an object is a broken or hostile agent, not a traceback."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        raise ControlError(f"{what}: the agent's answer is not JSON ({len(body)} bytes: {clean(body[:24])})") from None
    if not isinstance(data, dict):
        raise ControlError(f"{what}: the agent's answer is not a JSON object ({clean(data, 40)})")
    return data


def remaining(deadline: float) -> float:
    """Seconds until ``deadline`` (``time.monotonic()``), 0 once it has passed."""
    return max(deadline - time.monotonic(), 0.0)


def download(transport: Transport, url: str, target: Path, *, token: str | None, timeout: float) -> int:
    """Stream a trace into ``target`` (a 0600 temp file beside it, renamed over it when whole: never written
    through a link there, never left half-written); its size in bytes."""
    try:
        dir_fd = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise ControlError(f"cannot write the trace to {clean(str(target), 200)}: {exc.strerror or exc}") from None
    try:
        with replacing_at(dir_fd, temp_name("trace"), target.name) as f:
            _, _, rest = transport(url, token=token, timeout=timeout, max_bytes=TRACE_MAX_BYTES, sink=f)
            f.write(rest)
            return int(f.tell())
    except OSError as exc:  # the disk is full, --out names a directory...
        raise ControlError(f"cannot write the trace to {clean(str(target), 200)}: {exc.strerror or exc}") from None
    finally:
        os.close(dir_fd)
