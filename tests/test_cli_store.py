"""``perfmon profiles --store`` where the store misbehaves: a hung endpoint, a bucket that does not exist, credentials
in the URL. The CLI runs as a user runs it, in a subprocess; moto's S3 API and a silent listener on 127.0.0.1."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("s3fs")
pytest.importorskip("moto")

from perfmon.store.remote import scrub

from .stores import SilentServer, s3_server

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cli(endpoint: str, *args: str, timeout: float = 90.0) -> tuple[int, str, str, float]:
    env = {**os.environ, "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1", "PYTHONPATH": str(ROOT)}
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "perfmon", "profiles", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)
    return done.returncode, done.stdout, done.stderr, time.monotonic() - t0


def test_the_store_listing_ends_by_its_timeout_against_a_store_that_never_answers() -> None:
    """--timeout was not passed to the store: against an endpoint that accepts and never answers, --timeout 3 took
    61.7 s (the SDK's 30 s, twice). The whole command ends by it now, in one line, exit 1."""
    silent = SilentServer()
    try:
        code, out, err, took = _cli(f"http://127.0.0.1:{silent.port}", "--store", "s3://bkt/fleet", "--timeout", "3")
    finally:
        silent.close()
    assert code == 1 and out == ""
    assert took < 20, took  # 3 s and a Python start-up with s3fs imported, on a loaded 2-core box
    assert "no answer within 3 s" in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_a_bucket_that_does_not_exist_is_an_error_not_an_empty_fleet() -> None:
    """A mistyped bucket listed as "no captures", exit 0: a fleet with nothing to show. It is an error now; an
    existing bucket with nothing under the prefix is still "no captures"."""
    port = _free_port()
    with s3_server(port) as url:
        import boto3

        boto3.client("s3", endpoint_url=url, aws_access_key_id="testing", aws_secret_access_key="testing",
                     region_name="us-east-1").create_bucket(Bucket="real")
        missing = _cli(url, "--store", "s3://nobucket/fleet", "--timeout", "30")
        empty = _cli(url, "--store", "s3://real/fleet", "--timeout", "30")
    assert missing[0] == 1 and "no such bucket" in missing[2] and "Traceback" not in missing[2]
    assert empty[0] == 0 and empty[1].strip() == "no captures"


def test_credentials_in_the_urls_user_info_never_reach_a_message() -> None:
    """s3fs quotes the bucket it was given, user-info and all ("Invalid bucket name "AKID:SECRET@bkt""): the
    whole URL was replaced by its redaction, not the piece the SDK quoted. Every piece of it is now; the CLI's
    messages are scrubbed as the agent's are."""
    url = "s3://AKIDEXAMPLE:wJalr%2FSECRETKEY@bkt/prefix?sig=abcdef123"
    message = 'Invalid bucket name "AKIDEXAMPLE:wJalr/SECRETKEY@bkt": ... wJalr%2FSECRETKEY ... sig=abcdef123'
    cleaned = scrub(message, url)
    for secret in ("AKIDEXAMPLE", "SECRETKEY", "abcdef123"):
        assert secret not in cleaned, cleaned
    assert "@bkt" in cleaned  # what is not secret still says where
    silent = SilentServer()
    try:
        code, _, err, _ = _cli(f"http://127.0.0.1:{silent.port}", "--store", url, "--timeout", "3")
    finally:
        silent.close()
    assert code != 0 and "AKIDEXAMPLE" not in err and "SECRETKEY" not in err


def test_only_a_clear_not_found_makes_an_empty_listing_an_error() -> None:
    """A role allowed to list its prefix may not read the bucket itself (403 on the probe), and a probe may fail:
    the first bucket check (fs.exists, which makes any failure False) turned such a working store into "no such
    bucket". Only a listing that found nothing and a probe that says "not found" is one."""
    from perfmon.store.remote import list_remote

    class Store:
        protocol = ("s3", "s3a")

        def __init__(self, probe: Exception) -> None:
            self.probe = probe

        def glob(self, pattern: str, detail: bool = True) -> dict[str, Any]:
            return {}

        def info(self, path: str) -> dict[str, Any]:
            raise self.probe

    assert list_remote("s3://bkt/p", fs=Store(PermissionError("403 Forbidden")), root="bkt/p") == []
    assert list_remote("s3://bkt/p", fs=Store(TimeoutError("throttled")), root="bkt/p") == []
    with pytest.raises(LookupError, match="no such bucket"):
        list_remote("s3://bkt/p", fs=Store(FileNotFoundError("NoSuchBucket")), root="bkt/p")
