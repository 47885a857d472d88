"""A streaming text-generation endpoint with perfmon: FastAPI's StreamingResponse fed through monitor.stream.

    pip install -e ".[examples]"
    uvicorn examples.streaming:app --host 127.0.0.1 --port 8000
    curl -N 'http://127.0.0.1:8000/generate?prompt_tokens=16&max_new_tokens=32'

The model is a tiny randomly initialised GPT-2 (built from a config: nothing is downloaded), so the
"text" is token ids, one per line. What perfmon sees:

- the wrapped model's forward calls, split ``stage="prefill"`` (the prompt) and ``stage="decode"`` (one
  token against the KV cache), recognised from the KV cache argument (``past_key_values``, or ``cache`` from
  transformers 5.24) without configuration;
- each response as one generation request (``monitor.stream``): time to first token and inter-token
  latency as the client gets them, prompt and generated tokens, and the outcome — ``ok``, ``error``, or
  ``cancelled`` when the client goes away mid-stream (the stream's task is cancelled).

perfmon's routes are mounted under /perfmon (``/perfmon/metrics``, ``/perfmon/stats``, the status page at
``/perfmon/``); the agent's own port serves them too unless ``PERFMON_PORT=off``.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import torch
import transformers
from fastapi import FastAPI, Query
from fastapi.responses import StreamingResponse

import perfmon

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB = 256
MAX_POSITIONS = 512


def build_model() -> Any:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=VOCAB, n_positions=MAX_POSITIONS,
                                  bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model: Any = transformers.GPT2LMHeadModel(cfg)
    return model.to(DEVICE).eval()


monitor = perfmon.Monitor()
model = monitor.wrap(build_model(), name="gpt2")


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    monitor.start()
    try:
        yield
    finally:
        monitor.stop()


app = FastAPI(title="perfmon streaming generation example", lifespan=lifespan)
app.mount("/perfmon", monitor.asgi_app)


#: The KV cache's keyword and output field: transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name
#: still works there, with a warning every call).
CACHE = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _step(ids: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any]:
    """One forward (prefill without a cache, decode with one) and the greedy next token."""
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True, **{CACHE: cache})
        return out.logits[:, -1:].argmax(-1), out[CACHE]


async def decode(ids: torch.Tensor, new_tokens: int) -> AsyncIterator[int]:
    """Token ids, one per decode step; each step runs in a worker thread so the event loop keeps serving."""
    token, cache = await asyncio.to_thread(_step, ids, None)
    for i in range(new_tokens):
        yield int(token)
        if i + 1 < new_tokens:
            token, cache = await asyncio.to_thread(_step, token, cache)


@app.get("/generate")
async def generate(prompt_tokens: int = Query(16, ge=1, le=128),
                   max_new_tokens: int = Query(32, ge=1, le=MAX_POSITIONS - 128)) -> StreamingResponse:
    prompt = torch.randint(1, VOCAB, (1, prompt_tokens), device=DEVICE)  # stands in for the tokenized prompt
    # The request starts now (its TTFT includes the prefill); each id handed to the response is one token.
    tokens = monitor.stream(decode(prompt, max_new_tokens), name="gpt2", prompt_tokens=prompt_tokens)

    async def body() -> AsyncIterator[str]:
        try:
            async for token in tokens:
                yield f"{token}\n"
        finally:
            await tokens.aclose()  # a client gone mid-stream: end the request now, counted cancelled

    return StreamingResponse(body(), media_type="text/plain")


@app.get("/healthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}
