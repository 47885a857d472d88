"""The ``perfmon`` command line."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from ._version import __version__
from .exceptions import ConfigError

__all__ = ["main"]


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be 0..65535 (0 = any free port), got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="perfmon", description="In-process performance monitor for PyTorch.")
    parser.add_argument("--version", action="version", version=f"perfmon {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="serve a real model from several threads with the monitor on")
    demo.add_argument("--host", default=None, help="bind address (default 127.0.0.1, or PERFMON_HOST)")
    demo.add_argument("--port", type=_port, default=None, help="HTTP port; 0 = any free port (default 9478)")
    demo.add_argument("--duration", type=_positive, default=None, help="seconds to run (default: until Ctrl-C)")
    demo.add_argument("--rps", type=_positive, default=50.0, help="target requests per second (default 50)")
    demo.add_argument("--threads", type=int, default=3, help="worker threads (default 3)")
    demo.add_argument("--sample-rate", type=float, default=None, help="fraction of steady calls timed")
    demo.add_argument("--slow-after", type=_positive, default=None,
                      help="simulate a 2x latency regression after this many seconds (perfmon captures it)")

    def control(name: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--url", required=True, help="the agent's base URL, e.g. http://127.0.0.1:9478")
        p.add_argument("--token", default=os.environ.get("PERFMON_TOKEN"),
                       help="bearer token (default: $PERFMON_TOKEN)")
        p.add_argument("--timeout", type=_positive, default=120.0, help="seconds to wait (default 120)")
        return p

    prof = control("profile", "trigger a capture, wait for it, download the trace, print the top ops")
    prof.add_argument("--model", default=None, help="model name (default: the only one)")
    prof.add_argument("--steps", type=int, default=None, help="forward calls to record (1..100, default 5)")
    prof.add_argument("--max-seconds", type=_positive, default=None, help="window limit (default 10)")
    prof.add_argument("--out", default=None, help="where to save the .pt.trace.json.gz (default: its name, here)")
    control("profiles", "list captures")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from .demo import run_demo

        settings = {} if args.sample_rate is None else {"sample_rate": args.sample_rate}
        try:
            return run_demo(host=args.host, port=args.port, duration=args.duration, rps=args.rps,
                            threads=max(1, args.threads), slow_after=args.slow_after, **settings)
        except ConfigError as exc:
            print(f"perfmon: {exc}", file=sys.stderr)
            return 2
        except OSError as exc:  # e.g. the port is taken
            print(f"perfmon: cannot serve: {exc}", file=sys.stderr)
            return 1
    from .client import ControlError, list_profiles, run_profile

    try:
        if args.command == "profiles":
            return list_profiles(args.url, token=args.token, timeout=args.timeout)
        return run_profile(args.url, token=args.token, model=args.model, steps=args.steps,
                           max_seconds=args.max_seconds, out=args.out, timeout=args.timeout)
    except ControlError as exc:
        print(f"perfmon: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
