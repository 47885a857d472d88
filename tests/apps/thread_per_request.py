"""An inference app on a thread-per-request server, perfmon embedded (tests/test_thread_servers.py).

``python -m tests.apps.thread_per_request stdlib|werkzeug PORT``: the stdlib ``ThreadingHTTPServer`` or
werkzeug's threaded development server (what Flask's ``app.run()`` and Django's runserver do): each request
runs on a new thread, which ends after it; a new thread often gets the ident of one that just ended.
``GET /predict`` runs the model once; ``POST /slow`` makes every later call slower (a regression for the
detector); perfmon's agent serves on ``PERFMON_PORT``. Regression detection runs with short windows, so
the automatic captures (the baseline, then a regression) come within seconds.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

import perfmon

torch.set_num_threads(1)


class Model(torch.nn.Module):
    """Eight linear layers; ``delay`` seconds added inside forward once ``POST /slow`` asks (a regression)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
        self.delay = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.delay:
            time.sleep(self.delay)
        return self.layers(x)


policy = perfmon.RegressionPolicy(window_seconds=1.0, min_samples=5, consecutive=1, baseline_windows=2,
                                  cooldown_seconds=1.0, capture_steps=5, capture_max_seconds=5.0)
monitor = perfmon.Monitor(log_format="json", sample_rate=1.0, regression=policy).start()
model = monitor.wrap(Model(), name="mlp")


def route(method: str, path: str) -> tuple[str, bytes]:
    if path == "/predict":
        with torch.inference_mode():
            y = model(torch.ones(4, 64))
        return "200 OK", json.dumps({"pid": os.getpid(), "sum": float(y.sum())}).encode()
    if path == "/slow" and method == "POST":
        model.delay = 0.02  # 20 ms: well past 1.5x a baseline that GIL queueing on a loaded host puts at 5-10 ms
        return "200 OK", b"{}"
    return "404 Not Found", b"{}"


def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    status, body = route(environ["REQUEST_METHOD"], environ.get("PATH_INFO", "/"))
    start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
    return [body]


class Handler(BaseHTTPRequestHandler):
    def _answer(self) -> None:
        status, body = route(self.command, self.path)
        self.send_response(int(status.split()[0]))
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args: Any) -> None:
        pass


def main() -> None:
    kind, port = sys.argv[1], int(sys.argv[2])
    if kind == "stdlib":
        ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
    else:
        from werkzeug.serving import run_simple

        run_simple("127.0.0.1", port, app, threaded=True)


if __name__ == "__main__":
    main()
