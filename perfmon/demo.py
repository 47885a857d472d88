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
from .regression import RegressionPolicy

__all__ = ["build_model", "run_demo"]


class Encoder(torch.nn.Module):
    """A 2-layer Transformer encoder, d_model 128 (~1-3 ms per forward on a 2-core CPU).

    ``extra_passes`` re-runs the layers that many more times: the demo's simulated regression.
    """

    def __init__(self) -> None:
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(d_model=128, nhead=4, dim_feedforward=256, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.extra_passes = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.encoder(x)
        for _ in range(self.extra_passes):
            y = self.encoder(y)
        return y


def build_model(device: str) -> Encoder:
    torch.manual_seed(0)
    return Encoder().to(device).eval()


def run_demo(*, host: str | None = None, port: int | None = None, duration: float | None = None,
             rps: float = 50.0, threads: int = 3, slow_after: float | None = None, out: TextIO = sys.stdout,
             install_signals: bool = True, **settings: Any) -> int:
    """Serve the demo until ``duration`` seconds pass, or SIGINT/SIGTERM; returns an exit code.

    ``slow_after`` seconds in, the encoder starts doing twice the work: a latency regression the
    monitor detects and captures on its own (see /profiles).
    """
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kw: dict[str, Any] = dict(settings)
    if host is not None:
        kw["host"] = host
    if port is not None:
        kw["port"] = port
    if slow_after is not None and "regression" not in kw:
        # Short windows so the demo shows a detection within a minute (production default: 30 s windows).
        kw["regression"] = RegressionPolicy(window_seconds=5, baseline_windows=2, min_samples=20, consecutive=2)
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
        if slow_after is not None:
            print(f"  the encoder slows down 2x after {slow_after:g} s; watch /stats and /profiles", file=out)
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
            if slow_after is not None and model.extra_passes == 0 and time.monotonic() - started >= slow_after:
                model.extra_passes = 1
                print("  encoder slowed down (simulated regression)", file=out, flush=True)
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
    stats = monitor.stats()
    enc = stats["models"]["encoder"]
    steady = enc["latency"].get("steady", {}).get("duration", {})
    cold = enc["latency"].get("cold", {}).get("duration", {})
    p50 = steady.get("p50_seconds")
    p99 = steady.get("p99_seconds")

    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:.2f} ms"

    print(f"  encoder: {enc['calls']} calls, {sum(enc['errors'].values())} errors, "
          f"steady p50 {fmt(p50)} p99 {fmt(p99)} ({steady.get('count', 0)} samples), "
          f"cold calls timed {cold.get('count', 0)}", file=out, flush=True)
    reg = enc.get("regression") or {}
    if reg.get("active"):
        print(f"  encoder: latency regression active (baseline {reg.get('baseline_seconds')})", file=out, flush=True)
    for p in monitor.profiles()[:3]:
        print(f"  capture {p['id']}: {p['trigger']} {p['status']} {p.get('outcome') or ''} "
              f"{p.get('trace_file') or ''}", file=out, flush=True)
