"""Hostile and broken HTTP clients: fuzzed requests, slowloris, floods. All traffic to 127.0.0.1, bounded."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from perfmon.http.routes import Router

from .conftest import http, value, wait_until

TOKEN = "fuzz-token-1234567"
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=10)
FIELDS = st.sampled_from(["model", "steps", "max_seconds", "record_shapes", "with_stack", "profile_memory",
                          "colour", "", "__proto__"])
BODIES = (st.dictionaries(FIELDS, JSON_VALUES, max_size=6).map(lambda d: json.dumps(d).encode())
          | st.binary(max_size=300) | JSON_VALUES.map(lambda v: json.dumps(v).encode()))
PATHS = (st.sampled_from(["/", "/metrics", "/healthz", "/stats", "/openapi.json", "/profile", "/profiles",
                          "/profiles/", "/profiles/x", "/profiles/../../etc/passwd", "/profiles/%2e%2e/trace",
                          "/profiles/ffffffffffffffffffffff", "/profiles/ffffffffffffffffffffff/trace",
                          "//", "/profile/x/y/z"])
         | st.text(alphabet=st.characters(codec="utf-8"), max_size=40).map(lambda t: "/" + t))
METHODS = st.sampled_from(["GET", "POST", "PUT", "DELETE", "HEAD", "PATCH", "OPTIONS", "TRACE", "BREW", ""])
AUTH = st.sampled_from([None, f"Bearer {TOKEN}", "Bearer wrong", "Basic abc", "Bearer", "", "bearer  " + TOKEN])


def _check(resp: Any) -> None:
    assert resp.status < 500, (resp.status, resp.body[:300])
    assert b"Traceback" not in resp.body
    if resp.status >= 400:
        assert resp.content_type == "application/json"
        assert json.loads(resp.body)["error"]


def test_openapi_document_describes_every_route(make_monitor) -> None:
    """/openapi.json is OpenAPI 3.1 and names every control route with its error responses."""
    mon = make_monitor()
    resp = Router(mon, mounted=False).handle("GET", "/openapi.json", {})
    doc = json.loads(resp.body)
    assert resp.status == 200 and doc["openapi"].startswith("3.1")
    routes = {"/profile", "/profiles", "/profiles/{id}", "/profiles/{id}/trace", "/metrics", "/stats"}
    assert routes <= set(doc["paths"])
    assert set(doc["paths"]["/profile"]["post"]["responses"]) >= {"202", "400", "401", "404", "409", "413", "429"}


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(method=METHODS, path=PATHS, body=BODIES, auth=AUTH)
def test_fuzzed_requests_never_5xx_never_leak_a_traceback(make_monitor, method: str, path: str, body: bytes,
                                                          auth: str | None) -> None:
    """Random methods, paths, bodies and credentials: no 5xx, no traceback, every error is JSON with a message."""
    mon = _fuzz_monitor(make_monitor)
    headers = {"authorization": auth} if auth is not None else {}
    resp = mon._fuzz_router.handle(method, path, headers, body)
    _check(resp)
    if mon.captures.state != "idle":  # a fuzzed request armed a capture: let the slot free for the next one
        mon.captures.stop(1.0)


_FUZZ: dict[str, Any] = {}


def _fuzz_monitor(make_monitor) -> Any:
    """One running monitor per test run (hypothesis calls the body many times with the same fixture)."""
    mon = _FUZZ.get(id(make_monitor))
    if mon is None:
        _FUZZ.clear()
        mon = make_monitor(token=TOKEN, manual_captures_per_hour=10**6).start()
        mon.wrap(torch.nn.Linear(2, 2), name="m")
        mon._fuzz_router = Router(mon, mounted=False)
        _FUZZ[id(make_monitor)] = mon
    return mon


def _get(url: str, headers: dict[str, str] | None = None, timeout: float = 10) -> int:
    return http(url, headers=headers, timeout=timeout)[0]


def test_agent_stays_responsive_under_slowloris_floods_and_bad_tokens(make_monitor) -> None:
    """30 slowloris sockets, 50 parallel scrapes, 300 bad-token requests, oversized headers and bodies:
    /healthz keeps answering, the model keeps serving, and nothing reaches 5xx."""
    mon = make_monitor(port=0, token=TOKEN).start()
    model = mon.wrap(torch.nn.Linear(8, 8), name="m")
    host, port = "127.0.0.1", int(mon.url.rsplit(":", 1)[1])
    stop = threading.Event()
    calls = [0]

    def serve_model() -> None:
        x = torch.randn(2, 8)
        deadline = time.monotonic() + 60
        while not stop.is_set() and time.monotonic() < deadline:
            model(x)
            calls[0] += 1

    slow = []
    for _ in range(30):  # slowloris: a request line and one header, then nothing
        s = socket.create_connection((host, port), timeout=5)
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        slow.append(s)
    results: list[int] = []
    lock = threading.Lock()

    def scrape() -> None:
        code = _get(mon.url + "/metrics")
        with lock:
            results.append(code)

    def bad_tokens() -> None:
        for i in range(300):
            code = _get(mon.url + "/profiles", {"Authorization": f"Bearer guess-{i}"})
            with lock:
                results.append(code)

    worker = threading.Thread(target=serve_model)
    worker.start()
    threads = [threading.Thread(target=scrape) for _ in range(50)] + [threading.Thread(target=bad_tokens)]
    try:
        for t in threads:
            t.start()
        health = []
        for _ in range(10):  # /healthz answers throughout
            t0 = time.monotonic()
            assert _get(mon.url + "/healthz", timeout=5) == 200
            health.append(time.monotonic() - t0)
            time.sleep(0.05)
        for t in threads:
            t.join(60)
        # oversized header and oversized body: refused cleanly
        assert _get(mon.url + "/healthz", {"X-Big": "a" * 70_000}) in (400, 431)
        req = urllib.request.Request(mon.url + "/profile", data=b"x" * 1_000_000, method="POST",
                                     headers={"Authorization": f"Bearer {TOKEN}"})
        try:
            urllib.request.urlopen(req, timeout=10)
            raise AssertionError("oversized body accepted")
        except urllib.error.HTTPError as e:
            # 413, or 429 while this address is still throttled for the bad tokens above (both refusals;
            # 413 alone is proven in test_capture.py)
            assert e.code in (413, 429)
        except (ConnectionError, urllib.error.URLError):
            pass  # the server may close while the client is still sending: also a refusal
    finally:
        stop.set()
        worker.join(30)
        for s in slow:
            s.close()
    # bad tokens: 401 until the address has failed 20 times in a second, then 429 before routing
    assert results.count(200) == 50 and results.count(401) + results.count(429) == 300
    assert results.count(401) >= 20 and max(results) < 500
    assert calls[0] > 1000  # the model kept serving throughout
    assert max(health) < 5.0


def test_stuck_connections_are_cut_and_the_slowest_evicted_at_the_cap(make_monitor) -> None:
    """A connection older than http_connection_timeout_seconds is closed by the server; at the connection
    cap a new client is served and the oldest connection that never sent a request is closed instead."""
    from perfmon.http.agent_server import _SILENT_GRACE_SECONDS, MAX_CONNECTIONS

    mon = make_monitor(port=0, http_connection_timeout_seconds=1).start()
    port = int(mon.url.rsplit(":", 1)[1])
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"GET /metrics HTTP/1.1\r\n")  # and never finish
    t0 = time.monotonic()
    data = s.recv(100)  # returns b"" (or an error response) once the server cuts the connection
    assert time.monotonic() - t0 < 8 and b"200 OK" not in data
    s.close()
    assert value(mon, "perfmon_agent_http_refused_total", reason="timeout") == 1

    mon2 = make_monitor(port=0).start()
    port2 = int(mon2.url.rsplit(":", 1)[1])
    held = []
    try:
        for _ in range(MAX_CONNECTIONS):
            held.append(socket.create_connection(("127.0.0.1", port2), timeout=10))
        wait_until(lambda: mon2.ports.server.connections() >= MAX_CONNECTIONS, timeout=10,
                   what="the server to accept every held connection")
        # Not a synchronisation: the held sockets must be older than the grace a silent newcomer gives them
        # (a probe's request may reach the server a moment after its connection).
        time.sleep(_SILENT_GRACE_SECONDS)
        assert _get(mon2.url + "/healthz") == 200  # served, not refused
        for h in held:
            h.setblocking(False)

        def closed(h: socket.socket) -> bool:
            try:
                return h.recv(100) == b""
            except BlockingIOError:
                return False

        assert sum(closed(h) for h in held) == 1  # one silent connection made room
        assert value(mon2, "perfmon_agent_http_refused_total", reason="evicted") >= 1
    finally:
        for h in held:
            h.close()
    wait_until(lambda: _get(mon2.url + "/healthz") == 200, timeout=10, what="healthz after the flood")
