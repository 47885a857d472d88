"""Captures on gs:// (gcsfs) against a real GCS emulator (gcp-storage-emulator) on 127.0.0.1: the same uploader
and CLI as S3, through Google's SDK and its credential chain (STORAGE_EMULATOR_HOST points it at the emulator).

The outage and restart behaviour is the uploader's own and is proven against S3 in test_upload_s3.py; one
thing differs on gs://: gcsfs retries a failed request itself (six tries, ~31 s of sleeps) before the
uploader's own backoff applies, so an attempt during an outage lasts that long or more (docs/design.md;
on the upload thread)."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from perfmon.cli import main

from .conftest import wait_capture, wait_until
from .prom import free_port

pytest.importorskip("gcsfs")
pytest.importorskip("gcp_storage_emulator")

BUCKET = "perfmon-gcs"


@pytest.fixture
def emulator(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """gcp-storage-emulator on a free port with one bucket; yields the gs:// URL of the fleet prefix."""
    port = free_port()
    log = (tmp_path / "gcs.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1",
                             "--port", str(port), "--in-memory", "--default-bucket", BUCKET],
                            stdout=log, stderr=log)

    def up() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            return False

    try:
        wait_until(up, timeout=30, what="the GCS emulator")
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
        yield f"gs://{BUCKET}/fleet"
    finally:
        proc.kill()
        proc.wait(10)
        log.close()


def _listed(capsys: pytest.CaptureFixture[str], url: str, *args: str) -> list[str]:
    capsys.readouterr()
    assert main(["profiles", "--store", url, *args]) == 0
    return [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:] if line and line[0] != "n"]


def test_captures_go_up_to_gs_and_the_cli_lists_and_downloads_them(make_monitor, emulator: str, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Two captures of a live monitor are uploaded to gs:// once each (trace, then metadata); the CLI lists
    them with their filters and downloads a trace byte for byte."""
    import gcsfs

    mon = make_monitor(sample_rate=1.0, trace_store=emulator).start()
    model = mon.wrap(torch.nn.Linear(8, 8), name="enc")
    x = torch.randn(2, 8)
    ids = []
    for _ in range(2):
        cap = mon.capture("enc", steps=1)
        assert wait_capture(mon, cap["id"], drive=lambda: model(x), timeout=60)["outcome"] == "ok"
        ids.append(cap["id"])
    uploads = mon.uploads
    assert uploads is not None
    wait_until(lambda: uploads.stats.uploads["ok"] == 2, timeout=60, what="both uploads")
    assert uploads.stats.uploads["failed"] == 0 and uploads.stats.spool_files == 0
    assert sorted(_listed(capsys, emulator)) == sorted(ids)
    assert _listed(capsys, emulator, "--model", "enc", "--trigger", "manual") != []
    assert _listed(capsys, emulator, "--model", "other") == []
    objects = gcsfs.GCSFileSystem(skip_instance_cache=True).find(f"{BUCKET}/fleet")
    assert len(objects) == 4 and sum(o.endswith(".meta.json") for o in objects) == 2, objects  # nothing twice
    out = tmp_path / "downloaded"
    out.mkdir()
    assert main(["profiles", "--store", emulator, "--download", ids[0], "--out", str(out)]) == 0
    local = mon.traces.read_trace(ids[0])
    assert local is not None
    name, data = local
    assert (out / name).read_bytes() == data
