"""``perfmon demo``: a real model served from several threads with the monitor on.

A small Transformer encoder (CUDA when available, else CPU) is driven by worker threads at a target
request rate, with varying batch sizes and, a few seconds in, sequence lengths it has not seen, so
cold calls show up next to steady state. A pre/post-processing step is tracked too.

``perfmon demo --generate`` serves a tiny randomly initialised GPT-2 (Hugging Face ``transformers``,
built from a config: nothing is downloaded) with streaming requests of varying prompt lengths: half
through the wrapped model's own ``generate()`` with a streamer (tracked by itself), half through a
hand-written decode loop wrapped in ``monitor.stream``, a few of them abandoned by their client. Forward
calls split into prefill and decode; requests give TTFT, inter-token latency and token counts.
"""

from __future__ import annotations

import inspect
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

import torch

from .captures.detector import RegressionPolicy
from .exceptions import ConfigError
from .monitor import Monitor

__all__ = ["DemoUnavailable", "build_decoder", "build_model", "run_demo"]

#: How to get what ``--generate`` needs, said when it is missing.
INSTALL_TRANSFORMERS = ("perfmon demo --generate needs Hugging Face transformers (a tiny GPT-2 is built from a "
                        "config with random weights; nothing is downloaded): pip install 'perfmon[examples]' "
                        "or pip install 'transformers>=4.45'")
VOCAB = 256
PROMPT_LENGTHS = (4, 8, 16, 32, 48)
NEW_TOKENS = (8, 32)  # per request, inclusive


class DemoUnavailable(Exception):
    """A demo mode cannot run here (an optional package is missing); the message says how to install it."""


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


def build_decoder(device: str) -> Any:
    """A 2-layer GPT-2, d_model 64, vocabulary 256, random weights; raises DemoUnavailable without transformers."""
    try:
        import transformers
    except ImportError:
        raise DemoUnavailable(INSTALL_TRANSFORMERS) from None
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=VOCAB, n_positions=128,
                                  bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model: Any = transformers.GPT2LMHeadModel(cfg)  # Any: transformers' own .to() annotations confuse mypy
    return model.to(device).eval()


def run_demo(*, host: str | None = None, port: int | None = None, duration: float | None = None,
             rps: float | None = None, threads: int = 3, slow_after: float | None = None, generate: bool = False,
             out: TextIO = sys.stdout, install_signals: bool = True, stop: threading.Event | None = None,
             **settings: Any) -> int:
    """Serve the demo until ``duration`` seconds pass, SIGINT/SIGTERM, or ``stop`` is set; returns an exit code.

    ``slow_after`` seconds in, the encoder starts doing twice the work: a latency regression the
    monitor detects and captures on its own (see /profiles). ``generate`` serves the streaming decoder
    instead (raises DemoUnavailable without transformers). ``rps`` defaults to 50 (encoder), 4 (decoder).
    """
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if generate and slow_after is not None:
        raise ConfigError("slow_after (--slow-after) applies to the encoder demo, not to --generate")
    decoder = build_decoder(device) if generate else None  # before anything starts: fails with how to install
    if rps is None:
        rps = 4.0 if generate else 50.0
    kw: dict[str, Any] = dict(settings)
    if host is not None:
        kw["host"] = host
    if port is not None:
        kw["port"] = port
    if generate:
        # ~100 forwards/s on a CPU: time 1 in 10 so prefill and decode percentiles fill within seconds.
        kw.setdefault("sample_rate", 0.1)
    if slow_after is not None and "regression" not in kw:
        # Short windows so the demo shows a detection within a minute (production default: 30 s windows). At 1% of
        # ~50 calls a second the floor's one sample a second would stretch each window past 20 s and spread it over
        # the encoder's ~9 size classes: the baseline would still be learning when the slow-down came.
        kw["regression"] = RegressionPolicy(window_seconds=5, baseline_windows=2, min_samples=20, consecutive=3,
                                            cooldown_seconds=1)  # the encoder and the pipeline that calls it: both
        kw.setdefault("sample_rate", 0.2)
    stop = stop if stop is not None else threading.Event()
    if install_signals and threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())

    with Monitor(**kw) as monitor:
        encoder: Encoder | None = None
        if decoder is not None:
            handle = _generation_requests(monitor, monitor.wrap(decoder, name="decoder"), device)
            report: Callable[[Monitor, TextIO], None] = _report_generation
            what = f"decoder (tiny random GPT-2, streaming generation) on {device}"
        else:
            encoder = monitor.wrap(build_model(device), name="encoder")
            handle = _encoder_requests(monitor, encoder, device)
            report = _report
            what = f"encoder on {device}"

        url = monitor.url
        print(f"perfmon demo: {what}, {threads} threads, ~{rps:g} requests/s", file=out)
        if url:
            print(f"  metrics: {url}/metrics\n  stats:   {url}/stats\n  health:  {url}/healthz\n"
                  f"  page:    {url}/", file=out)
        if slow_after is not None:
            print(f"  the encoder slows down 2x after {slow_after:g} s; watch /stats and /profiles", file=out)
        print("  Ctrl-C to stop" if duration is None else f"  running for {duration:g} s", file=out, flush=True)

        started = time.monotonic()
        interval = threads / rps if rps > 0 else 0.0

        def worker(seed: int) -> None:
            rng = random.Random(seed)
            next_at = time.monotonic()
            while not stop.is_set():
                handle(rng, time.monotonic() - started)
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
            if (encoder is not None and slow_after is not None and encoder.extra_passes == 0
                    and time.monotonic() - started >= slow_after):
                encoder.extra_passes = 1
                print("  encoder slowed down (simulated regression)", file=out, flush=True)
            if time.monotonic() - last_report >= 5:
                last_report = time.monotonic()
                report(monitor, out)
        stop.set()
        for w in workers:
            w.join(10)
        monitor.flush()
        report(monitor, out)
    print("perfmon demo: stopped", file=out, flush=True)
    return 0


#: One request of a demo workload: (the worker's random source, seconds since the demo started).
Requests = Callable[[random.Random, float], None]


def _encoder_requests(monitor: Monitor, model: Encoder, device: str) -> Requests:
    @monitor.instrument(name="pipeline")
    def handle(batch: int, seq: int) -> torch.Tensor:
        with monitor.track("preprocess"):
            x = torch.randn(batch, seq, 128, device=device)
        with torch.inference_mode():
            y = model(x)
        out: torch.Tensor = y.mean(dim=1)
        return out

    def request(rng: random.Random, elapsed: float) -> None:
        # New sequence lengths appear after a few seconds: the first call of each is cold.
        lengths = (16, 32) if elapsed < 5 else (16, 32, 48, 64)
        handle(rng.choice((1, 2, 4, 8)), rng.choice(lengths))

    return request


def _generation_requests(monitor: Monitor, model: Any, device: str) -> Requests:
    """Streaming requests to the wrapped decoder: generate() with a streamer, or a decode loop in monitor.stream."""
    from transformers.generation.streamers import BaseStreamer

    class Client(BaseStreamer):  # type: ignore[misc]
        """Stands in for a streaming client: gets each new token as generate() makes it."""

        def __init__(self) -> None:
            self.tokens = 0
            self._prompt = True

        def put(self, value: torch.Tensor) -> None:
            if self._prompt:  # generate() hands the prompt over first
                self._prompt = False
            else:
                self.tokens += int(value.numel())

        def end(self) -> None:
            pass

    # transformers 5.24 renamed the KV cache's keyword (and output field) ``past_key_values`` to ``cache``; the old
    # name still works there but warns every call.
    cache_key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def decode_loop(ids: torch.Tensor, new: int) -> Iterator[int]:
        """A hand-written loop against the KV cache, one token per step, as a custom server runs it."""
        out = model(input_ids=ids, use_cache=True)  # prefill
        for i in range(new):
            token = out.logits[:, -1:].argmax(-1)
            yield int(token)
            if i + 1 < new:
                out = model(input_ids=token, use_cache=True, **{cache_key: out[cache_key]})  # decode

    def request(rng: random.Random, elapsed: float) -> None:
        prompt = rng.choice(PROMPT_LENGTHS)
        new = rng.randint(*NEW_TOKENS)
        ids = torch.randint(1, VOCAB, (1, prompt), device=device)
        with torch.inference_mode():
            if rng.random() < 0.5:
                # The wrapped model's own generate() is tracked by itself: one request per sequence.
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                               do_sample=False, streamer=Client())
                return
            stream = monitor.stream(decode_loop(ids, new), name="decoder", prompt_tokens=prompt)
            leaves_after = 3 if rng.random() < 0.1 else None  # now and then a client goes away: cancelled
            for n, _ in enumerate(stream, 1):
                if n == leaves_after:
                    stream.close()
                    break

    return request


def _fmt_ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.2f} ms"


def _report_generation(monitor: Monitor, out: TextIO) -> None:
    monitor.generations.drain()
    stats = monitor.stats()
    gen = stats["generation"].get("decoder")
    if gen is None:
        print("  decoder: no request finished yet", file=out, flush=True)
        return
    req, ttft, itl = gen["requests"], gen["time_to_first_token"], gen["inter_token_latency"]
    tps = gen["tokens_per_second"]
    print(f"  decoder: {req['ok']} ok / {req['error']} error / {req['cancelled']} cancelled requests, "
          f"TTFT p50 {_fmt_ms(ttft.get('p50_seconds'))} p99 {_fmt_ms(ttft.get('p99_seconds'))}, "
          f"ITL p50 {_fmt_ms(itl.get('p50_seconds'))} p99 {_fmt_ms(itl.get('p99_seconds'))}, "
          f"{0.0 if tps is None else tps:.0f} tokens/s, prompt {gen['prompt_tokens']} / generated "
          f"{gen['generated_tokens']} tokens", file=out, flush=True)
    stages = stats["models"]["decoder"].get("stages") or {}
    parts = []
    for label, st in stages.items():
        lat = st["latency"].get("steady") or st["latency"].get("cold") or {}
        parts.append(f"{label} {st['calls']} calls p50 {_fmt_ms(lat.get('duration', {}).get('p50_seconds'))}")
    if parts:
        print("  forward: " + ", ".join(parts), file=out, flush=True)


def _report(monitor: Monitor, out: TextIO) -> None:
    stats = monitor.stats()
    enc = stats["models"]["encoder"]
    steady = enc["latency"].get("steady", {}).get("duration", {})
    cold = enc["latency"].get("cold", {}).get("duration", {})
    p50 = steady.get("p50_seconds")
    p99 = steady.get("p99_seconds")

    print(f"  encoder: {enc['calls']} calls, {sum(enc['errors'].values())} errors, "
          f"steady p50 {_fmt_ms(p50)} p99 {_fmt_ms(p99)} ({steady.get('count', 0)} samples), "
          f"cold calls timed {cold.get('count', 0)}", file=out, flush=True)
    reg = enc.get("regression") or {}
    if reg.get("active"):
        print(f"  encoder: latency regression active (baseline {reg.get('baseline_seconds')})", file=out, flush=True)
    for p in monitor.profiles()[:3]:
        print(f"  capture {p['id']}: {p['trigger']} {p['status']} {p.get('outcome') or ''} "
              f"{p.get('trace_file') or ''}", file=out, flush=True)
