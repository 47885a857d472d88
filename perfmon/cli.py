"""The ``perfmon`` command line: the demo, and the commands that drive an agent's capture API (``profile``,
``profiles``, ``diff``): their arguments, their checks of what the agent answers, and what they print.

The agent at ``--url`` is not trusted (a broken build, a compromised pod, something else on its port): what it
says is printed only through ``_clean`` (no terminal control sequence gets through) and its answers are checked
before use. The HTTP exchange itself, with its deadline, size caps and refused redirects, is ``perfmon.client``.

Exit status: 0 done; 1 the agent (or store) refused, failed, could not be reached, ran out the ``--timeout``, or
answered something malformed, oversized or a redirect (one ``perfmon: ...`` line on stderr says which); 2 a
usage error (the arguments, a malformed capture id, ``--url`` or token); 130 interrupted (Ctrl-C); 141 stdout was
closed by its reader (``perfmon profile ... | head -3``): the rest is dropped without a word, and 141 is what a shell
reports for a command killed by SIGPIPE, so ``set -o pipefail`` sees what it sees for ``yes | head``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import urllib.parse
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from . import client
from ._version import __version__
from .cli_report import check_ops as _check_ops
from .cli_report import left_behind as _left_behind
from .cli_report import listing_or_none
from .cli_report import malformed as _malformed
from .cli_report import report as _report
from .cli_report import step_counts as _step_counts
from .cli_store import store_profiles
from .client import ANSWER_MAX_BYTES, TRACE_MAX_BYTES, ControlError, Transport, http_request
from .client import clean as _clean  # the name every line here, and the tests, use
from .config import TOKEN_ENDS
from .exceptions import ConfigError
from .store.files import TRACE_NAME, valid_id

__all__ = ["ANSWER_MAX_BYTES", "EXIT_BROKEN_PIPE", "EXIT_INTERRUPTED", "TRACE_MAX_BYTES", "ControlError",
           "Interrupted", "Transport", "diff_profiles", "http_request", "list_profiles", "main", "run_profile",
           "store_profiles"]


def _positive(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1e9:  # not inf, nan or 1e308: a deadline that far out overflows the socket's clock
        raise argparse.ArgumentTypeError(f"must be a number > 0 and at most 1e9, got {text}")
    return value


def _at_least(low: int) -> Any:
    def count(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text}")
        return value

    return count


def _since(text: str) -> float:
    """Unix seconds from an ISO 8601 time (UTC unless it says otherwise) or a span back from now (30m, 6h, 2d)."""
    from datetime import datetime, timezone

    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    text = text.strip()
    try:
        if text and text[-1] in units and text[:-1].replace(".", "", 1).isdigit():
            return time.time() - float(text[:-1]) * units[text[-1]]
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a time (2025-05-01T12:00:00Z) or a span (30m, 6h, 2d), "
                                         f"got {text!r}") from None
    return (when if when.tzinfo else when.replace(tzinfo=timezone.utc)).timestamp()


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be 0..65535 (0 = any free port), got {text}")
    return value



_EXIT_STATUS = ("exit status: 0 done; 1 the agent refused, failed, was unreachable, ran out the --timeout or "
                "answered something malformed, oversized or a redirect; 2 a usage error; 130 interrupted; 141 stdout "
                "closed by its reader (| head)")
#: A reader that closed stdout early: 128 + SIGPIPE, what a shell reports for a writer SIGPIPE killed.
EXIT_BROKEN_PIPE = 141
EXIT_INTERRUPTED = 130


class Interrupted(ControlError):
    """Ctrl-C while the command waited on the agent (exit status 130)."""



def _agent_url(text: str) -> str:
    """``--url``: an agent's base URL (``url_problem``), without its trailing "/"."""
    problem = client.url_problem(text)
    if problem is None:
        return text.rstrip("/")
    shown = "" if "@" in text else f": {_clean(repr(text), 120)}"
    raise argparse.ArgumentTypeError(f"{problem}{shown}; expected e.g. http://127.0.0.1:9478")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="perfmon", description="In-process performance monitor for PyTorch.")
    parser.add_argument("--version", action="version", version=f"perfmon {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="serve a real model from several threads with the monitor on")
    demo.add_argument("--host", default=None, help="bind address (default 127.0.0.1, or PERFMON_HOST)")
    demo.add_argument("--port", type=_port, default=None, help="HTTP port; 0 = any free port (default 9478)")
    demo.add_argument("--duration", type=_positive, default=None, help="seconds to run (default: until Ctrl-C)")
    demo.add_argument("--rps", type=_positive, default=None,
                      help="target requests per second (default 50; 4 with --generate)")
    demo.add_argument("--threads", type=_at_least(1), default=3, help="worker threads (default 3)")
    demo.add_argument("--sample-rate", type=float, default=None, help="fraction of steady calls timed")
    demo.add_argument("--slow-after", type=_positive, default=None,
                      help="simulate a 2x latency regression after this many seconds (perfmon captures it)")
    demo.add_argument("--generate", action="store_true",
                      help="serve a tiny random GPT-2 with streaming requests instead: prefill vs decode, time to "
                           "first token, inter-token latency, tokens (needs transformers; nothing is downloaded)")

    def control(name: str, help_text: str, *, url_required: bool = True) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, epilog=_EXIT_STATUS)
        p.add_argument("--url", type=_agent_url, required=url_required,
                       help="the agent's base URL, e.g. http://127.0.0.1:9478 (redirects are not followed)")
        p.add_argument("--token", default=None,
                       help="bearer token (default: $PERFMON_TOKEN, which is better: an argument shows in `ps` "
                            "and shell history)")
        p.add_argument("--timeout", type=_positive, default=120.0,
                       help="seconds for all the command's exchanges with the agent (connecting, every answer, "
                            "the trace) or, with --store, the object store (default 120)")
        return p

    prof = control("profile", "trigger a capture, wait for it, download the trace, print the top ops")
    prof.add_argument("--model", default=None, help="model name (default: the only one)")
    prof.add_argument("--steps", type=int, default=None, help="forward calls to record (1..100, default 5)")
    prof.add_argument("--max-seconds", type=_positive, default=None, help="window limit (default 10)")
    prof.add_argument("--out", default=None,
                      help="a directory to write the trace into under its own name ({worker}.{time_ns}.pt.trace.json"
                           ".gz; default: here), or the file to write; a file of that name is replaced (a symbolic "
                           "link too: never written through)")
    profiles = control("profiles", "list captures: one agent's (--url), or the whole fleet's in object storage "
                                   "(--store)", url_required=False)
    profiles.add_argument("--store", default=None,
                          help="the fleet's trace_store URL, e.g. s3://bucket/prefix (credentials and endpoint from "
                               "the SDK's environment: AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID...)")
    profiles.add_argument("--model", default=None, help="with --store: only this model's captures")
    profiles.add_argument("--host", default=None, help="with --store: only this pod's or host's captures")
    profiles.add_argument("--trigger", default=None, choices=("regression", "manual", "baseline"),
                          help="with --store: only captures of this trigger")
    profiles.add_argument("--since", type=_since, default=None,
                          help="with --store: captures since a time (2025-05-01T12:00:00Z) or for a span (30m, 6h, 2d)")
    profiles.add_argument("--limit", type=_at_least(1), default=100,
                          help="with --store: at most this many, newest first")
    profiles.add_argument("--download", metavar="ID", default=None,
                          help="fetch this capture (into --out): from the agent (--url), its trace, and its top ops "
                               "printed; from the store (--store), its trace and metadata")
    profiles.add_argument("--out", default=".",
                          help="with --download: the directory to write to (default: here); a file of the same "
                               "name there is replaced, a symbolic link or directory of that name is refused")
    diff = control("diff", "compare two captures op by op (per model call, noise-aware): what got slower, new or gone")
    diff.add_argument("before", help="the earlier capture's id (e.g. a baseline capture)")
    diff.add_argument("after", help="the later capture's id")
    diff.add_argument("--rows", type=_at_least(0), default=20, help="rows to print (default 20; unchanged ops last)")
    return parser


def main(argv: Sequence[str] | None = None, *, transport: Transport | None = None) -> int:
    """Run one ``perfmon`` command; returns its exit status. ``transport`` carries the requests to an agent
    (``http_request`` by default; a test passes a fake)."""
    try:
        try:
            return _command(argv, transport if transport is not None else http_request)
        finally:  # inside the try: a reader gone after the last print fails this flush, not the interpreter's at exit
            if sys.stdout is not None:
                sys.stdout.flush()
    except BrokenPipeError:
        # The reader closed the pipe (| head): drop what is left, quietly (the recipe of Python's signal docs, "Note on
        # SIGPIPE"). stdout's buffer still holds text the interpreter flushes at exit: it goes to /dev/null now.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        except (AttributeError, OSError, ValueError):  # not a file descriptor (a test's StringIO): nothing to redirect
            pass
        return EXIT_BROKEN_PIPE


def _command(argv: Sequence[str] | None, transport: Transport) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from .demo import DemoUnavailable, run_demo

        settings = {} if args.sample_rate is None else {"sample_rate": args.sample_rate}
        try:
            return run_demo(host=args.host, port=args.port, duration=args.duration, rps=args.rps,
                            threads=max(1, args.threads), slow_after=args.slow_after, generate=args.generate,
                            **settings)
        except DemoUnavailable as exc:
            print(f"perfmon: {exc}", file=sys.stderr)
            return 1
        except ConfigError as exc:
            print(f"perfmon: {exc}", file=sys.stderr)
            return 2
        except OSError as exc:  # e.g. the port is taken
            print(f"perfmon: cannot serve: {exc}", file=sys.stderr)
            return 1
    try:
        if args.command == "profiles" and args.download is not None and not valid_id(args.download):
            print(f"perfmon: profiles: --download: not a capture id: {_clean(repr(args.download), 80)} "
                  "(expected 22 lowercase hex digits, as `perfmon profiles` lists them)", file=sys.stderr)
            return 2
        if args.command == "profile" and args.out is not None and not Path(args.out).is_dir() and (
                args.out.endswith(os.sep) or not Path(args.out).parent.is_dir()):
            # Before the capture: a trace with nowhere to go would be taken for nothing. (A directory that exists takes
            # the trace under its own name, as `profiles --download --out` does; "new/" names a directory, not a file.)
            why = "is not a directory" if args.out.endswith(os.sep) else "is in a directory that does not exist"
            print(f"perfmon: profile: --out {_clean(args.out, 200)} {why}", file=sys.stderr)
            return 2
        if args.command == "profiles" and args.store:
            return store_profiles(args.store, model=args.model, host=args.host, trigger=args.trigger, since=args.since,
                                  limit=args.limit, download=args.download, out=args.out, timeout=args.timeout)
        if args.command == "profiles" and not args.url:
            print("perfmon: profiles needs --url (one agent) or --store (the fleet's object storage)",
                  file=sys.stderr)
            return 2
        if args.command == "profiles":
            store_only = [f"--{k}" for k in ("model", "host", "trigger", "since") if getattr(args, k) is not None]
            if store_only:  # refused, not ignored: a filter that silently does nothing lists what was not asked for
                print(f"perfmon: profiles: {', '.join(store_only)} filter the fleet's listing (--store); one agent's "
                      "(--url) lists all it holds", file=sys.stderr)
                return 2
        if args.command == "diff":
            bad = [i for i in (args.before, args.after) if not valid_id(i)]
            if bad:  # a usage error, before any request: "<id>/trace" must not reach another route
                print(f"perfmon: diff: not a capture id: {_clean(repr(bad[0]), 80)} (expected 22 lowercase hex "
                      "digits, as `perfmon profiles` lists them)", file=sys.stderr)
                return 2
        token = args.token if args.token is not None else os.environ.get("PERFMON_TOKEN")
        if token is not None:
            token = token.strip(TOKEN_ENDS)  # a secret file's newline, as the agent's Config drops it
        if args.token:
            print("perfmon: warning: --token shows in `ps` and in shell history; prefer $PERFMON_TOKEN",
                  file=sys.stderr)
        if token and not client.SENDABLE_TOKEN.fullmatch(token):  # never echoed: it is a secret
            print("perfmon: the token ($PERFMON_TOKEN or --token) holds characters an HTTP header cannot carry "
                  "(control characters, non-ASCII, spaces at an end); expected printable ASCII only", file=sys.stderr)
            return 2
        if args.command == "profiles" and args.download is not None:
            return fetch_profile(args.url, args.download, token=token, out=args.out, timeout=args.timeout,
                                 transport=transport)
        if args.command == "profiles":
            return list_profiles(args.url, token=token, timeout=args.timeout, transport=transport)
        if args.command == "diff":
            return diff_profiles(args.url, args.before, args.after, token=token, timeout=args.timeout,
                                 rows=args.rows, transport=transport)
        return run_profile(args.url, token=token, model=args.model, steps=args.steps,
                           max_seconds=args.max_seconds, out=args.out, timeout=args.timeout, transport=transport)
    except ControlError as exc:
        more = (f" (--timeout {args.timeout:g} s covers all the command's exchanges with the "
                f"{'store' if getattr(args, 'store', None) else 'agent'})"
                if isinstance(exc, client.TimedOut) else "")
        # One line, cleaned and cut: the message may quote what an agent or a store said.
        print(f"perfmon: {_clean(exc, 1000)}{more}", file=sys.stderr)
        return EXIT_INTERRUPTED if isinstance(exc, Interrupted) else 1
    except KeyboardInterrupt:
        print("perfmon: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


# -- the subcommands that drive an agent: what `perfmon profile`, `profiles` and `diff` do -------------

def run_profile(url: str, *, token: str | None, model: str | None = None, steps: int | None = None,
                max_seconds: float | None = None, out: str | None = None, timeout: float = 120.0,
                stdout: TextIO | None = None, transport: Transport = http_request) -> int:
    """Trigger a capture, wait for it, download its trace and print the top ops, all within ``timeout`` seconds.

    ``out``: a directory (default: the working one) that takes the trace under its own name, or the file to write."""
    stdout = stdout if stdout is not None else sys.stdout  # looked up per call: tests and tools swap it
    deadline = time.monotonic() + timeout
    base = url.rstrip("/")
    payload = {k: v for k, v in (("model", model), ("steps", steps), ("max_seconds", max_seconds)) if v is not None}
    _, _, body = transport(f"{base}/profile", token=token, method="POST", payload=payload,
                           timeout=client.remaining(deadline))
    cap_id = client.json_object(body, "POST /profile").get("id")
    if not isinstance(cap_id, str) or not valid_id(cap_id):  # it becomes a URL path and a local file name
        raise ControlError(f"POST /profile: the agent answered no capture id ({_clean(cap_id, 80)})")
    what, armed = f"capture {cap_id}", time.monotonic()
    print(f"{what} armed; waiting for the model's next calls...", file=stdout, flush=True)
    meta: dict[str, Any] = {}
    last = None
    try:
        while time.monotonic() < deadline:  # bounded by the deadline (and so in count: one pass per 0.2 s at most)
            _, _, body = transport(f"{base}/profiles/{cap_id}", token=token, timeout=client.remaining(deadline))
            reply = client.json_object(body, what)
            for field in ("status", "outcome"):
                if not isinstance(reply.get(field), (str, type(None))):
                    raise _malformed(what, field, reply.get(field))
            meta = reply  # checked: what the message below may read
            if meta.get("status") != last:
                last = meta.get("status")
                print(f"  {_clean(last, 40)} (steps recorded: {_clean(meta.get('steps_recorded', 0), 12)})",
                      file=stdout, flush=True)
            if meta.get("outcome"):
                break
            time.sleep(min(0.2, client.remaining(deadline)))
        else:
            raise client.TimedOut(f"{what} did not finish in time (status {_clean(meta.get('status'), 40)})")
    except (client.TimedOut, KeyboardInterrupt) as exc:  # take an armed capture back, or say what it goes on doing
        gone = _take_back(base, cap_id, meta, token=token, transport=transport, armed=armed)
        if isinstance(exc, KeyboardInterrupt):
            raise Interrupted(f"interrupted: {what} was not waited for; {gone}") from None
        raise client.TimedOut(f"{exc}; {gone}") from None
    where = Path(out) if out else Path()
    return _save_trace(base, cap_id, meta, None if where.is_dir() else where, token=token, deadline=deadline,
                       transport=transport, stdout=stdout, directory=where)


#: Seconds the CLI gives the agent to cancel the capture it stops waiting for.
CANCEL_SECONDS = 5.0


def _take_back(base: str, cap_id: str, meta: dict[str, Any], *, token: str | None, transport: Transport,
               armed: float) -> str:
    """Cancel a capture the CLI stopped waiting for (``--timeout``, Ctrl-C) while it is armed (DELETE
    /profiles/{id}): left armed, it refused every other capture until capture_arm_timeout_seconds. Returns what
    became of it; one recording or exporting, or an agent without the route, is left as ``left_behind`` says."""
    if meta.get("status") in (None, "armed"):
        try:
            _, _, body = transport(f"{base}/profiles/{cap_id}", token=token, method="DELETE", timeout=CANCEL_SECONDS)
            reply = client.json_object(body, f"DELETE /profiles/{cap_id}")
            if reply.get("outcome"):
                return "it was cancelled on the agent before it recorded anything"
            meta = reply  # it had just started recording: it ends at its thread's next call
        except ControlError:  # an agent older than the route, gone, or the capture ended meanwhile
            pass
    return _left_behind(meta, cap_id, base, armed_seconds_ago=time.monotonic() - armed)


def fetch_profile(url: str, capture_id: str, *, token: str | None, out: str = ".", timeout: float = 120.0,
                  stdout: TextIO | None = None, transport: Transport = http_request) -> int:
    """Download a capture the agent holds (``perfmon profiles --url ... --download ID``: one a regression took, say)
    into the directory ``out`` under its trace's name, and print its top ops, as ``perfmon profile`` does for the
    capture it takes. ``ControlError`` for a capture still recording or one that failed."""
    if not valid_id(capture_id):  # it becomes a URL path and a local file name
        raise ControlError(f"not a capture id: {_clean(repr(capture_id), 80)}")
    stdout = stdout if stdout is not None else sys.stdout
    deadline = time.monotonic() + timeout
    base = url.rstrip("/")
    what = f"capture {capture_id}"
    _, _, body = transport(f"{base}/profiles/{capture_id}", token=token, timeout=client.remaining(deadline))
    meta = client.json_object(body, what)
    if not isinstance(meta.get("outcome"), (str, type(None))):
        raise _malformed(what, "outcome", meta.get("outcome"))
    if not meta.get("outcome"):
        raise ControlError(f"{what} has not finished yet (status {_clean(meta.get('status'), 40)}): try again "
                           "when `perfmon profiles` lists an outcome")
    directory = Path(out)
    if not directory.is_dir():
        raise ControlError(f"--out {_clean(out, 200)}: not a directory (with --download, the directory to write to)")
    return _save_trace(base, capture_id, meta, None, token=token, deadline=deadline, transport=transport,
                       stdout=stdout, directory=directory)


def _save_trace(base: str, cap_id: str, meta: dict[str, Any], target: Path | None, *, token: str | None,
                deadline: float, transport: Transport, stdout: TextIO, directory: Path = Path()) -> int:
    """A finished capture's trace written to ``target`` (None: its own name, in ``directory``), then its top ops,
    comparison and compute printed; ``ControlError`` for a failed capture or a malformed answer."""
    what = f"capture {cap_id}"
    if meta["outcome"] == "failed":
        raise ControlError(f"{what} failed: {_clean(meta.get('error'), 500)}")
    report = _report(meta, what)  # checked before anything is written: a malformed answer leaves no file
    name = meta.get("trace_file")
    if not isinstance(name, str) or not TRACE_NAME.fullmatch(name):  # the agent's word is no path: "../x"
        name = f"{cap_id}.pt.trace.json.gz"
    if target is None:
        target = directory / name
    size = client.download(transport, f"{base}/profiles/{cap_id}/trace", target, token=token,
                           timeout=client.remaining(deadline))
    print(f"trace: {target} ({size} bytes; open in https://ui.perfetto.dev or TensorBoard)", file=stdout)
    for line in report:
        print(line, file=stdout)
    return 0



def list_profiles(url: str, *, token: str | None, timeout: float = 30.0, stdout: TextIO | None = None,
                  transport: Transport = http_request) -> int:
    """Print the agent's captures, newest first."""
    stdout = stdout if stdout is not None else sys.stdout
    _, _, body = transport(f"{url.rstrip('/')}/profiles", token=token, timeout=timeout)
    profiles = client.json_object(body, "GET /profiles").get("profiles")
    if not isinstance(profiles, list):
        raise ControlError("GET /profiles: the agent's answer has no list of profiles")
    for line in listing_or_none([p for p in profiles if isinstance(p, dict)], fleet=False):
        print(line, file=stdout)
    return 0


def _fetch_meta(base: str, capture_id: str, *, token: str | None, timeout: float,
                transport: Transport) -> dict[str, Any]:
    """A capture's metadata with a usable per-step op table, or ``ControlError`` saying why not."""
    _, _, body = transport(f"{base}/profiles/{urllib.parse.quote(capture_id, safe='')}", token=token,
                           timeout=timeout)
    meta = client.json_object(body, f"capture {capture_id}")
    if not meta.get("ops"):
        state = _clean(meta.get("outcome") or meta.get("status"), 40)
        why = f"{state}: {_clean(meta['error'], 200)}" if meta.get("error") else state
        raise ControlError(f"capture {capture_id} has no per-step op table to compare ({why})")
    _check_ops(meta, capture_id)
    return meta


def diff_profiles(url: str, before: str, after: str, *, token: str | None, timeout: float = 30.0, rows: int = 20,
                  stdout: TextIO | None = None, transport: Transport = http_request) -> int:
    """Fetch two captures' metadata from the agent (both within ``timeout`` seconds) and print their comparison
    (``perfmon.captures.compare``): per op, self time per model call before and after, calls per model call, the
    change and its status.

    Both ids must be capture ids (``perfmon.store.traces.valid_id``; ``ControlError`` before any request
    otherwise): an id is a path segment of the request, so "<id>/trace" would fetch another route."""
    from .captures.compare import compare

    stdout = stdout if stdout is not None else sys.stdout
    for capture_id in (before, after):
        if not valid_id(capture_id):
            raise ControlError(f"not a capture id: {_clean(repr(capture_id), 80)}")
    deadline = time.monotonic() + timeout
    base = url.rstrip("/")
    a = _fetch_meta(base, before, token=token, timeout=client.remaining(deadline), transport=transport)
    b = _fetch_meta(base, after, token=token, timeout=client.remaining(deadline), transport=transport)
    if a.get("model") != b.get("model"):
        print(f"note: different models ({_clean(a.get('model'), 60)} vs {_clean(b.get('model'), 60)})", file=stdout)
    try:
        result = compare(a, b)
    except ArithmeticError as exc:  # a guard: extreme in-range figures once divided by zero (uniform_ratio 0.0)
        raise ControlError(f"cannot compare {before} and {after}: {type(exc).__name__}: {exc}") from None
    if result.get("error"):
        raise ControlError(f"cannot compare {before} and {after}: {_clean(result['error'], 300)}")
    per = "device" if (b.get("device") or "").startswith("cuda") else "CPU"
    print(f"{before} ({_clean(a.get('trigger'), 32)}, steps used/recorded {_step_counts(a)}) -> {after} "
          f"({_clean(b.get('trigger'), 32)}, {_step_counts(b)}); self {per} time per model call", file=stdout)
    print(f"\n{'op':<34} {'status':<7} {'before ms':>10} {'after ms':>10} {'added ms':>10} {'ratio':>7} "
          f"{'calls before':>12} {'calls after':>12}", file=stdout)
    for r in result["ops"][:max(rows, 0)]:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        print(f"{_clean(r['op'], 34):<34} {r['status']:<7} {r['seconds_per_call_before'] * 1e3:>10.3f} "
              f"{r['seconds_per_call_after'] * 1e3:>10.3f} {r['added_seconds_per_call'] * 1e3:>+10.3f} {ratio:>7} "
              f"{r['calls_per_call_before']:>12.1f} {r['calls_per_call_after']:>12.1f}", file=stdout)
    if len(result["ops"]) > rows:
        print(f"({len(result['ops']) - rows} more rows)", file=stdout)
    print(f"\n{_clean(result['summary'], 2000)}", file=stdout)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
