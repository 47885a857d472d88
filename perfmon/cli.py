"""The ``perfmon`` command line."""

from __future__ import annotations

import argparse
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from .demo import run_demo

        settings = {} if args.sample_rate is None else {"sample_rate": args.sample_rate}
        try:
            return run_demo(host=args.host, port=args.port, duration=args.duration, rps=args.rps,
                            threads=max(1, args.threads), **settings)
        except ConfigError as exc:
            print(f"perfmon: {exc}", file=sys.stderr)
            return 2
        except OSError as exc:  # e.g. the port is taken
            print(f"perfmon: cannot serve: {exc}", file=sys.stderr)
            return 1
    return 2  # pragma: no cover - argparse enforces a command


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
