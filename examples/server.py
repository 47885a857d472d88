"""An inference server with perfmon embedded: FastAPI + uvicorn serving a small Transformer encoder.

    pip install -e ".[examples]"
    PERFMON_TOKEN=change-me uvicorn examples.server:app --host 127.0.0.1 --port 8000

perfmon serves /metrics, /stats and the capture API on its own port (PERFMON_PORT, default 9478)
and, as an alternative for platforms that scrape the application's port, the same routes are
mounted under /perfmon on the app itself (/perfmon/metrics). Configure with PERFMON_* variables.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import torch
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, Field

import perfmon

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
D_MODEL = 64


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=D_MODEL, nhead=4, dim_feedforward=128, batch_first=True)
    return torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).to(DEVICE).eval()


# PERFMON_ENABLED=false serves the bare model (benchmarks/throughput.py compares the two).
ENABLED = os.environ.get("PERFMON_ENABLED", "true").lower() not in ("0", "false", "no", "off")
monitor = perfmon.Monitor()
model = monitor.wrap(build_model(), name=os.environ.get("MODEL_NAME", "encoder")) if ENABLED else build_model()


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    if ENABLED:
        monitor.start()
    try:
        yield
    finally:
        monitor.stop()


app = FastAPI(title="perfmon example inference server", lifespan=lifespan)
app.mount("/perfmon", monitor.asgi_app)


class PredictRequest(BaseModel):
    #: token embeddings, [sequence][D_MODEL] per item: a batch of one sequence here
    tokens: list[list[float]] = Field(min_length=1, max_length=512)


class PredictResponse(BaseModel):
    embedding: list[float]


@app.post("/predict", response_model=PredictResponse)
def predict(req: PredictRequest) -> PredictResponse:
    if any(len(row) != D_MODEL for row in req.tokens):
        raise HTTPException(status_code=400, detail=f"each token needs {D_MODEL} values")
    x = torch.tensor(req.tokens, dtype=torch.float32, device=DEVICE).unsqueeze(0)
    with torch.inference_mode():
        y = model(x)
    return PredictResponse(embedding=y.mean(dim=1)[0].tolist())


@app.get("/healthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}
