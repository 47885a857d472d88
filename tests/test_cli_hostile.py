"""`perfmon profile`, `profiles --url` and `diff` against a hostile or broken agent (issue #22, item 7): a real
HTTP server on 127.0.0.1 answers what such an agent would. The CLI prints no terminal control character from the
agent, ends every malformed answer with one `perfmon:` line on stderr and exit status 1 (never a traceback),
follows no redirect (its token goes to --url only), keeps --timeout as one deadline for the whole command and
refuses answers past its size limits, reading them in bounded chunks."""

from __future__ import annotations

import gzip
import json
import os
import random
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from perfmon.cli import ANSWER_MAX_BYTES, TRACE_MAX_BYTES, main

#: What no text printed to a terminal may carry: C0 controls but newline, DEL, C1 controls (CSI, OSC, ST...)
#: and the bidirectional overrides and isolates that reorder what is displayed.
FORBIDDEN = {chr(c) for c in (*range(0x00, 0x0A), *range(0x0B, 0x20), *range(0x7F, 0xA0),
                              *range(0x202A, 0x202F), *range(0x2066, 0x206A))}
#: Clears the screen, retitles the window, hides text, moves the cursor, rings the bell, reverses text.
POISON = "\x1b[2J\x1b]0;pwned\x07\x1b[8m\r\x9b1;1H\x00\x7f\x85\u202e\x08"
#: The same in a header value (Latin-1, no CR/LF: http.server cannot send other text there).
HEADER_POISON = "\x1b[2J\x1b]0;pwned\x07\x1b[8m\x9b1;1H\x00\x7f\x85\x08"
A, B = "0123456789abcdef012345", "fedcba9876543210fedcba"
TRACE = b"\x1f\x8b not really a trace"

Reply = tuple[int, list[tuple[str, str]], bytes]
Script = Callable[["RawAgent", socket.socket, str], None]


def _json(data: Any) -> Reply:
    return 200, [("Content-Type", "application/json")], json.dumps(data).encode()


def meta(cid: str = A, **fields: Any) -> dict[str, Any]:
    """A finished capture's metadata as the agent's GET /profiles/{id} returns it."""
    return {"id": cid, "model": "m", "trigger": "manual", "status": "done", "outcome": "ok", "error": None,
            "steps_recorded": 5, "steps": 5, "device": "cpu", "trace_file": "h_1.1.pt.trace.json.gz",
            "armed_at": "2026-01-01T00:00:00+00:00",
            "summary": [{"name": "aten::mm", "calls": 5, "self_cpu_time_total_seconds": 0.002,
                         "self_device_time_total_seconds": 0.0, "cpu_time_total_seconds": 0.003, "flops": 1e9,
                         "achieved_flops_per_second": 5e11, "bound": "compute"}],
            "compute": {"achieved_flops_per_second": 4e11, "mfu_ratio": 0.3, "peak_source": "nominal"},
            "comparison": {"baseline": B, "summary": "no op changed beyond run-to-run spread"},
            "ops": {"aten::mm": {"seconds_per_step": 0.002, "seconds_per_step_stdev": 1e-4, "calls_per_step": 1,
                                 "share_of_steps": 1.0}}, **fields}


def profile_routes(capture: dict[str, Any]) -> dict[tuple[str, str], Reply]:
    """What an agent answers to `perfmon profile`: the capture id, its metadata, its trace."""
    return {("POST", "/profile"): _json({"id": A}), ("GET", f"/profiles/{A}"): _json(capture),
            ("GET", f"/profiles/{A}/trace"): (200, [("Content-Type", "application/gzip")], TRACE)}


class Agent:
    """A real HTTP server on 127.0.0.1 (stdlib, a thread per connection) answering ``routes[(method, path)]``
    (404 otherwise), or ``handler(method, path)`` when given; it records every request's method, path and
    headers. Use it in a ``with`` block: the server stops at its end."""

    def __init__(self, routes: dict[tuple[str, str], Reply] | None = None,
                 handler: Callable[[str, str], Reply] | None = None) -> None:
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        answer = handler or (lambda method, path: (routes or {}).get((method, path), (404, [], b'{"error": "no"}')))
        agent = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _serve(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(min(length, 2**20))
                agent.requests.append((self.command, self.path, dict(self.headers.items())))
                status, headers, body = answer(self.command, self.path)
                self.send_response(status)
                for name, value in headers:
                    self.send_header(name, value)  # unchecked: a hostile agent's headers carry anything
                if not any(name.lower() in ("content-length", "transfer-encoding") for name, _ in headers):
                    self.send_header("Content-Length", str(len(body)))
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_DELETE = _serve

            def log_message(self, *args: Any) -> None:
                pass

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request: Any, client_address: Any) -> None:
                pass  # the CLI hung up on purpose (a refused answer): not the test's failure

        self.server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05})

    def __enter__(self) -> Agent:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(5)


class RawAgent:
    """A socket on 127.0.0.1 whose connections ``script(agent, conn, request_line)`` answers byte by byte: the
    slow, endless or lying answers http.server cannot send. Serves at most ``connections`` connections, one at a
    time, for at most 60 s; ``sent`` counts the bytes the scripts got into the kernel."""

    def __init__(self, script: Script, *, connections: int = 4, tls: ssl.SSLContext | None = None) -> None:
        self.script, self.connections, self.sent, self.tls = script, connections, 0, tls
        self.stop = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.05)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self._thread = threading.Thread(target=self._run)

    def send(self, conn: socket.socket, data: bytes) -> bool:
        """Send ``data``; False once the client has gone (or the test ended)."""
        if self.stop.is_set():
            return False
        try:
            conn.sendall(data)
        except OSError:
            return False
        self.sent += len(data)
        return True

    def _run(self) -> None:
        end = time.monotonic() + 60
        served = 0
        while served < self.connections and not self.stop.is_set() and time.monotonic() < end:
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            served += 1
            conn.settimeout(5)
            head = b""
            try:
                if self.tls is not None:
                    conn = self.tls.wrap_socket(conn, server_side=True)
                while b"\r\n\r\n" not in head and len(head) < 65536:  # the request's head, then the script
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    head += chunk
                self.script(self, conn, head.split(b"\r\n", 1)[0].decode("latin-1"))
            except OSError:
                pass  # the client hung up, or refused our certificate
            finally:
                conn.close()

    def __enter__(self) -> RawAgent:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self._thread.join(10)
        self.listener.close()


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``perfmon argv...`` in this process: (exit status, stdout, stderr)."""
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def assert_clean(*texts: str) -> None:
    for text in texts:
        bad = sorted({repr(c) for c in text if c in FORBIDDEN})
        assert not bad, f"control characters printed: {bad} in {text[:500]!r}"


def assert_one_error_line(rc: int, err: str) -> None:
    """Exit status 1 and exactly one `perfmon: ...` line on stderr: no traceback, no control character."""
    assert rc == 1, err
    assert "Traceback" not in err and err.startswith("perfmon: ") and err.count("\n") == 1, err
    assert_clean(err)


# -- 1. nothing the agent says reaches the terminal raw -------------------------------------------------

def _poisoned(value: Any, op_table: bool = False) -> Any:
    """``value`` with every string value in it, and the op names of its op table, prefixed with terminal control
    sequences."""
    if isinstance(value, str):
        return POISON + value
    if isinstance(value, list):
        return [_poisoned(v) for v in value]
    if isinstance(value, dict):
        return {(POISON + k if op_table else k): _poisoned(v, k == "ops") for k, v in value.items()}
    return value


def test_profile_prints_no_control_character_from_any_field(tmp_path: Path, capsys: Any) -> None:
    """Every string of a capture's metadata poisoned (compute.peak_source, the summary, the comparison...): the
    `perfmon profile` output carries none of the control sequences, and the text around them is still there."""
    capture = {**_poisoned(meta()), "id": A, "trace_file": "h_1.1.pt.trace.json.gz"}
    with Agent(profile_routes(capture)) as agent:
        rc, out, err = run(capsys, "profile", "--url", agent.url, "--out", str(tmp_path / "t.gz"), "--timeout", "20")
    assert rc == 0, err
    assert_clean(out, err)
    assert "pwned" not in out  # the window title is dropped with its sequence, not printed as text
    assert "aten::mm" in out and "nominal" in out and "compute" in out and "no op changed" in out


def test_profiles_and_diff_print_no_control_character_from_any_field(capsys: Any) -> None:
    """The same poison in `perfmon profiles --url` (every listed field) and `perfmon diff` (op names, model,
    trigger, device): cleaned output, exit 0."""
    listing = {"profiles": [{**_poisoned(meta()), "id": A}]}
    routes = {("GET", "/profiles"): _json(listing),
              ("GET", f"/profiles/{A}"): _json({**_poisoned(meta()), "id": A, "device": "cpu", "steps": 5}),
              ("GET", f"/profiles/{B}"): _json({**_poisoned(meta(B, model="other")), "id": B, "device": "cpu",
                                                "steps": 5})}
    with Agent(routes) as agent:
        rc, out, err = run(capsys, "profiles", "--url", agent.url)
        assert rc == 0, err
        assert_clean(out, err)
        assert A in out
        rc, out, err = run(capsys, "diff", "--url", agent.url, A, B)
    assert rc == 0, err
    assert_clean(out, err)
    assert "aten::mm" in out and "different models" in out


@pytest.mark.parametrize("status, headers, body", [
    (500, [], json.dumps({"error": POISON + "boom", "detail": POISON}).encode()),
    (403, [("X-Why", HEADER_POISON)], (POISON + "plain text error").encode()),
    (302, [("Location", "http://127.0.0.1:1/" + HEADER_POISON)], b""),
], ids=["json-error", "text-error", "redirect-location"])
def test_error_answers_print_no_control_character(status: int, headers: list[tuple[str, str]], body: bytes,
                                                   capsys: Any) -> None:
    """An agent's error message (JSON or text) or a redirect's Location is quoted cleaned, on one line."""
    with Agent(handler=lambda method, path: (status, headers, body)) as agent:
        rc, _, err = run(capsys, "profiles", "--url", agent.url)
    assert_one_error_line(rc, err)
    assert str(status) in err


def test_a_failed_capture_error_is_printed_cleaned(tmp_path: Path, capsys: Any) -> None:
    """A failed capture's error text reaches stderr cleaned and cut, as one line."""
    capture = meta(outcome="failed", error=POISON + "export failed\n" + "x" * 100_000)
    with Agent(profile_routes(capture)) as agent:
        rc, _, err = run(capsys, "profile", "--url", agent.url, "--out", str(tmp_path / "t.gz"))
    assert_one_error_line(rc, err)
    assert "export failed" in err and len(err) < 2000


# -- 2. malformed answers: one clear line, exit 1, never a traceback ----------------------------------

def _deep(depth: int) -> Any:
    value: Any = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("status, body", [
    (500, b'["not", "an", "object"]'),
    (500, b'"just a string"'),
    (401, b'{"error": 42}'),
    (400, b'{"error": ["x"], "detail": {"a": 1}}'),
    (500, b'{"error": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    (500, b"\xff\xfe\x00 not utf-8"),
    (200, b"[" * 100_000),
    (200, b'{"profiles": ' + b"[" * 990 + b"]" * 990 + b"}"),
    (200, b"\xff\xfe\x00 not utf-8"),
    (200, gzip.compress(b'{"profiles": []}')),
], ids=["list-error", "string-error", "int-error", "wrong-types-error", "deep-error", "binary-error", "deep-answer",
        "deep-listing", "binary-answer", "gzip-answer"])
def test_malformed_answers_to_profiles_are_one_clean_error_line(status: int, body: bytes, capsys: Any) -> None:
    """Non-object, wrong-typed, too deeply nested or undecodable answers (error or not) to `perfmon profiles`."""
    with Agent(handler=lambda method, path: (status, [], body)) as agent:
        rc, _, err = run(capsys, "profiles", "--url", agent.url)
    assert_one_error_line(rc, err)


@pytest.mark.parametrize("field, value", [
    ("summary", [{"name": "aten::mm", "calls": "\x1b[2J", "self_cpu_time_total_seconds": 0.002,
                  "cpu_time_total_seconds": 0.003}]),
    ("summary", [{"name": "aten::mm", "calls": 5, "self_cpu_time_total_seconds": "0.002",
                  "cpu_time_total_seconds": 0.003}]),
    ("summary", [{"name": "aten::mm", "calls": 5, "self_cpu_time_total_seconds": 0.002,
                  "cpu_time_total_seconds": None}]),
    ("summary", [{"name": "aten::mm", "calls": [5], "self_cpu_time_total_seconds": 0.002,
                  "cpu_time_total_seconds": 0.003}]),
    ("summary", [{"name": "aten::mm"}]),
    ("summary", ["not an op"]),
    ("summary", {"not": "a list"}),
    ("summary", [{"name": "aten::mm", "calls": 5, "self_cpu_time_total_seconds": 0.002,
                  "cpu_time_total_seconds": 10 ** 400}]),
    ("compute", {"achieved_flops_per_second": "fast", "peak_source": "x"}),
    ("compute", {"achieved_flops_per_second": 1e12, "mfu_ratio": "high"}),
    ("compute", ["not", "an", "object"]),
    ("outcome", ["ok"]),
    ("status", {"s": 1}),
], ids=["calls-escape", "string-seconds", "null-seconds", "list-calls", "missing-fields", "op-not-object",
        "summary-not-list", "huge-int", "string-flops", "string-mfu", "compute-not-object", "outcome-list",
        "status-object"])
def test_profile_with_a_wrong_typed_field_is_one_clean_error_line(field: str, value: Any, tmp_path: Path,
                                                                  capsys: Any) -> None:
    """A capture whose summary, compute or state fields have the wrong type: exit 1, one line naming the field."""
    with Agent(profile_routes(meta(**{field: value}))) as agent:
        rc, out, err = run(capsys, "profile", "--url", agent.url, "--out", str(tmp_path / "t.gz"), "--timeout", "20")
    assert_one_error_line(rc, err)
    assert field in err
    assert_clean(out)


@pytest.mark.parametrize("field,value", [
    ("summary", [{"name": "aten::mm", "calls": [5], "self_cpu_time_total_seconds": 0.002,
                  "cpu_time_total_seconds": 0.003}]),
    ("compute", ["not", "an", "object"]),
    ("outcome", ["ok"]),
    ("outcome", None),
    ("outcome", "failed"),
], ids=["list-calls", "compute-not-object", "outcome-list", "still-recording", "failed"])
def test_profiles_download_of_a_broken_or_unfinished_capture_writes_nothing(field: str, value: Any, tmp_path: Path,
                                                                              capsys: Any) -> None:
    """`perfmon profiles --url --download ID` of a capture with a wrong-typed field, one still recording or one that
    failed: exit 1, one clean line, no file written."""
    with Agent(profile_routes(meta(**{field: value}))) as agent:
        rc, out, err = run(capsys, "profiles", "--url", agent.url, "--download", A, "--out", str(tmp_path),
                           "--timeout", "20")
    assert_one_error_line(rc, err)
    assert_clean(out)
    assert list(tmp_path.iterdir()) == []


def test_profiles_download_keeps_the_trace_inside_out_whatever_name_the_agent_gives(tmp_path: Path,
                                                                                    capsys: Any) -> None:
    """The agent names the trace file; a name that is a path ("../x") is not used: the file lands in --out under the
    capture id's name."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    with Agent(profile_routes(meta(trace_file="../../escaped.pt.trace.json.gz"))) as agent:
        rc, out, err = run(capsys, "profiles", "--url", agent.url, "--download", A, "--out", str(out_dir))
    assert rc == 0, err
    assert [p.name for p in out_dir.iterdir()] == [f"{A}.pt.trace.json.gz"]
    assert (out_dir / f"{A}.pt.trace.json.gz").read_bytes() == TRACE
    assert not list(tmp_path.glob("escaped*")) and "aten::mm" in out


@pytest.mark.parametrize("entry", [
    {"seconds_per_step": 0.002, "seconds_per_step_stdev": 1e308, "calls_per_step": 1},
    {"seconds_per_step": 1e308, "seconds_per_step_stdev": 1e308, "calls_per_step": 1},
    {"seconds_per_step": 0.002, "seconds_per_step_stdev": 10 ** 400, "calls_per_step": 1},
    {"seconds_per_step": -0.002, "calls_per_step": 1},
], ids=["stdev-1e308", "everything-1e308", "huge-int", "negative"])
def test_diff_with_an_overflowing_op_table_is_one_clean_error_line(entry: dict[str, Any], capsys: Any) -> None:
    """An op table whose numbers overflow the comparison's arithmetic (OverflowError before) is refused."""
    routes = {("GET", f"/profiles/{A}"): _json(meta(A)),
              ("GET", f"/profiles/{B}"): _json(meta(B, ops={"aten::mm": entry}))}
    with Agent(routes) as agent:
        rc, _, err = run(capsys, "diff", "--url", agent.url, A, B)
    assert_one_error_line(rc, err)


def test_diff_of_a_ten_thousandfold_uniform_change_is_compared(capsys: Any) -> None:
    """Every op 10,000x faster (figures in range): the comparison says so (its uniform-ratio hint once rounded
    to 0 and divided by it, a ZeroDivisionError), and the CLI prints the table and summary, exit 0."""
    table = {f"op{i}": {"seconds_per_step": 1.0, "seconds_per_step_stdev": 0.0, "calls_per_step": 1} for i in range(4)}
    fast = {name: {**entry, "seconds_per_step": 1e-4} for name, entry in table.items()}
    routes = {("GET", f"/profiles/{A}"): _json(meta(A, ops=table)), ("GET", f"/profiles/{B}"): _json(meta(B, ops=fast))}
    with Agent(routes) as agent:
        rc, out, err = run(capsys, "diff", "--url", agent.url, A, B)
    assert (rc, err) == (0, ""), err
    assert "every large op ~10,000\N{MULTIPLICATION SIGN} faster alike" in out, out


@pytest.mark.parametrize("fields", [{"steps": 10 ** 400}, {"steps": "5"}, {"device": _deep(900)},
                                    {"device": ["cuda"]}], ids=["huge-steps", "string-steps", "deep-device",
                                                                "list-device"])
def test_diff_with_wrong_typed_capture_fields_is_one_clean_error_line(fields: dict[str, Any], capsys: Any) -> None:
    """A capture's step count or device of the wrong type never reaches the comparison's arithmetic."""
    routes = {("GET", f"/profiles/{A}"): _json(meta(A)), ("GET", f"/profiles/{B}"): _json(meta(B, **fields))}
    with Agent(routes) as agent:
        rc, _, err = run(capsys, "diff", "--url", agent.url, A, B)
    assert_one_error_line(rc, err)


#: Values a broken or hostile agent might put anywhere in an answer.
HOSTILE_VALUES: list[Any] = [None, True, False, 0, -1, 2**64, 10**400, 1e308, -1e308, float("nan"), float("inf"),
                             "", "abc", POISON, [], {}, [1, "x"], {"a": None}, _deep(60), "A" * 100_000]
#: Whole answers that are not the JSON object expected.
HOSTILE_BODIES = [b"", b"null", b"[]", b'"text"', b"42", b"{", b'{"id": 1', b"\xff\xfe\x00garbage",
                  b"[" * 100_000, gzip.compress(b'{"id": "x"}'), b'{"a": ' + b"[" * 5000 + b"]" * 5000 + b"}"]
#: Statuses other than 200, each answered with a hostile body.
HOSTILE_STATUSES = [201, 204, 301, 302, 307, 400, 401, 404, 500, 503]


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every key or index path inside a JSON value."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        yield (*prefix, key)
        yield from _paths(child, (*prefix, key))


def mutate(answer: dict[str, Any], rng: random.Random) -> Reply:
    """One malformed variant of ``answer``: a field replaced or removed, a non-object body, or a refusal."""
    roll = rng.random()
    if roll < 0.1:
        return 200, [], rng.choice(HOSTILE_BODIES)
    if roll < 0.2:
        body = rng.choice([*HOSTILE_BODIES, json.dumps({"error": rng.choice(HOSTILE_VALUES)}).encode()])
        status = rng.choice(HOSTILE_STATUSES)
        return status, [("Location", f"http://127.0.0.1:1/{HEADER_POISON}")] if 300 <= status < 400 else [], body
    copy = json.loads(json.dumps(answer))
    path = rng.choice(list(_paths(copy)))
    parent = copy
    for key in path[:-1]:
        parent = parent[key]
    if roll < 0.3:
        del parent[path[-1]]
    else:
        parent[path[-1]] = rng.choice(HOSTILE_VALUES)
    return 200, [], json.dumps(copy).encode()


#: Malformed answers tried per subcommand: about 4 s for all of them on a 2-core machine.
FUZZ_CASES = 60


@pytest.mark.parametrize("command", ["profile", "profiles", "diff"])
def test_fuzzed_answers_never_raise(command: str, tmp_path: Path, capsys: Any) -> None:
    """FUZZ_CASES seeded malformed answers per subcommand (one answer of the exchange mutated each time): exit 0
    or 1, never a traceback, an error is one clean line, and stdout carries no control character."""
    rng = random.Random(f"perfmon-cli-{command}")
    good = {"profile": profile_routes(meta()),
            "profiles": {("GET", "/profiles"): _json({"profiles": [meta(A), meta(B)]})},
            "diff": {("GET", f"/profiles/{A}"): _json(meta(A)), ("GET", f"/profiles/{B}"): _json(meta(B))}}[command]
    argv = {"profile": ["--out", str(tmp_path / "t.gz")], "profiles": [], "diff": [A, B]}[command]
    answers = [key for key, reply in good.items() if reply[1][:1] == [("Content-Type", "application/json")]]
    outcomes: dict[int, int] = {}
    for case in range(FUZZ_CASES + 1):
        routes = dict(good)
        if case:  # case 0: the well-formed exchange, which must succeed
            key = rng.choice(answers)
            routes[key] = mutate(json.loads(good[key][2]), rng)
        with Agent(routes) as agent:
            rc = main([command, "--url", agent.url, "--timeout", "2", *argv])
        out, err = capsys.readouterr()
        assert rc in (0, 1) and "Traceback" not in err, (case, routes, err)
        assert_clean(out, err)
        if rc == 1:
            assert err.startswith("perfmon: ") and err.count("\n") == 1, (case, err)
        assert case or rc == 0, err
        outcomes[rc] = outcomes.get(rc, 0) + 1
    assert outcomes.get(1, 0) > FUZZ_CASES // 4, outcomes  # the malformed answers were seen, not skipped


@pytest.mark.parametrize("out", ["missing-dir/t.gz", "missing-dir/"], ids=["missing-directory", "a-new-directory"])
def test_an_out_path_that_cannot_be_written_is_refused_before_the_capture(out: str, tmp_path: Path,
                                                                         capsys: Any) -> None:
    """--out in a directory that does not exist, or naming one ("new/"; an existing directory takes the trace): a
    usage error (exit 2, one line naming the path) before any request, so no capture is taken for nothing (it was
    exit 1 after the capture); no file left."""
    path = os.path.join(tmp_path, out)  # (a Path would drop the trailing "/")
    with Agent(profile_routes(meta())) as agent:
        rc, _, err = run(capsys, "profile", "--url", agent.url, "--out", path)
    assert rc == 2 and err.startswith("perfmon: profile: --out ") and err.count("\n") == 1, err
    assert path in err and "PosixPath" not in err
    assert agent.requests == [] and list(tmp_path.iterdir()) == []


# -- 3. redirects are not followed: the token goes to --url only -----------------------------------------

@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
@pytest.mark.parametrize("command", ["profiles", "profile"])
def test_a_redirect_is_an_error_and_the_token_stays_home(status: int, command: str, tmp_path: Path, capsys: Any,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """An agent answering a redirect to another server: exit 1 naming the redirect; the other server sees nothing
    (before: it received `Authorization: Bearer <token>`)."""
    monkeypatch.setenv("PERFMON_TOKEN", "s3cret-token")
    with Agent({("GET", "/profiles"): _json({"profiles": []}), ("POST", "/profile"): _json({"id": A})}) as other:
        target = other.url + ("/profiles" if command == "profiles" else "/profile")
        with Agent(handler=lambda method, path: (status, [("Location", target)], b"")) as agent:
            extra = ["--out", str(tmp_path / "t.gz")] if command == "profile" else []
            rc, _, err = run(capsys, command, "--url", agent.url, *extra)
            assert agent.requests and agent.requests[0][2].get("Authorization") == "Bearer s3cret-token"
    assert [headers.get("Authorization") for _, _, headers in other.requests] == []  # no request, no token
    assert_one_error_line(rc, err)
    assert "redirect" in err and str(status) in err and "s3cret" not in err


# -- 4. --timeout is one deadline for the whole command ---------------------------------------------------

def _drip_body(agent: RawAgent, conn: socket.socket, request: str) -> None:
    """A complete head, then a 300-byte body at 10 bytes a second (a 1 s per-read timeout never fires)."""
    if agent.send(conn, b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 300\r\n\r\n"):
        for _ in range(300):
            if agent.stop.wait(0.1) or not agent.send(conn, b" "):
                return


def _drip_head(agent: RawAgent, conn: socket.socket, request: str) -> None:
    """The status line and headers at 10 bytes a second."""
    for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 300:
        if agent.stop.wait(0.1) or not agent.send(conn, bytes([byte])):
            return


def _silent(agent: RawAgent, conn: socket.socket, request: str) -> None:
    """Accept the request, never answer."""
    agent.stop.wait(60)


def _continue_forever(agent: RawAgent, conn: socket.socket, request: str) -> None:
    """Interim `100 Continue` answers, a hundred a second, never the real one."""
    for _ in range(3000):
        if agent.stop.wait(0.01) or not agent.send(conn, b"HTTP/1.1 100 Continue\r\n\r\n"):
            return


@pytest.mark.parametrize("script", [_drip_body, _drip_head, _silent, _continue_forever],
                         ids=["slow-body", "slow-head", "silent", "continue-forever"])
@pytest.mark.parametrize("command", ["profiles", "profile", "diff"])
def test_timeout_is_a_deadline_for_the_whole_exchange(script: Script, command: str, tmp_path: Path,
                                                       capsys: Any) -> None:
    """`--timeout 1` against an agent that answers slower than any per-read timeout: the command ends within
    about 1 s with exit 1 saying so (before: it ran until the agent had sent everything)."""
    with RawAgent(script) as agent:
        extra = {"profiles": [], "profile": ["--out", str(tmp_path / "t.gz")], "diff": [A, B]}[command]
        t0 = time.monotonic()
        rc, _, err = run(capsys, command, "--url", agent.url, "--timeout", "1", *extra)
        elapsed = time.monotonic() - t0
    assert elapsed < 2.5, f"{elapsed:.1f} s"
    assert_one_error_line(rc, err)
    assert "1 s" in err


def _answer(agent: RawAgent, conn: socket.socket, body: bytes, head: bytes = b"") -> None:
    agent.send(conn, b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n%s\r\n%s"
               % (len(body), head, body))


def _capture_then(trace: Script) -> Script:
    """An agent that arms and finishes a capture at once, then answers its trace download with ``trace``."""
    def script(agent: RawAgent, conn: socket.socket, request: str) -> None:
        if request.startswith("POST /profile "):
            _answer(agent, conn, json.dumps({"id": A}).encode())
        elif request.startswith(f"GET /profiles/{A} "):
            _answer(agent, conn, json.dumps(meta()).encode())
        else:
            trace(agent, conn, request)
    return script


def test_the_trace_download_shares_the_deadline(tmp_path: Path, capsys: Any) -> None:
    """A trace download that drips is cut at the command's deadline (before: it got a fresh timeout per read),
    and leaves no file behind."""
    out = tmp_path / "out"
    out.mkdir()
    with RawAgent(_capture_then(_drip_body), connections=3) as agent:
        t0 = time.monotonic()
        rc, _, err = run(capsys, "profile", "--url", agent.url, "--timeout", "1.5", "--out", str(out / "t.gz"))
        elapsed = time.monotonic() - t0
    assert elapsed < 3.0, f"{elapsed:.1f} s"
    assert_one_error_line(rc, err)
    assert list(out.iterdir()) == []


# -- 5. size limits, read in bounded chunks -------------------------------------------------------------

def _flood(total: int, framing: str) -> Script:
    """A JSON-typed answer of ``total`` bytes of spaces, sized by Content-Length, chunked, or until close."""
    def script(agent: RawAgent, conn: socket.socket, request: str) -> None:
        size = {"content-length": b"Content-Length: %d\r\n" % total, "chunked": b"Transfer-Encoding: chunked\r\n",
                "until-close": b"Connection: close\r\n"}[framing]
        if not agent.send(conn, b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + size + b"\r\n"):
            return
        block = b" " * 2**20
        for _ in range(total // len(block)):
            if not agent.send(conn, b"100000\r\n" + block + b"\r\n" if framing == "chunked" else block):
                return
    return script


@pytest.mark.parametrize("framing", ["content-length", "chunked", "until-close"])
def test_an_answer_over_the_limit_is_refused_without_reading_it_all(framing: str, capsys: Any) -> None:
    """A JSON answer of 4x ANSWER_MAX_BYTES: exit 1 naming the limit, and the agent could send little more than the
    limit before the CLI hung up (before: the CLI read all of it into memory)."""
    total = 4 * ANSWER_MAX_BYTES
    with RawAgent(_flood(total, framing), connections=1) as agent:
        rc, _, err = run(capsys, "profiles", "--url", agent.url)
    assert agent.sent < 2 * ANSWER_MAX_BYTES, agent.sent  # the limit plus what the sockets' buffers hold
    assert_one_error_line(rc, err)
    assert "MiB" in err


def test_a_trace_over_its_limit_is_refused_and_leaves_no_file(tmp_path: Path, capsys: Any) -> None:
    """A trace announced past TRACE_MAX_BYTES is refused before its body is read; nothing is written."""
    def huge(agent: RawAgent, conn: socket.socket, request: str) -> None:
        agent.send(conn, b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (TRACE_MAX_BYTES + 1) + b"\0" * 2**20)

    with RawAgent(_capture_then(huge), connections=3) as agent:
        rc, _, err = run(capsys, "profile", "--url", agent.url, "--out", str(tmp_path / "t.gz"))
    assert_one_error_line(rc, err)
    assert "GiB" in err and list(tmp_path.iterdir()) == []


def test_a_trace_is_streamed_to_its_file(tmp_path: Path, capsys: Any) -> None:
    """A 64 MiB trace sent without a length arrives whole in the --out file (0600), written as it is read."""
    def big(agent: RawAgent, conn: socket.socket, request: str) -> None:
        if agent.send(conn, b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n"):
            for i in range(64):
                if not agent.send(conn, bytes([i]) * 2**20):
                    return

    with RawAgent(_capture_then(big), connections=3) as agent:
        rc, out, err = run(capsys, "profile", "--url", agent.url, "--out", str(tmp_path / "t.gz"))
    assert rc == 0, err
    data = (tmp_path / "t.gz").read_bytes()
    assert len(data) == 64 * 2**20 and data[-1] == 63 and f"({64 * 2**20} bytes" in out
    assert (tmp_path / "t.gz").stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("what", ["json", "trace"])
def test_an_answer_shorter_than_its_content_length_is_an_error(what: str, tmp_path: Path, capsys: Any) -> None:
    """A Content-Length that promises more than the agent sends: exit 1 ("cut short"), no partial trace file."""
    def short(agent: RawAgent, conn: socket.socket, request: str) -> None:
        agent.send(conn, b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\nConnection: close\r\n\r\n{\"profiles\": [")

    with RawAgent(_capture_then(short) if what == "trace" else short, connections=3) as agent:
        argv = ["profile", "--out", str(tmp_path / "t.gz")] if what == "trace" else ["profiles"]
        rc, _, err = run(capsys, argv[0], "--url", agent.url, *argv[1:])
    assert_one_error_line(rc, err)
    assert "cut short" in err and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("head", [b"X-Big: " + b"a" * 100_000 + b"\r\n",
                                  b"".join(b"X-%d: a\r\n" % i for i in range(500)),
                                  b"Content-Length: -5\r\n", b"Content-Length: 1e9\r\n"],
                         ids=["huge-header-line", "many-headers", "negative-length", "garbage-length"])
def test_malformed_heads_are_one_clean_error_line(head: bytes, capsys: Any) -> None:
    """A header line over http.client's limit, too many headers or a nonsense Content-Length."""
    def script(agent: RawAgent, conn: socket.socket, request: str) -> None:
        agent.send(conn, b"HTTP/1.1 200 OK\r\n" + head + b"Connection: close\r\n\r\n{}")

    with RawAgent(script, connections=1) as agent:
        rc, _, err = run(capsys, "profiles", "--url", agent.url, "--timeout", "10")
    assert_one_error_line(rc, err)


@pytest.mark.parametrize("status_line", [b"HTTP/1.1 999 Whatever\r\n", b"HTTP/1.1 101 Switching\r\n",
                                         b"SSH-2.0-OpenSSH\r\n", b"HTTP/1.1 200 \x1b]0;t\x07OK\r\n"],
                         ids=["status-999", "status-101", "not-http", "escape-in-reason"])
def test_odd_status_lines_are_one_clean_error_line(status_line: bytes, capsys: Any) -> None:
    """A status the CLI does not expect, or not HTTP at all."""
    def script(agent: RawAgent, conn: socket.socket, request: str) -> None:
        agent.send(conn, status_line + b"Content-Length: 2\r\nConnection: close\r\n\r\n[]")

    with RawAgent(script, connections=1) as agent:
        rc, _, err = run(capsys, "profiles", "--url", agent.url, "--timeout", "10")
    assert_one_error_line(rc, err)


def test_an_agent_that_hangs_up_is_one_clean_error_line(capsys: Any) -> None:
    """The connection closed before any answer."""
    with RawAgent(lambda agent, conn, request: None, connections=1) as agent:
        rc, _, err = run(capsys, "profiles", "--url", agent.url, "--timeout", "10")
    assert_one_error_line(rc, err)


# -- the command line itself: URL and token -----------------------------------------------------------------

@pytest.mark.parametrize("url", ["127.0.0.1:9478", "ftp://127.0.0.1/", "file:///etc", "http://", "http://:80",
                                 "http://127.0.0.1:99999", "http://[::1", "http://user:pw@127.0.0.1:1",
                                 "http://127.0.0.1:1/\r\nX-Injected: 1", "http://127.0.0.1:1/?q=1",
                                 "http://127.0.0.1:1/#x", "http://127.0.0.1:1/\x1b]0;t\x07", "javascript:alert(1)"])
def test_a_bad_url_is_a_usage_error(url: str, capsys: Any) -> None:
    """A --url that is not an http(s) base URL (or carries credentials, a query, controls): exit 2, no request,
    the URL's credentials not echoed."""
    with pytest.raises(SystemExit) as exited:
        main(["profiles", "--url", url])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "--url" in err and "Traceback" not in err and "pw@" not in err
    assert_clean(err)


@pytest.mark.parametrize(("argv", "option"), [
    (["profiles", "--url", "http://127.0.0.1:1", "--timeout", "inf"], "--timeout"),
    (["profiles", "--url", "http://127.0.0.1:1", "--timeout", "1e308"], "--timeout"),
    (["profiles", "--url", "http://127.0.0.1:1", "--timeout", "nan"], "--timeout"),
    (["profile", "--url", "http://127.0.0.1:1", "--max-seconds", "inf"], "--max-seconds"),
    (["diff", "--url", "http://127.0.0.1:1", "--rows", "-3", A, A], "--rows"),
    (["profiles", "--store", "file:///tmp", "--limit", "0"], "--limit"),
])
def test_a_number_out_of_range_is_a_usage_error(argv: list[str], option: str, capsys: Any) -> None:
    """An infinite, huge or NaN number of seconds, or a negative count: exit 2 naming the option, no traceback (an
    infinite --timeout overflowed the socket's clock: OverflowError, exit 1)."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and option in err and "Traceback" not in err, err


def test_the_command_line_starts_without_torch(tmp_path: Path) -> None:
    """The agent-driving commands never import torch (1-8 s and ~200 MB before a word): a dead port is one line."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again when the command runs: refused
    code = ("import sys\nfrom perfmon.cli import main\n"
            f"rc = main(['profiles', '--url', 'http://127.0.0.1:{port}', '--timeout', '5'])\n"
            "print(rc, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert done.stdout.split() == ["1", "False"], (done.stdout, done.stderr)
    assert done.stderr.startswith("perfmon: ") and done.stderr.count("\n") == 1, done.stderr


def test_a_token_on_the_command_line_works_with_a_warning(capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """--token is sent, with a warning that it shows in `ps` and shell history; $PERFMON_TOKEN draws none."""
    monkeypatch.delenv("PERFMON_TOKEN", raising=False)
    with Agent({("GET", "/profiles"): _json({"profiles": []})}) as agent:
        rc, _, err = run(capsys, "profiles", "--url", agent.url, "--token", "s3cret-1")
        assert rc == 0 and agent.requests[-1][2].get("Authorization") == "Bearer s3cret-1"
        assert "PERFMON_TOKEN" in err and "s3cret" not in err and err.count("\n") == 1
        monkeypatch.setenv("PERFMON_TOKEN", "s3cret-2")
        rc, _, err = run(capsys, "profiles", "--url", agent.url)
        assert rc == 0 and err == "" and agent.requests[-1][2].get("Authorization") == "Bearer s3cret-2"
        # A token read from a file keeps its newline; the agent's Config drops the ASCII whitespace at its ends, and
        # so does the CLI (it refused it, exit 2, for a token the agent took).
        monkeypatch.setenv("PERFMON_TOKEN", " s3cret-3\n")
        rc, _, err = run(capsys, "profiles", "--url", agent.url)
        assert rc == 0 and err == "" and agent.requests[-1][2].get("Authorization") == "Bearer s3cret-3"


@pytest.mark.parametrize("token", ["a\r\nX-Injected: 1", "caf\u00e9", "euro-\u20ac", "\u00a0padded-token\u00a0",
                                   "a\x1b[2Jb"])
def test_a_token_a_header_cannot_carry_is_a_usage_error(token: str, capsys: Any,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A token with controls or non-ASCII characters, a non-ASCII space at its ends included (none could match the
    agent's): exit 2 before any request, the token not echoed."""
    monkeypatch.setenv("PERFMON_TOKEN", token)
    with Agent({("GET", "/profiles"): _json({"profiles": []})}) as agent:
        rc, _, err = run(capsys, "profiles", "--url", agent.url)
    assert rc == 2 and agent.requests == [] and "PERFMON_TOKEN" in err and token not in err
    assert_clean(err)


# -- https: the same deadline through TLS --------------------------------------------------------------------

def _tls_server(tmp_path: Path) -> tuple[ssl.SSLContext, Path]:
    """A server context with a fresh self-signed certificate for 127.0.0.1, and the certificate's path (the
    client trusts it through $SSL_CERT_FILE, which OpenSSL's default verify paths read)."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    made = subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                           "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key),
                           "-out", str(cert)], capture_output=True, timeout=60, check=False)
    if made.returncode != 0:
        pytest.skip(f"openssl cannot make a test certificate: {made.stderr[-200:]!r}")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    return context, cert


@pytest.mark.parametrize("script", [None, _drip_body, _drip_head], ids=["answer", "slow-body", "slow-head"])
def test_https_answers_and_keeps_the_deadline(script: Script | None, tmp_path: Path, capsys: Any,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Over https the CLI verifies the agent's certificate, reads its answer, and a trickling answer still ends at
    --timeout (ssl applies the socket's timeout per call: the deadline is re-armed before each)."""
    if not shutil.which("openssl"):
        pytest.skip("no openssl to make a test certificate")
    server, cert = _tls_server(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))

    def listing(agent: RawAgent, conn: socket.socket, request: str) -> None:
        _answer(agent, conn, json.dumps({"profiles": [meta()]}).encode())

    with RawAgent(script or listing, connections=1, tls=server) as agent:
        t0 = time.monotonic()
        rc, out, err = run(capsys, "profiles", "--url", agent.url.replace("http:", "https:"), "--timeout", "1")
        elapsed = time.monotonic() - t0
    if script is None:
        assert rc == 0 and A in out, err
    else:
        assert_one_error_line(rc, err)
        assert "1 s" in err and elapsed < 2.5, f"{elapsed:.1f} s"


def test_an_untrusted_certificate_is_one_clean_error_line(tmp_path: Path, capsys: Any) -> None:
    """A certificate the system does not trust: exit 1 saying so, nothing sent (no token leaves over it)."""
    if not shutil.which("openssl"):
        pytest.skip("no openssl to make a test certificate")
    server, _ = _tls_server(tmp_path)
    with RawAgent(lambda agent, conn, request: None, connections=1, tls=server) as agent:
        rc, _, err = run(capsys, "profiles", "--url", agent.url.replace("http:", "https:"), "--timeout", "5")
    assert_one_error_line(rc, err)
    assert "CERTIFICATE_VERIFY_FAILED" in err


def test_a_tls_handshake_that_never_ends_is_cut_at_the_deadline(capsys: Any) -> None:
    """An https agent that accepts the connection and never answers the handshake: exit 1 within ~--timeout."""
    with RawAgent(_silent, connections=1) as agent:
        t0 = time.monotonic()
        rc, _, err = run(capsys, "profiles", "--url", agent.url.replace("http:", "https:"), "--timeout", "1")
        elapsed = time.monotonic() - t0
    assert_one_error_line(rc, err)
    assert elapsed < 2.5, f"{elapsed:.1f} s"
