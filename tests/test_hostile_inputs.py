"""Hand-made hostile inputs on each of perfmon's surfaces are refused or survive intact: /metrics content
negotiation (Accept headers), capture ids in the trace routes, op names on the JSON API and the status page,
store downloads, exemplar span ids.

Each test pins behaviour verified by hand against hostile input (a robustness review; tests/test_hostile.py
fuzzes the HTTP API instead); bugs found in the same review are reported as issues, not encoded here.
"""

from __future__ import annotations

import gzip
import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch

from . import protowire
from .conftest import http, wait_capture

TOKEN = "attack-token-session4"
PROTOBUF = "application/vnd.google.protobuf; proto=io.prometheus.client.MetricFamily; encoding=delimited"
TEXT_004 = "text/plain; version=0.0.4; charset=utf-8"


def _raw(url: str, request: bytes, timeout: float = 10.0) -> tuple[str, dict[str, str], bytes]:
    """One request over a raw socket (for bytes urllib will not send); (status line, headers, body)."""
    host, port = url.split("//")[1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return lines[0], headers, body


def _agent(make_monitor: Any, **kw: Any) -> Any:
    mon = make_monitor(port=0, token=TOKEN, **kw).start()
    model = mon.wrap(torch.nn.Linear(4, 4), name="lin")
    for _ in range(20):
        model(torch.randn(2, 4))
    assert mon.flush()
    return mon


@pytest.mark.parametrize("accept", [
    PROTOBUF,
    PROTOBUF + "; q=0.7, text/plain; version=0.0.4; q=0.3, */*; q=0.1",
    "application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited;q=inf",
])
def test_protobuf_scrapes_decode_whatever_the_q_values(make_monitor: Any, accept: str) -> None:
    """Any Accept header that prefers the protobuf format gets a decodable protobuf scrape, gzipped or not."""
    mon = _agent(make_monitor)
    for encoding in ("", "gzip"):
        status, headers, body = http(mon.url + "/metrics", headers={"Accept": accept, "Accept-Encoding": encoding})
        assert status == 200 and headers["content-type"] == PROTOBUF
        if encoding:
            assert headers.get("content-encoding") == "gzip"
            body = gzip.decompress(body)
        names = {f["name"] for f in protowire.families(body)}
        assert "perfmon_forward_duration_seconds" in names


@pytest.mark.parametrize("accept", [
    "",
    PROTOBUF + "; q=abc",  # an unparseable q is 0: not protobuf
    PROTOBUF + "; q=nan",
    PROTOBUF + "; proto=other",  # the last duplicate parameter wins: not the MetricFamily protobuf
    ";;;,,,=;=,;q=",
    "a" * 8000 + ", text/plain",
])
def test_garbage_accept_headers_get_the_plain_text_scrape(make_monitor: Any, accept: str) -> None:
    """An empty, malformed or oversized Accept header gets exactly the plain-text scrape."""
    mon = _agent(make_monitor)
    status, headers, body = http(mon.url + "/metrics", headers={"Accept": accept})
    assert status == 200 and headers["content-type"] == TEXT_004
    assert b"# TYPE perfmon_forward_duration_seconds histogram" in body
    # Byte for byte what a plain scrape gets (the counters are unchanged between the two).
    plain = http(mon.url + "/metrics")[2]
    def stable(b: bytes) -> list[bytes]:  # the agent's own counters move with every request
        return [ln for ln in b.splitlines() if not ln.startswith((b"perfmon_agent", b"process_", b"python_"))]

    assert stable(body) == stable(plain)


def test_an_accept_header_over_the_header_limit_is_answered_431(make_monitor: Any) -> None:
    """A ~27 KB Accept header is refused with 431 before any parsing."""
    mon = _agent(make_monitor)
    accept = ",".join(f"application/openmetrics-text;q=0.{i % 10}" for i in range(700))  # ~27 KB
    status, _, _ = _raw(mon.url, f"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: {accept}\r\n"
                                 "Connection: close\r\n\r\n".encode())
    assert status.startswith("HTTP/1.1 431")


@pytest.mark.parametrize("capture_id", [
    "../secret.txt", "..%2fsecret.txt", "%2e%2e%2fsecret.txt", "..%252fsecret.txt", "%00", "..", ".",
    "A" * 5000, "%c3%a9", "{id}%00", "{id}%00.meta.json", "{id}.meta.json", "{ID}", "{id}%0d%0aX-Injected:%20yes",
])
def test_hostile_capture_ids_are_404_and_never_reach_the_trace_directory(make_monitor: Any, capture_id: str) -> None:
    """Traversal, encoded, oversized and header-injecting capture ids get a JSON 404 and read nothing from disk."""
    mon = make_monitor(port=0, token=TOKEN).start()
    model = mon.wrap(torch.nn.Linear(4, 4), name="lin")
    x = torch.randn(2, 4)
    cap = mon.capture("lin", steps=1)
    assert wait_capture(mon, cap["id"], drive=lambda: model(x), timeout=60)["outcome"] == "ok"
    (Path(mon.traces.directory) / "secret.txt").write_text("SECRET-SESSION4")
    cid = capture_id.replace("{id}", cap["id"]).replace("{ID}", cap["id"].upper())
    for suffix in ("", "/trace"):
        status, headers, body = _raw(mon.url, f"GET /profiles/{cid}{suffix} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                              f"Authorization: Bearer {TOKEN}\r\nConnection: close\r\n\r\n".encode())
        assert status.startswith("HTTP/1.1 404"), (cid, suffix, status)
        assert b"SECRET-SESSION4" not in body
        assert "x-injected" not in headers
        json.loads(body)  # every refusal is JSON


def test_hostile_record_function_names_survive_capture_api_and_comparison(make_monitor: Any) -> None:
    """Names with markup, quotes and 5000 characters are captured (the capture succeeds) and returned
    intact by /profiles/{id}: in the op table and in the comparison with the baseline."""
    from perfmon.captures.records import CaptureOptions

    names = ["<script>alert(1)</script>", "</td><img src=x onerror=alert(1)>", 'a "quoted" name', "L" * 5000]
    on = {"hostile": False}

    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(32, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lin(x)
            if on["hostile"]:
                for n in names:
                    with torch.profiler.record_function(n):
                        for _ in range(3):
                            y = y @ torch.ones(32, 32) * 0.01
            return y

    mon = make_monitor(port=0, token=TOKEN, manual_captures_per_hour=100).start()
    model = mon.wrap(M(), name="m")
    x = torch.randn(8, 32)
    for _ in range(5):
        model(x)
    base = mon.captures.arm(mon.models.by_name["m"], CaptureOptions(steps=3), trigger="baseline", reason={}).public()
    assert wait_capture(mon, base["id"], drive=lambda: model(x), timeout=60)["outcome"] == "ok"
    on["hostile"] = True
    cap = mon.capture("m", steps=3)
    meta = wait_capture(mon, cap["id"], drive=lambda: model(x), timeout=60)
    assert meta["outcome"] == "ok", meta.get("error")
    status, _, body = http(f"{mon.url}/profiles/{cap['id']}", token=TOKEN)
    assert status == 200
    got = json.loads(body)
    for n in names:
        assert n in got["ops"], n[:40]
    rows = {r["op"]: r for r in got["comparison"]["ops"]}
    for n in names[:2] + names[3:]:
        assert n in rows, n[:40]
    status, _, trace = http(f"{mon.url}/profiles/{cap['id']}/trace", token=TOKEN)
    assert status == 200
    json.loads(gzip.decompress(trace))  # the stored trace is valid JSON (unescaped quotes repaired)


def test_the_status_page_never_parses_data_as_html() -> None:
    """The status page uses no HTML-parsing sink (innerHTML, document.write, eval...) for the agent's data."""
    page = (Path(__file__).parent.parent / "perfmon" / "http" / "static" / "index.html").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert sink not in page, sink


def test_store_download_writes_only_perfmon_names_inside_out(tmp_path: Path) -> None:
    """A download writes only the capture's own metadata and trace names inside --out, whatever the store holds."""
    pytest.importorskip("fsspec")
    from fsspec.implementations.local import LocalFileSystem

    from perfmon.store.remote import download_remote, list_remote

    root = tmp_path / "store"
    cid = "18ea8d3d63ee184900000c"
    folder = root / "m" / "h" / "w" / f"20260101T000000Z-{cid}"
    folder.mkdir(parents=True)
    (folder / f"{cid}.meta.json").write_text(json.dumps({"id": "../../../pwned", "model": "../..",
                                                         "trace_file": "../../pwned.gz"}))
    (folder / "h_1.1.pt.trace.json.gz").write_bytes(b"gz")
    for planted in ("..meta.json", "evil.sh", ".bashrc", "x.pt.trace.json.gz"):
        (folder / planted).write_bytes(b"planted")
    out = tmp_path / "out"
    written = download_remote(f"file://{root}", cid, str(out), fs=LocalFileSystem(), root=str(root))
    assert sorted(os.path.basename(p) for p in written) == [f"{cid}.meta.json", "h_1.1.pt.trace.json.gz"]
    assert sorted(os.listdir(out)) == [f"{cid}.meta.json", "h_1.1.pt.trace.json.gz"]
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "pwned.gz").exists()
    for bad in ("../../etc/passwd", "", "*", cid.upper(), cid + "/..", "x" * 1000):
        with pytest.raises(ValueError):
            download_remote(f"file://{root}", bad, str(out), fs=LocalFileSystem(), root=str(root))
    # The listing keys captures by the folder, whatever the metadata says.
    listed = list_remote(f"file://{root}", fs=LocalFileSystem(), root=str(root))
    assert [p["key"] for p in listed] == [f"m/h/w/20260101T000000Z-{cid}"]


@pytest.mark.parametrize("ids", [(0, 0, 1), (0, 0xB7AD6B7169203331, 1), (0x0AF7651916CD43DD8448EB211C80319C, 0, 1),
                                 (0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, 0)])
def test_invalid_or_unsampled_spans_give_no_exemplar_and_valid_openmetrics(make_monitor: Any,
                                                                            ids: tuple[int, int, int]) -> None:
    """An invalid or unsampled OpenTelemetry span adds no exemplar, and every exposition format stays valid."""
    trace = pytest.importorskip("opentelemetry.trace")
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    trace_id, span_id, flags = ids
    ctx = trace.SpanContext(trace_id, span_id, is_remote=False, trace_flags=trace.TraceFlags(flags))
    mon = make_monitor(port=0, token=TOKEN, sample_rate=1.0, warmup_calls=0).start()
    model = mon.wrap(torch.nn.Linear(4, 4), name="lin")
    with trace.use_span(trace.NonRecordingSpan(ctx)):
        for _ in range(20):
            model(torch.randn(1, 4))
    assert mon.flush()
    om = "application/openmetrics-text; version=1.0.0"
    status, headers, body = http(mon.url + "/metrics", headers={"Accept": om})
    assert status == 200 and headers["content-type"].startswith("application/openmetrics-text")
    assert b" # {" not in body
    list(text_string_to_metric_families(body.decode()))
    status, _, pb = http(mon.url + "/metrics", headers={"Accept": PROTOBUF})
    assert status == 200
    protowire.families(pb)
