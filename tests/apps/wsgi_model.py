"""A WSGI inference app with perfmon embedded the documented pre-fork way (tests/test_servers.py).

The monitor is built and started at import: under ``gunicorn --preload`` that is the master, before it
forks the workers, and every worker rebuilds its own monitor after the fork. perfmon's routes are also
mounted under /perfmon so a test can reach whichever worker answered, bound to a port or not.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch

import perfmon

torch.set_num_threads(1)
monitor = perfmon.Monitor(log_format="json").start()
model = monitor.wrap(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)),
                     name="mlp")
agent = monitor.wsgi_app


def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    path = environ.get("PATH_INFO", "/")
    if path.startswith("/perfmon/"):
        return agent({**environ, "PATH_INFO": path[len("/perfmon"):]}, start_response)
    if path == "/predict":
        with torch.inference_mode():
            y = model(torch.ones(2, 16))
        body = json.dumps({"pid": os.getpid(), "sum": float(y.sum())}).encode()
        start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
        return [body]
    if path == "/whoami":
        body = json.dumps({"pid": os.getpid(), "url": monitor.url, "health": monitor.health()[1]}).encode()
        start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
        return [body]
    start_response("404 Not Found", [("Content-Length", "0")])
    return [b""]
