"""A streaming generation server with perfmon embedded (tests/test_stream_server.py).

``python -m tests.apps.stream_server PORT``: FastAPI under uvicorn on 127.0.0.1:PORT.

``GET /generate?mode=auto|both`` is the usual Hugging Face streaming recipe: the wrapped model's generate() runs
in a thread with a ``TextIteratorStreamer``, and the response is a ``StreamingResponse`` over the streamer, one
line per text item (the prompt, then one per new token, then the final ""). ``mode=auto`` relies on perfmon's
automatic tracking of the wrapped model's generate() alone (model "auto"); ``mode=both`` also wraps the streamer
in ``monitor.stream(streamer, name="both")`` right after starting the thread (model "both", a copy of the same
weights). Generation is paced (a logits processor sleeps ``PACE_S`` a step; EOS is banned, so every request
makes ``NEW`` tokens) so that a client leaving after 3 lines leaves long before the end.

``/perfmon/metrics``, ``/perfmon/stats``: perfmon's routes. ``GET /truth``: the app's own view per mode:
responses whose body reached the end (``body_done``) or stopped early (``body_stopped``), generate() calls
finished, streamers garbage-collected (a ``weakref.finalize`` on each). ``POST /gc`` runs ``gc.collect()``.
"""

from __future__ import annotations

import copy
import faulthandler
import gc
import signal
import sys
import threading
import time
import weakref
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import torch
import transformers
import uvicorn
from fastapi import FastAPI, Query
from fastapi.responses import JSONResponse, StreamingResponse
from transformers import LogitsProcessor, LogitsProcessorList, TextIteratorStreamer

import perfmon

torch.set_num_threads(1)
faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test dumps every thread's stack on a failure

EOS = 100
PROMPT = 6
NEW = 40
PACE_S = 0.005


class Words:
    """A stand-in tokenizer (TextIteratorStreamer only calls decode): one word per token id."""

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        return "".join(f"t{i} " for i in ids)


class Paced(LogitsProcessor):  # type: ignore[misc]
    """PACE_S per step (the scripted pace of a bigger model) and never EOS: exactly NEW tokens."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        time.sleep(PACE_S)
        scores[:, EOS] = -float("inf")
        return scores


def build() -> Any:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=101, n_positions=128,
                                  bos_token_id=EOS, eos_token_id=EOS, pad_token_id=EOS)
    return transformers.GPT2LMHeadModel(cfg).eval()


monitor = perfmon.Monitor(port=None, log_format="json", log_level="error", regression=None, sample_rate=1.0)
_bare = build()
_twin = copy.deepcopy(_bare)
MODELS = {"auto": monitor.wrap(_bare, name="auto"), "both": monitor.wrap(_twin, name="both")}

# Reentrant: a streamer's finalizer runs at any allocation, also on a thread that holds the lock (/truth).
_lock = threading.RLock()
TRUTH: dict[str, dict[str, int]] = {
    mode: {"started": 0, "body_done": 0, "body_stopped": 0, "generate_done": 0, "generate_failed": 0,
           "streamers_collected": 0}
    for mode in MODELS
}


#: Every streamer made, weakly (for /gc's report of what still holds one).
STREAMERS: weakref.WeakSet[Any] = weakref.WeakSet()


def bump(mode: str, key: str) -> None:
    with _lock:
        TRUTH[mode][key] += 1


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    monitor.start()
    try:
        yield
    finally:
        monitor.stop()


app = FastAPI(lifespan=lifespan)
app.mount("/perfmon", monitor.asgi_app)


def _generate(model: Any, ids: torch.Tensor, streamer: TextIteratorStreamer, mode: str) -> None:
    try:
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                       streamer=streamer, logits_processor=LogitsProcessorList([Paced()]))
        bump(mode, "generate_done")
    except BaseException:
        bump(mode, "generate_failed")
        raise


def _body(source: Iterator[str], mode: str) -> Iterator[str]:
    finished = False
    try:
        for text in source:
            yield text + "\n"
        finished = True
    finally:
        bump(mode, "body_done" if finished else "body_stopped")


@app.get("/generate")
def generate(mode: str = Query("auto", pattern="^(auto|both)$")) -> StreamingResponse:
    bump(mode, "started")
    streamer = TextIteratorStreamer(Words(), timeout=30)
    weakref.finalize(streamer, bump, mode, "streamers_collected")
    STREAMERS.add(streamer)
    ids = torch.randint(0, EOS, (1, PROMPT))
    threading.Thread(target=_generate, args=(MODELS[mode], ids, streamer, mode), daemon=True).start()
    source = monitor.stream(streamer, name="both") if mode == "both" else streamer
    return StreamingResponse(_body(source, mode), media_type="text/plain")


@app.get("/truth")
def truth() -> JSONResponse:
    with _lock:
        view = {mode: dict(counts) for mode, counts in TRUTH.items()}
    return JSONResponse({"truth": view, "threads": threading.active_count(), "new": NEW})


@app.post("/gc")
def collect() -> dict[str, Any]:
    """A full collection: streamers only in reference cycles go now; what is still alive after it is held
    (by what: the referrers' types)."""
    collected = gc.collect()
    alive = list(STREAMERS)
    held_by = sorted({type(r).__name__ for s in alive for r in gc.get_referrers(s)} - {"frame", "list", "WeakSet"})
    return {"collected": collected, "alive": len(alive), "held_by": held_by}


@app.get("/healthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


def main() -> None:
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
