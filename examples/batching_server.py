"""A dynamic-batching inference server with perfmon's request spans: queue / model / rest per request.

    pip install -e ".[examples]"
    uvicorn examples.batching_server:app --host 127.0.0.1 --port 8000      # or: python -m examples.batching_server 8000

``POST /predict {"id": "...", "x": [64 floats]}``: the endpoint hands the request to a batcher thread and awaits
its result. The batcher collects requests from a queue until ``MAX_BATCH`` are waiting or ``MAX_WAIT_MS`` passed
since the first, runs one forward of the wrapped model on the stacked batch and resolves each request's future.

perfmon's part (four lines): ``RequestMiddleware`` opens a span per HTTP request (arrival: the app is called;
end: the response's last byte handed to the server); ``monitor.current_request()`` gives the endpoint its span;
``span.enqueued()`` marks the enqueue; ``with monitor.batch(spans):`` on the batcher thread marks the forward as
every span's model part. So per request: queue = enqueue -> batch start, model = the batch's forward, rest = the
remainder (parsing, serialising, sending). ``/perfmon/metrics`` has ``perfmon_request_seconds{part=...}``.

The server also keeps its own stamps per request (``perf_counter_ns``: arrival and response from a small ASGI
middleware of its own, enqueue, batch start and end from the batcher): ``GET /debug`` lists them, so that
tests/test_batching_server.py can check perfmon's split against them. Configure with ``PERFMON_*`` variables.
"""

from __future__ import annotations

import asyncio
import collections
import os
import queue
import sys
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from time import perf_counter_ns
from typing import Any

import torch
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, Field

import perfmon

D_IN, D_HIDDEN = 64, 512
MAX_BATCH = int(os.environ.get("MAX_BATCH", "8"))
MAX_WAIT_MS = float(os.environ.get("MAX_WAIT_MS", "5"))
#: The server's own stamps of the latest requests (GET /debug), bounded.
STAMPS: collections.deque[dict[str, Any]] = collections.deque(maxlen=10_000)
_stamps: ContextVar[dict[str, Any] | None] = ContextVar("stamps", default=None)


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(D_IN, D_HIDDEN), torch.nn.GELU(), torch.nn.Linear(D_HIDDEN, D_HIDDEN),
                               torch.nn.GELU(), torch.nn.Linear(D_HIDDEN, 1)).eval()


monitor = perfmon.Monitor()
model = monitor.wrap(build_model(), name=os.environ.get("MODEL_NAME", "scorer"))


@dataclass
class Pending:
    x: torch.Tensor
    span: perfmon.RequestSpan | None
    stamps: dict[str, Any]
    future: Future[float] = field(default_factory=Future)


class Batcher:
    """A dynamic batcher: one thread, up to ``max_batch`` requests or ``max_wait_ms`` after the first."""

    def __init__(self, forward: Callable[[torch.Tensor], torch.Tensor], *, max_batch: int, max_wait_ms: float) -> None:
        self.forward = forward
        self.max_batch = max_batch
        self.max_wait_ns = int(max_wait_ms * 1e6)
        self.queue: queue.Queue[Pending] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="batcher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def submit(self, x: torch.Tensor, span: perfmon.RequestSpan | None, stamps: dict[str, Any]) -> Future[float]:
        pending = Pending(x, span, stamps)
        if span is not None:
            span.enqueued()
        stamps["enqueue_ns"] = perf_counter_ns()
        self.queue.put(pending)
        return pending.future

    def _collect(self) -> list[Pending]:
        """The next batch: block for a first request (0.1 s at a time, to notice stop), then fill it."""
        try:
            batch = [self.queue.get(timeout=0.1)]
        except queue.Empty:
            return []
        deadline = perf_counter_ns() + self.max_wait_ns
        while len(batch) < self.max_batch:
            left = (deadline - perf_counter_ns()) / 1e9
            if left <= 0:
                break
            try:
                batch.append(self.queue.get(timeout=left))
            except queue.Empty:
                break
        return batch

    def _run(self) -> None:
        while not self._stop.is_set():
            batch = self._collect()
            if not batch:
                continue
            start = perf_counter_ns()
            try:
                with monitor.batch([p.span for p in batch]), torch.inference_mode():
                    out = self.forward(torch.stack([p.x for p in batch]))[:, 0].tolist()
            except Exception as exc:  # one bad batch fails its requests, not the batcher
                for p in batch:
                    p.future.set_exception(exc)
                continue
            end = perf_counter_ns()
            for p, y in zip(batch, out, strict=True):
                p.stamps.update(batch_start_ns=start, batch_end_ns=end, batch_size=len(batch))
                p.future.set_result(y)


batcher = Batcher(model, max_batch=MAX_BATCH, max_wait_ms=MAX_WAIT_MS)


class ServerStamps:
    """The server's own arrival and response stamps (ASGI), inside perfmon's middleware, beside its spans."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http" or scope.get("path") != "/predict":
            await self.app(scope, receive, send)
            return
        stamps: dict[str, Any] = {"arrival_ns": perf_counter_ns()}
        token = _stamps.set(stamps)

        async def send_(message: dict[str, Any]) -> None:
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                stamps["response_ns"] = perf_counter_ns()
                STAMPS.append(stamps)

        try:
            await self.app(scope, receive, send_)
        finally:
            _stamps.reset(token)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    monitor.start()
    batcher.start()
    try:
        yield
    finally:
        batcher.stop()
        monitor.stop()


app = FastAPI(title="perfmon dynamic batching example", lifespan=lifespan)
app.add_middleware(ServerStamps)
app.add_middleware(perfmon.RequestMiddleware, monitor=monitor)  # added last: outermost, sees the whole request
app.mount("/perfmon", monitor.asgi_app)


class PredictRequest(BaseModel):
    id: str = Field(max_length=64)
    x: list[float] = Field(min_length=D_IN, max_length=D_IN)


@app.post("/predict")
async def predict(req: PredictRequest) -> dict[str, Any]:
    stamps = _stamps.get()
    if stamps is None:  # pragma: no cover - ServerStamps covers /predict
        raise HTTPException(status_code=500, detail="no stamps")
    stamps["id"] = req.id
    future = batcher.submit(torch.tensor(req.x), monitor.current_request(), stamps)
    y = await asyncio.wrap_future(future)
    return {"id": req.id, "y": y, "batch_size": stamps["batch_size"]}


@app.get("/debug")
def debug() -> list[dict[str, Any]]:
    """The server's own stamps (perf_counter_ns) of the latest requests: arrival, enqueue, batch start and end,
    response; and the batch size."""
    return list(STAMPS)


@app.get("/healthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


if __name__ == "__main__":
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]) if len(sys.argv) > 1 else 8000, log_level="warning")
