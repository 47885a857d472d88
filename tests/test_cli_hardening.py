"""The CLI's client side against a hostile or corrupt store or agent: `perfmon profiles --store` (listing and
--download) and `perfmon diff` never write outside --out, never crash on one bad object, never print a
terminal escape sequence, and refuse a malformed capture id before any request."""

from __future__ import annotations

import io
import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from perfmon import cli
from perfmon.cli import _clean, diff_profiles, main, store_profiles
from perfmon.store.files import new_id
from perfmon.store.remote import download_remote, list_remote

pytest.importorskip("fsspec")  # perfmon.store.uploader imports it when a store is opened

TRACE = "h_1.1.pt.trace.json.gz"
#: What no line printed to a terminal may contain: C0 controls, DEL, C1 controls (ESC, CSI, OSC, BEL, CR...).
FORBIDDEN = [chr(c) for c in (*range(0x00, 0x0A), *range(0x0B, 0x20), *range(0x7F, 0xA0))]


def _capture(root: Path, cid: str, meta: Any, *, model: str = "m", trace: bytes | None = None) -> Path:
    """A capture folder as the uploader writes it: {model}/{host}/{worker}/{stamp}-{id}/{id}.meta.json (+ trace)."""
    folder = root / model / "h" / "w" / f"20260101T000000Z-{cid}"
    folder.mkdir(parents=True)
    body = meta if isinstance(meta, (str, bytes)) else json.dumps(meta)
    (folder / f"{cid}.meta.json").write_bytes(body.encode() if isinstance(body, str) else body)
    if trace is not None:
        (folder / TRACE).write_bytes(trace)
    return folder


def _ok(cid: str, **fields: Any) -> dict[str, Any]:
    return {"id": cid, "model": "m", "trigger": "manual", "outcome": "ok", "steps_recorded": 5,
            "ended_at": "2026-01-01T00:00:00+00:00", "trace_file": TRACE, **fields}


def _no_controls(text: str) -> None:
    bad = sorted({repr(c) for c in text if c in FORBIDDEN and c != "\n"})
    assert not bad, f"control characters printed: {bad} in {text!r}"


# -- 1. --download writes only inside --out, never through a link, never a link's target ----------------

def test_download_never_writes_through_a_link_planted_in_out(tmp_path: Path) -> None:
    """A symbolic link already in --out under the metadata's name is refused, its target left intact."""
    root = tmp_path / "store"
    cid = new_id()
    _capture(root, cid, _ok(cid, note="ATTACKER CONTENT"), trace=b"gz")
    victim = tmp_path / "victim_bashrc"
    victim.write_text("ORIGINAL\n")
    out = tmp_path / "shared_out"
    out.mkdir()
    (out / f"{cid}.meta.json").symlink_to(victim)
    with pytest.raises(ValueError, match="not a regular file"):
        download_remote(f"file://{root}", cid, str(out))
    assert victim.read_text() == "ORIGINAL\n"
    assert (out / f"{cid}.meta.json").is_symlink()
    assert not [n for n in os.listdir(out) if n.endswith(".part")]  # no temp file left behind
    assert main(["profiles", "--store", f"file://{root}", "--download", cid, "--out", str(out)]) == 1
    assert victim.read_text() == "ORIGINAL\n"
    # A link to a directory (or a directory) under a trace's name is refused too, never written into.
    (out / f"{cid}.meta.json").unlink()
    (out / TRACE).unlink()  # the trace went first (a regular file, fine); now a directory under its name
    (out / TRACE).mkdir()
    with pytest.raises(ValueError, match="not a regular file"):
        download_remote(f"file://{root}", cid, str(out))
    assert os.listdir(out / TRACE) == []


def test_download_writes_private_files_and_replaces_a_regular_file(tmp_path: Path) -> None:
    """Files land 0600 under their names (metadata last); a second download replaces them (idempotent)."""
    root = tmp_path / "store"
    cid = new_id()
    _capture(root, cid, _ok(cid), trace=b"trace-bytes")
    out = tmp_path / "out"
    first = download_remote(f"file://{root}", cid, str(out))
    assert [Path(p).name for p in first] == [TRACE, f"{cid}.meta.json"]
    assert (out / TRACE).read_bytes() == b"trace-bytes"
    assert stat.S_IMODE((out / TRACE).stat().st_mode) == 0o600
    (out / TRACE).write_bytes(b"stale")
    assert download_remote(f"file://{root}", cid, str(out)) == first
    assert (out / TRACE).read_bytes() == b"trace-bytes"
    assert sorted(os.listdir(out)) == sorted([TRACE, f"{cid}.meta.json"])


def test_download_skips_links_and_directories_in_the_store(tmp_path: Path) -> None:
    """A trace-named symbolic link (to a file outside the store) or directory in a file:// store is not fetched."""
    root = tmp_path / "store"
    cid = new_id()
    folder = _capture(root, cid, _ok(cid), trace=b"gz")
    secret = tmp_path / "secret"
    secret.write_text("outside the store")
    (folder / "h_9.9.pt.trace.json.gz").symlink_to(secret)
    (folder / "h_8.8.pt.trace.json.gz" / "sub").mkdir(parents=True)
    out = tmp_path / "out"
    skipped: list[tuple[str, str]] = []
    written = download_remote(f"file://{root}", cid, str(out), on_skip=lambda k, r: skipped.append((k, r)))
    assert sorted(os.listdir(out)) == sorted([TRACE, f"{cid}.meta.json"])
    assert sorted(Path(p).name for p in written) == sorted([TRACE, f"{cid}.meta.json"])
    assert sorted(k.rsplit("/", 1)[1] for k, _ in skipped) == ["h_8.8.pt.trace.json.gz", "h_9.9.pt.trace.json.gz"]
    # Metadata that is itself a link is no capture: nothing is fetched.
    other = new_id()
    linked = _capture(root, other, _ok(other))
    (linked / f"{other}.meta.json").unlink()
    (linked / f"{other}.meta.json").symlink_to(folder / f"{cid}.meta.json")
    with pytest.raises(LookupError):
        download_remote(f"file://{root}", other, str(tmp_path / "out2"))
    assert not (tmp_path / "out2").exists() or os.listdir(tmp_path / "out2") == []


def test_the_same_id_under_two_keys_is_ambiguous(tmp_path: Path, capsys: Any) -> None:
    """Two model folders holding one id: an error naming both keys, nothing written (no silent overwrite)."""
    root = tmp_path / "store"
    cid = new_id()
    _capture(root, cid, _ok(cid), trace=b"one")
    _capture(root, cid, _ok(cid, model="m2"), model="m2", trace=b"two")
    out = tmp_path / "out"
    with pytest.raises(LookupError, match="ambiguous id") as info:
        download_remote(f"file://{root}", cid, str(out))
    assert f"m/h/w/20260101T000000Z-{cid}" in str(info.value)
    assert f"m2/h/w/20260101T000000Z-{cid}" in str(info.value)
    assert not out.exists()
    assert main(["profiles", "--store", f"file://{root}", "--download", cid, "--out", str(out)]) == 1
    assert "ambiguous id" in capsys.readouterr().err


def test_a_local_store_that_does_not_exist_is_an_error_not_an_empty_listing(tmp_path: Path, capsys: Any) -> None:
    """`--store file:///typo` is exit 1 saying there is no such directory (it listed "no captures", exit 0); an empty
    store that exists lists none; a malformed --download id is a usage error (2) as with --url, before any read."""
    assert main(["profiles", "--store", f"file://{tmp_path}/missing"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("perfmon: ") and "no such directory" in err and err.count("\n") == 1, err
    (tmp_path / "empty").mkdir()
    assert main(["profiles", "--store", f"file://{tmp_path}/empty"]) == 0
    assert capsys.readouterr().out == "no captures\n"
    assert main(["profiles", "--store", f"file://{tmp_path}/empty", "--download", "../x"]) == 2
    assert "not a capture id" in capsys.readouterr().err


def test_download_refuses_an_object_over_its_cap(tmp_path: Path) -> None:
    """A trace over REMOTE_TRACE_MAX_BYTES (or metadata over REMOTE_META_MAX_BYTES) is refused, nothing left."""
    root = tmp_path / "store"
    cid = new_id()
    _capture(root, cid, _ok(cid), trace=b"x" * 5000)
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="limit"):
        download_remote(f"file://{root}", cid, str(out), trace_max_bytes=4096)
    assert os.listdir(out) == []
    with pytest.raises(ValueError, match="limit"):
        download_remote(f"file://{root}", cid, str(out), trace_max_bytes=2**20, meta_max_bytes=10)
    assert os.listdir(out) == [TRACE]  # the trace went first; the metadata (which makes it a capture) did not


# -- 2. one hostile metadata object never breaks the listing -------------------------------------------

HOSTILE: dict[str, Any] = {
    "dict_model": {"model": {"a": 1}},
    "list_outcome": {"outcome": ["ok"]},
    "dict_outcome": {"outcome": {"x": 1}},
    "dict_steps": {"steps_recorded": {"n": 1}},
    "null_steps": {"steps_recorded": None},
    "str_steps": {"steps_recorded": "abc"},
    "nan_steps": {"steps_recorded": float("nan")},
    "list_trigger": {"trigger": ["x"]},
    "list_ended_at": {"ended_at": [1]},
    "cmp_list": {"comparison": {"summary": ["a", "b"]}},
    "cmp_str": {"comparison": "x"},
    "deep_array": "[" * 100_000 + "]" * 100_000,
    "deep_object": '{"a":' * 50_000 + "1" + "}" * 50_000,
    "not_object": "[1, 2, 3]",
    "not_json": b"\xff\xfe garbage",
    "huge": {"model": "M" * (2**20 + 10)},
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_one_malformed_metadata_object_is_skipped_and_counted(tmp_path: Path, case: str, capsys: Any) -> None:
    root = tmp_path / "store"
    good, bad = new_id(), new_id()
    _capture(root, good, _ok(good))
    hostile = HOSTILE[case]
    _capture(root, bad, {**_ok(bad), **hostile} if isinstance(hostile, dict) else hostile, model="x")
    assert main(["profiles", "--store", f"file://{root}"]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert len(lines) == 2 and lines[1].startswith(good), captured
    assert captured.err.startswith("perfmon: skipped 1 metadata objects (malformed or unreadable; first: x/")
    assert bad in captured.err and captured.err.count("\n") == 1


def test_the_listing_takes_the_id_from_the_folder(tmp_path: Path) -> None:
    """A metadata object whose own id is a list, null or a path is listed under its folder's id (what
    --download takes), never under what it says."""
    root = tmp_path / "store"
    ids = [new_id() for _ in range(3)]
    for cid, claimed in zip(ids, (["x"], None, "../../pwned")):
        _capture(root, cid, _ok(cid, id=claimed))
    assert sorted(p["id"] for p in list_remote(f"file://{root}")) == sorted(ids)


def test_an_oversized_metadata_object_is_not_read(tmp_path: Path) -> None:
    """A metadata object over the listing's cap is skipped unread and reported through on_skip."""
    root = tmp_path / "store"
    cid = new_id()
    _capture(root, cid, _ok(cid))
    skipped: list[tuple[str, str]] = []
    assert list_remote(f"file://{root}", meta_max_bytes=10, on_skip=lambda k, r: skipped.append((k, r))) == []
    assert len(skipped) == 1 and "over 10" in skipped[0][1]


def test_the_store_listing_prints_no_terminal_escapes(tmp_path: Path) -> None:
    root = tmp_path / "store"
    cid = new_id()
    _capture(root, cid, _ok(cid, model="\x1b[31mred\r\x1b[K", trigger="manual\x1b[8m", outcome="ok\n\nfake line",
                             ended_at="\x1b]0;pwned\x07\x9b2J2026", comparison={"summary": "\x1b[2Jslower\x07"}))
    out, err = io.StringIO(), io.StringIO()
    assert store_profiles(f"file://{root}", stdout=out, stderr=err) == 0
    text = out.getvalue()
    _no_controls(text)
    row = text.splitlines()[1]
    assert row.split()[:4] == [cid, "red", "h", "manual"] and "okfake line" in row and "2026" in row
    assert "slower" in row and "pwned" not in row


def test_the_agent_listing_prints_no_terminal_escapes() -> None:
    """`perfmon profiles --url`: every field cleaned, wrong-typed ones shown as text, never a TypeError."""
    profiles = [{"id": "\x1b]0;title\x07abc", "model": "\x1b[31mm", "trigger": ["x"], "status": None,
                 "outcome": {"a": 1}, "steps_recorded": {"n": 1}, "armed_at": "\r2026",
                 "comparison": {"summary": "\x9b2Jfaster"}}, "not an object"]
    out = io.StringIO()
    assert cli.list_profiles("http://agent", token=None, stdout=out,
                             transport=lambda url, **_: (200, {}, json.dumps({"profiles": profiles}).encode())) == 0
    _no_controls(out.getvalue())
    assert out.getvalue().splitlines()[1].split()[:2] == ["abc", "m"]


def test_clean_strips_escape_sequences_and_controls() -> None:
    assert _clean("\x1b[31mred\x1b[0m") == "red"
    assert _clean("a\x1b]0;title\x07b") == "ab"
    assert _clean("a\x1b]8;;http://x\x1b\\link\x1b]8;;\x1b\\b") == "alinkb"
    assert _clean("a\x9b2Jb\x9d0;t\x9cc") == "abc"
    assert _clean("a\x00b\x7fc\x85d\re\nf\tg\x08h") == "abcdefgh"
    assert _clean("a\x1b(Bb\x1bcc") == "abc"
    assert _clean("\u202eevil\u2066") == "evil"
    assert _clean("aten::mm — µs") == "aten::mm — µs"
    assert _clean(["x"]) == "['x']" and _clean(None) == "None"
    assert _clean("M" * 10_000, 16) == "M" * 16


# -- 3. `perfmon diff` -------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", ["", "..", "../profiles", "%2e%2e", "ID/trace", "ID?x", "ID\r\nX-A: b", "é",
                                 "a" * 5000, "UPPER"])
def test_diff_refuses_a_malformed_id_before_any_request(bad: str, capsys: Any) -> None:
    """A malformed capture id is a usage error (exit 2, or ControlError from diff_profiles) before any request."""
    calls: list[str] = []

    def transport(url: str, **_: Any) -> tuple[int, dict[str, str], bytes]:
        calls.append(url)
        return 200, {}, b"{}"

    good = new_id()
    bad = good.upper() if bad == "UPPER" else bad.replace("ID", good)
    assert main(["diff", "--url", "http://agent", bad, good], transport=transport) == 2
    assert main(["diff", "--url", "http://agent", good, bad], transport=transport) == 2
    err = capsys.readouterr().err
    assert "not a capture id" in err and "Traceback" not in err and len(err) < 800
    _no_controls(err)
    with pytest.raises(cli.ControlError, match="not a capture id"):
        diff_profiles("http://agent", bad, good, token=None, transport=transport)
    assert calls == []


def _agent(before_ops: Any, after_ops: Any, *, raw: bytes | None = None, top: Any = None) -> cli.Transport:
    """A fake agent's transport: GET /profiles/{id} answers the first id's metadata with ``before_ops``, others
    ``after_ops`` (or ``raw`` bytes); with ``top``, both carry it as their top-level op table."""
    first: list[str] = []

    def request(url: str, **_: Any) -> tuple[int, dict[str, str], bytes]:
        cid = url.rsplit("/", 1)[1]
        if not first:
            first.append(cid)
        ops = before_ops if cid == first[0] else after_ops
        if raw is not None and cid != first[0]:
            return 200, {}, raw
        meta = {"id": cid, "model": "m", "device": "cpu", "steps": 5, "trigger": "manual", "ops": ops}
        if top is not None:
            meta["top_ops"] = top
        return 200, {}, json.dumps(meta).encode()

    return request


GOOD_OPS = {"aten::mm": {"seconds_per_step": 0.001, "seconds_per_step_stdev": 0.0, "calls_per_step": 1}}


@pytest.mark.parametrize("ops, raw", [
    ({"\x1b]0;pwn\x07op": {"seconds_per_step": "abc", "calls_per_step": 1}}, None),
    ({"op": {"seconds_per_step": 0.1, "calls_per_step": [1]}}, None),
    ({"op": {"seconds_per_step": 0.1, "seconds_per_step_stdev": True}}, None),
    ({"op": [1, 2]}, None),
    ({"op": {"seconds_per_step": float("nan"), "calls_per_step": 1}}, None),
    ({"op": {"seconds_per_step": float("inf"), "calls_per_step": 1}}, None),
    (None, b"[" * 100_000),
    (None, b"\x1f\x8b\x08gzip, not JSON"),
    (None, b"[1, 2]"),
])
def test_diff_against_a_hostile_agent_is_a_clear_error(ops: Any, raw: bytes | None, capsys: Any) -> None:
    """A malformed op table or answer from the agent is one clean `perfmon:` error line (exit 1), no traceback."""
    transport = _agent(GOOD_OPS, ops, raw=raw)
    assert main(["diff", "--url", "http://agent", new_id(), new_id()], transport=transport) == 1
    captured = capsys.readouterr()
    assert captured.err.startswith("perfmon: ") and "Traceback" not in captured.err
    _no_controls(captured.err)
    _no_controls(captured.out)


@pytest.mark.parametrize("top", [
    {"op": {"seconds_per_step": "abc", "share_of_steps": 1}},
    {"op": {"seconds_per_step": 0.1, "seconds_per_step_median": "abc", "share_of_steps": 1}},
    {"op": {"seconds_per_step": 0.1, "seconds_per_step_median": 10 ** 400, "share_of_steps": 1}},
    {"op": {"seconds_per_step": 0.1, "seconds_per_step_median": float("nan"), "share_of_steps": 1}},
    {"op": [1]},
    {"op": {"seconds_per_step": 0.1, "breakdown": [1]}},
    {"op": {"seconds_per_step": 0.1, "breakdown": {"mm": {"seconds_per_step": "abc"}}}},
    {"op": {"seconds_per_step": 0.1, "breakdown": {"mm": {"seconds_per_step_stdev": 1e300}}}},
])
def test_diff_against_a_hostile_top_level_table_is_a_clear_error(top: Any, capsys: Any) -> None:
    """compare reads the top-level table and its breakdowns too: a malformed one is one clean error line."""
    transport = _agent(GOOD_OPS, GOOD_OPS, top=top)
    assert main(["diff", "--url", "http://agent", new_id(), new_id()], transport=transport) == 1
    captured = capsys.readouterr()
    assert captured.err.startswith("perfmon: ") and "Traceback" not in captured.err, captured.err
    _no_controls(captured.err)


def test_diff_prints_op_names_without_terminal_escapes(capsys: Any) -> None:
    """An op name carrying terminal escapes is printed cleaned, in the table and in the summary line."""
    transport = _agent(GOOD_OPS, {"\x1b[2J\x1b]0;title\x07evil\r": {"seconds_per_step": 0.5, "calls_per_step": 1}})
    assert main(["diff", "--url", "http://agent", new_id(), new_id(), "--rows", "3"], transport=transport) == 0
    out = capsys.readouterr().out
    _no_controls(out)
    rows = [line for line in out.splitlines() if line.startswith("evil")]
    assert rows and rows[0].split()[:2] == ["evil", "new"], out
    assert "new evil adds" in out.splitlines()[-1]


# -- `perfmon profile`: the agent's answer never names a local path --------------------------------------

def test_profile_never_takes_a_file_name_from_the_agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`perfmon profile` saves the trace under the capture id's name, never a path or an id the agent makes up."""
    cid = new_id()

    def request(url: str, **_: Any) -> tuple[int, dict[str, str], bytes]:
        if url.endswith("/profile"):
            return 200, {}, json.dumps({"id": cid}).encode()
        if url.endswith("/trace"):
            return 200, {}, b"trace"
        return 200, {}, json.dumps({"id": cid, "status": "done", "outcome": "ok",
                                    "trace_file": "../../escaped.pt.trace.json.gz"}).encode()

    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    assert cli.run_profile("http://agent", token=None, stdout=io.StringIO(), transport=request) == 0
    assert os.listdir(work) == [f"{cid}.pt.trace.json.gz"] and not (tmp_path / "escaped.pt.trace.json.gz").exists()
    with pytest.raises(cli.ControlError, match="no capture id"):
        cli.run_profile("http://agent", token=None, stdout=io.StringIO(),
                        transport=lambda url, **_: (200, {}, json.dumps({"id": "../../x"}).encode()))
