"""``perfmon demo``: a real model served from several threads with the monitor on.

A small Transformer encoder (CUDA when available, else CPU) is driven by worker threads at a target
request rate, with varying batch sizes and, a few seconds in, sequence lengths it has not seen, so
cold calls show up next to steady state. A pre/post-processing step is tracked too.
"""

from __future__ import annotations

import random
import signal
import sys
import threading
import time
from typing import Any, TextIO

import torch

from .monitor import Monitor

__all__ = ["build_model", "run_demo"]


def build_model(device: str) -> torch.nn.Module:
    """A 2-layer Transformer encoder, d_model 128 (~1-3 ms per forward on a 2-core CPU)."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=128, nhead=4, dim_feedforward=256, batch_first=True)
    return torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).to(device).eval()


def run_demo(*, host: str | None = None, port: int | None = None, duration: float | None = None,
             rps: float = 50.0, threads: int = 3, out: TextIO = sys.stdout,
             install_signals: bool = True, **settings: Any) -> int:
    """Serve the demo until ``duration`` seconds pass, or SIGINT/SIGTERM; returns an exit code."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kw: dict[str, Any] = dict(settings)
    if host is not None:
        kw["host"] = host
    if port is not None:
        kw["port"] = port
    stop = threading.Event()
    if install_signals and threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())

    with Monitor(**kw) as monitor:
        model = monitor.wrap(build_model(device), name="encoder")

        @monitor.instrument(name="pipeline")
        def handle(batch: int, seq: int) -> torch.Tensor:
            with monitor.track("preprocess"):
                x = torch.randn(batch, seq, 128, device=device)
            with torch.inference_mode():
                y = model(x)
            out: torch.Tensor = y.mean(dim=1)
            return out

        url = monitor.url
        print(f"perfmon demo: encoder on {device}, {threads} threads, ~{rps:g} requests/s", file=out)
        if url:
            print(f"  metrics: {url}/metrics\n  stats:   {url}/stats\n  health:  {url}/healthz", file=out)
        print("  Ctrl-C to stop" if duration is None else f"  running for {duration:g} s", file=out, flush=True)

        started = time.monotonic()
        interval = threads / rps if rps > 0 else 0.0

        def worker(seed: int) -> None:
            rng = random.Random(seed)
            next_at = time.monotonic()
            while not stop.is_set():
                elapsed = time.monotonic() - started
                # New sequence lengths appear after a few seconds: the first call of each is cold.
                lengths = (16, 32) if elapsed < 5 else (16, 32, 48, 64)
                handle(rng.choice((1, 2, 4, 8)), rng.choice(lengths))
                next_at += interval
                delay = next_at - time.monotonic()
                if delay > 0:
                    stop.wait(delay)
                else:
                    next_at = time.monotonic()  # behind: don't burst to catch up

        workers = [threading.Thread(target=worker, args=(i,), name=f"demo-worker-{i}", daemon=True)
                   for i in range(threads)]
        for w in workers:
            w.start()
        last_report = started
        while not stop.is_set():
            if duration is not None and time.monotonic() - started >= duration:
                break
            stop.wait(0.2)
            if time.monotonic() - last_report >= 5:
                last_report = time.monotonic()
                _report(monitor, out)
        stop.set()
        for w in workers:
            w.join(10)
        monitor.flush()
        _report(monitor, out)
    print("perfmon demo: stopped", file=out, flush=True)
    return 0


def _report(monitor: Monitor, out: TextIO) -> None:
    enc = monitor.stats()["models"]["encoder"]
    steady = enc["latency"].get("steady", {}).get("duration", {})
    cold = enc["latency"].get("cold", {}).get("duration", {})
    p50 = steady.get("p50_seconds")
    p99 = steady.get("p99_seconds")

    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:.2f} ms"

    print(f"  encoder: {enc['calls']} calls, {sum(enc['errors'].values())} errors, "
          f"steady p50 {fmt(p50)} p99 {fmt(p99)} ({steady.get('count', 0)} samples), "
          f"cold calls timed {cold.get('count', 0)}", file=out, flush=True)
