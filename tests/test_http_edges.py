"""The HTTP surface at its edges: HEAD on every route, pipelining, malformed JSON bodies, non-finite JSON values."""

from __future__ import annotations

import asyncio
import gc
import gzip
import json
import os
import socket
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

import perfmon
from perfmon.http.routes import Router
from perfmon.http.wire import Response

from .conftest import http

#: Headers that let a loopback client use the control routes of an agent with no token.
CONTROL = "Host: 127.0.0.1\r\nX-Perfmon: 1\r\n"
#: A capture id as the store names them (22 hex digits) and a trace file name it accepts.
CAPTURE_ID = "0123456789abcdef012345"
TRACE_FILE = "worker_1.1700000000000000000.pt.trace.json.gz"


def _port(mon: Any) -> int:
    return int(mon.url.rsplit(":", 1)[1])


def _exchange(port: int, data: bytes, *, timeout: float = 10) -> bytes:
    """Send ``data`` on one connection and read until the server closes it."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        chunks = []
        for _ in range(10_000):  # bounded: the server closes after the last answer
            chunk = s.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)


def _responses(data: bytes, heads: list[bool]) -> list[tuple[int, dict[str, str], bytes]]:
    """Parse exactly ``len(heads)`` responses (a True one answers a HEAD: no body whatever its
    Content-Length), and nothing may follow the last one."""
    out = []
    for head in heads:
        assert data.startswith(b"HTTP/1.1 "), data[:200]
        end = data.index(b"\r\n\r\n")
        lines = data[:end].decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ")[1])
        headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
        length = 0 if head else int(headers["content-length"])
        out.append((status, headers, data[end + 4:end + 4 + length]))
        data = data[end + 4 + length:]
    assert data == b"", f"bytes after the last answer: {data[:200]!r}"
    return out


def _strict_json(body: bytes) -> Any:
    """JSON as a strict parser reads it: NaN and Infinity are not JSON."""
    def refuse(name: str) -> Any:
        raise AssertionError(f"{name} in a JSON answer")
    return json.loads(body, parse_constant=refuse)


def _store_capture(trace_dir: Path, meta: dict[str, Any], trace: bytes | None = None) -> None:
    """Write a capture as the store lays it out: ``{id}.meta.json`` (raw text, so NaN can be in it) and its trace."""
    trace_dir.mkdir(mode=0o700, exist_ok=True)
    os.chmod(trace_dir, 0o700)
    if trace is not None:
        (trace_dir / TRACE_FILE).write_bytes(trace)
    (trace_dir / f"{CAPTURE_ID}.meta.json").write_text(json.dumps(meta))  # json writes NaN as NaN


@pytest.fixture
def served(make_monitor, tmp_path):
    """An agent on a loopback port, no token, with one stored capture that has a trace."""
    trace_dir = tmp_path / "traces"
    _store_capture(trace_dir, {"id": CAPTURE_ID, "model": "m", "status": "done", "outcome": "ok",
                               "trace_file": TRACE_FILE}, gzip.compress(b'{"traceEvents": []}'))
    return make_monitor(port=0, trace_dir=str(trace_dir)).start()


ROUTES = ["/", "/metrics", "/healthz", "/stats", "/openapi.json", "/profiles", f"/profiles/{CAPTURE_ID}",
          f"/profiles/{CAPTURE_ID}/trace", "/profiles/ffffffffffffffffffffff/trace", "/profile", "/nowhere",
          "/profiles/a/b/c/d"]


@pytest.mark.parametrize("path", ROUTES)
def test_head_answers_have_no_body_and_a_pipelined_get_after_them_is_read_intact(served, path: str) -> None:
    """HEAD then GET /healthz pipelined on one connection: the HEAD answer carries the GET answer's
    status and Content-Length but no body, so the second answer starts right after its headers."""
    port = _port(served)
    get = _responses(_exchange(port, f"GET {path} HTTP/1.1\r\n{CONTROL}Connection: close\r\n\r\n".encode()),
                     [False])[0]
    data = _exchange(port, (f"HEAD {path} HTTP/1.1\r\n{CONTROL}\r\n"
                            f"GET /healthz HTTP/1.1\r\n{CONTROL}Connection: close\r\n\r\n").encode())
    (status, headers, _), (status2, _, body2) = _responses(data, [True, False])
    assert status == get[0] and status2 == 200 and _strict_json(body2)["status"] == "ok"
    if path != "/metrics" and path != "/stats":  # a render's length changes with what it reports
        assert int(headers["content-length"]) == len(get[2]), (path, headers)


def test_head_on_the_health_port_404_has_no_body(make_monitor) -> None:
    """The health port answers anything but /healthz 404, and a HEAD of it without a body."""
    mon = make_monitor(port=None, health_port=0).start()
    port = int(mon.health_url.rsplit(":", 1)[1].split("/")[0])
    (status, headers, _), = _responses(_exchange(port, b"HEAD /nowhere HTTP/1.1\r\nHost: x\r\n\r\n"), [True])
    assert status == 404 and int(headers["content-length"]) > 0


def test_a_refused_head_request_gets_no_body(served) -> None:
    """A HEAD request the parser refuses (a malformed header line) is answered 400, headers only, then closed."""
    (status, headers, _), = _responses(_exchange(_port(served), b"HEAD / HTTP/1.1\r\nno colon here\r\n\r\n"), [True])
    assert status == 400 and headers["connection"] == "close"


def test_odd_methods_get_405_with_allow_and_keep_the_connection(served) -> None:
    """OPTIONS, TRACE, DELETE and a lower-case get are refused 405 naming what is allowed; pipelined requests
    after them are still answered."""
    methods = ["OPTIONS", "TRACE", "DELETE", "get", "PROPFIND"]
    data = "".join(f"{m} /metrics HTTP/1.1\r\nHost: x\r\n\r\n" for m in methods)
    data += "HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\nGET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    answers = _responses(_exchange(_port(served), data.encode()), [False] * len(methods) + [True, False])
    for (status, headers, body), method in zip(answers, methods):
        assert status == 405 and headers["allow"] == "GET, HEAD", method
        assert _strict_json(body)["allowed"] == ["GET", "HEAD"]
    assert [a[0] for a in answers[-2:]] == [200, 200]


NESTED = [b"[" * 16_000, b'{"a":' * 3000, b"[" * 900 + b"]" * 900, b'{"steps": NaN}', b'{"max_seconds": Infinity}',
          b'{"steps": -Infinity}', b"\xff\xfe{}", b'{"steps": ' + b"9" * 5000 + b"}", b"{", b'"text"', b"[1, 2]",
          b'{"model": "m", "model": 1}']


@pytest.mark.parametrize("body", NESTED, ids=lambda b: repr(b[:16]))
def test_malformed_or_deeply_nested_capture_requests_are_400_with_a_message(served, body: bytes) -> None:
    """POST /profile with a body that is not a capture request (deep nesting, NaN/Infinity, not UTF-8, a huge
    integer, not an object): 400 with an error message, never a 500."""
    status, _, answer = http(served.url + "/profile", body, method="POST",
                             headers={"Content-Type": "application/json", "X-Perfmon": "1"})
    assert status == 400, answer[:300]
    assert _strict_json(answer)["error"]


def test_a_stored_capture_with_nan_is_served_as_valid_json(make_monitor, tmp_path) -> None:
    """Metadata holding NaN and infinities (json writes them as NaN/Infinity, which is not JSON) is served
    200 as valid JSON with null in their place, in the capture and in the listing."""
    _store_capture(tmp_path / "traces", {"id": CAPTURE_ID, "model": "m", "status": "done", "outcome": "ok",
                                         "summary": {"p50": float("nan"), "ops": [float("inf"), 1.5]},
                                         "ratio": float("-inf")})
    mon = make_monitor(port=0, trace_dir=str(tmp_path / "traces")).start()
    status, _, body = http(f"{mon.url}/profiles/{CAPTURE_ID}", headers={"X-Perfmon": "1"})
    assert status == 200, body[:300]
    meta = _strict_json(body)
    assert meta["summary"] == {"p50": None, "ops": [None, 1.5]} and meta["ratio"] is None
    status, _, body = http(f"{mon.url}/profiles", headers={"X-Perfmon": "1"})
    assert status == 200 and _strict_json(body)["profiles"][0]["ratio"] is None


def test_many_clients_downloading_one_trace_hold_one_copy_of_it(make_monitor, tmp_path) -> None:
    """Twelve clients ask for one 8 MiB trace and stop reading after its status line: the agent holds the trace once
    (Python's traced memory grows by about one trace, not twelve: one copy a connection was 12 x, and 128 of a
    256 MiB trace 32 GiB), each client still gets it whole once it reads, and the copy is let go after the last."""
    size = 8 * 2**20
    trace = os.urandom(size)  # incompressible: the kernel's socket buffers take only a part of each answer
    _store_capture(tmp_path / "traces", {"id": CAPTURE_ID, "model": "m", "status": "done", "outcome": "ok",
                                         "trace_file": TRACE_FILE}, trace)
    mon = make_monitor(port=0, trace_dir=str(tmp_path / "traces")).start()
    request = f"GET /profiles/{CAPTURE_ID}/trace HTTP/1.1\r\n{CONTROL}Connection: close\r\n\r\n".encode()
    clients: list[socket.socket] = []
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(12):
            s = socket.create_connection(("127.0.0.1", _port(mon)), timeout=30)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
            clients.append(s)
            s.sendall(request)
            assert s.recv(12) == b"HTTP/1.1 200"  # answered, then left unread: the rest waits in the agent
        held = tracemalloc.get_traced_memory()[0] - before
        assert held < 2.5 * size, f"{held / size:.1f} traces held for 12 slow downloads of one"
        for s in clients:
            data = b"HTTP/1.1 200"
            while chunk := s.recv(1 << 20):
                data += chunk
            assert data.partition(b"\r\n\r\n")[2] == trace
        del data, chunk  # (this test's own copy)
        gc.collect()
        assert tracemalloc.get_traced_memory()[0] - before < 0.5 * size
    finally:
        tracemalloc.stop()
        for s in clients:
            s.close()


def test_a_trace_replaced_or_removed_mid_download_is_served_as_it_is_now(make_monitor, tmp_path) -> None:
    """While a slow client still downloads a trace, the file is replaced, then removed: a new request gets the new
    bytes, then a 404 (the shared copy is for identical reads only), and the slow client still gets the old one."""
    old, new = os.urandom(4 * 2**20), os.urandom(2**20)
    trace_dir = tmp_path / "traces"
    _store_capture(trace_dir, {"id": CAPTURE_ID, "model": "m", "status": "done", "outcome": "ok",
                               "trace_file": TRACE_FILE}, old)
    mon = make_monitor(port=0, trace_dir=str(trace_dir)).start()
    request = f"GET /profiles/{CAPTURE_ID}/trace HTTP/1.1\r\n{CONTROL}Connection: close\r\n\r\n".encode()
    with socket.create_connection(("127.0.0.1", _port(mon)), timeout=30) as slow:
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        slow.sendall(request)
        assert slow.recv(12) == b"HTTP/1.1 200"
        (trace_dir / TRACE_FILE).write_bytes(new)
        assert _exchange(_port(mon), request).partition(b"\r\n\r\n")[2] == new
        (trace_dir / TRACE_FILE).unlink()
        assert _exchange(_port(mon), request).startswith(b"HTTP/1.1 404")
        data = b"HTTP/1.1 200"
        while chunk := slow.recv(1 << 20):
            data += chunk
    assert data.partition(b"\r\n\r\n")[2] == old


class _Agent:
    """A fake agent whose views hold what JSON cannot: NaN, infinities, keys of mixed types."""

    def __init__(self, make_monitor: Any) -> None:
        real = make_monitor()
        self.registry, self.config, self.internal, self.cpu = real.registry, real.config, real.internal, real.cpu
        self.odd = {"nan": float("nan"), "inf": [float("inf"), -float("inf")], 1: "an int key", "nested": {2.5: 1.0}}

    def health(self) -> tuple[bool, dict[str, Any]]:
        return True, {"lag": float("nan")}

    def stats(self) -> dict[str, Any]:
        return self.odd

    def profiles(self) -> list[dict[str, Any]]:
        return [self.odd]

    def profile(self, capture_id: str) -> dict[str, Any] | None:
        return self.odd

    def capture(self, model: str | None = None, **kw: Any) -> dict[str, Any]:
        raise LookupError(float("nan"))

    def read_trace(self, capture_id: str) -> tuple[str, bytes] | None:
        return None


def test_every_json_answer_is_valid_json_whatever_the_views_hold(make_monitor) -> None:
    """/stats, /healthz, /profiles and /profiles/{id} of views holding NaN, infinities and mixed-type keys:
    200 with valid JSON (null for the non-finite values), never a 500."""
    router = Router(_Agent(make_monitor), mounted=False)
    router.bound = "127.0.0.1"
    control = {"x-perfmon": "1", "host": "127.0.0.1"}
    for path in ("/stats", "/healthz", "/profiles", f"/profiles/{CAPTURE_ID}"):
        resp = router.handle("GET", path, control, peer="127.0.0.1")
        assert resp.status == 200, (path, resp.body[:300])
        doc = _strict_json(resp.body)
        assert None in (doc.get("nan"), doc.get("lag"), (doc.get("profiles") or [{}])[0].get("nan")), path
    assert _strict_json(Response.json(200, {"x": [float("nan")], 3: {None: 1}}).body) == {"x": [None], "3": {"null": 1}}


def test_a_thousand_pipelined_health_checks_in_one_packet_are_all_answered(served) -> None:
    """900 ``GET /healthz`` sent in one write: 900 answers in order on the same connection, and no internal
    error (taking them recursed once per request and overflowed the stack after ~330, resetting the
    connection and counting an agent fault)."""
    n = 900
    one = b"GET /healthz HTTP/1.1\r\nHost: x\r\n"
    data = (one + b"\r\n") * (n - 1) + one + b"Connection: close\r\n\r\n"
    answers = _responses(_exchange(_port(served), data, timeout=30), [False] * n)
    assert [a[0] for a in answers] == [200] * n
    assert not served.registry.get_sample_value("perfmon_internal_errors_total", {"stage": "http"})


def test_mounted_apps_answer_head_without_a_body(make_monitor) -> None:
    """The WSGI and ASGI apps answer HEAD (a 404 and the page here) with the GET answer's status and
    Content-Length and an empty body, whatever the host server does with HEAD."""
    mon = make_monitor()
    wsgi = perfmon.make_wsgi_app(mon)
    seen: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]]) -> None:
        seen["status"], seen["headers"] = status, dict(headers)

    for path in ("/nowhere", "/"):
        get = b"".join(wsgi({"REQUEST_METHOD": "GET", "PATH_INFO": path}, start_response))
        get_status = seen["status"]
        assert b"".join(wsgi({"REQUEST_METHOD": "HEAD", "PATH_INFO": path}, start_response)) == b""
        assert seen["status"] == get_status and seen["headers"]["Content-Length"] == str(len(get)) != "0"

    async def asgi(method: str, path: str) -> tuple[int, dict[bytes, bytes], bytes]:
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(msg: dict[str, Any]) -> None:
            sent.append(msg)

        await mon.asgi_app({"type": "http", "method": method, "path": path, "headers": []}, receive, send)
        return sent[0]["status"], dict(sent[0]["headers"]), sent[1]["body"]

    status, _, body = asyncio.run(asgi("GET", "/nowhere"))
    head_status, headers, head_body = asyncio.run(asgi("HEAD", "/nowhere"))
    assert (head_status, head_body) == (status, b"") == (404, b"")
    assert headers[b"content-length"] == str(len(body)).encode()
