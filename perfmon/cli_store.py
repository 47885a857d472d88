"""``perfmon profiles --store``: the fleet's captures in object storage (``trace_store``), listed or downloaded.

Kept apart from the agent's subcommands (``cli.py``): its exchanges are the object store SDK's, which bound a
connect and a read but not a request, so the whole command runs on a thread of its own under ``--timeout``, and
what an SDK says is scrubbed of the URL's user-info before it is shown.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from typing import Any, TextIO

from . import client
from .cli_report import listing_or_none
from .client import ControlError
from .client import clean as _clean
from .exceptions import ConfigError

__all__ = ["store_profiles"]


def store_profiles(store: str, *, model: str | None = None, host: str | None = None, trigger: str | None = None,
                   since: float | None = None, limit: int = 100, download: str | None = None, out: str = ".",
                   stdout: TextIO | None = None, stderr: TextIO | None = None, timeout: float = 120.0) -> int:
    """List the fleet's captures in object storage (``trace_store``), newest first, or download one, within
    ``timeout`` seconds in all (each request to the store within it too).

    Metadata objects the listing cannot use (over 1 MiB, not JSON, a field of the wrong type: see
    ``perfmon.store.remote.list_remote``) are left out and counted in one line on ``stderr``.
    """
    from .store.remote import download_remote, list_remote, redact, scrub

    stdout = stdout if stdout is not None else sys.stdout
    stderr = stderr if stderr is not None else sys.stderr
    skipped: list[tuple[str, str]] = []
    # An SDK that logs its own failures (gcsfs, with a traceback) reaches stderr through logging's last resort
    # when nothing handles them: this command says what failed in one line of its own.
    logging.getLogger().addHandler(logging.NullHandler())

    def on_skip(key: str, reason: str) -> None:
        skipped.append((key, reason))

    def work() -> list[str] | list[dict[str, Any]]:
        if download is not None:
            return download_remote(store, download, out, on_skip=on_skip, timeout_seconds=timeout)
        return list_remote(store, model=model, host=host, trigger=trigger, since=since, limit=limit,
                           on_skip=on_skip, timeout_seconds=timeout)

    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(_outcome(work)), name="perfmon-store", daemon=True)
    thread.start()
    thread.join(timeout)  # the SDK's timeouts bound a connect and a read, not a request: this bounds the command
    if not result:
        raise client.TimedOut(f"{redact(store)}: no answer within {timeout:g} s")
    ok, value = result[0]
    if not ok:
        exc = value
        if isinstance(exc, (LookupError, ValueError, ConfigError)):
            raise ControlError(scrub(str(exc), store)) from None
        # The SDK's errors (no credentials, no bucket, unreachable): say which store, never its user-info.
        raise ControlError(f"{redact(store)}: {type(exc).__name__}: {scrub(str(exc), store)}") from None
    if download is not None:
        for key, reason in skipped:
            print(f"perfmon: skipped {_clean(key, 300)}: {_clean(reason, 300)}", file=stderr)
        for path in value:
            print(_clean(path), file=stdout)
        return 0
    profiles = value
    if skipped:
        print(f"perfmon: skipped {len(skipped)} metadata objects (malformed or unreadable; "
              f"first: {_clean(skipped[0][0], 200)}: {_clean(skipped[0][1], 200)})", file=stderr)
    for line in listing_or_none(profiles, fleet=True):
        print(line, file=stdout)
    return 0


def _outcome(fn: Callable[[], Any]) -> tuple[bool, Any]:
    """(True, what ``fn()`` returned) or (False, the Exception it raised)."""
    try:
        return True, fn()
    except Exception as exc:
        return False, exc
