"""A WSGI app serving a tiny random GPT-2's ``generate()``, warmed up in the pre-fork master (tests/test_servers.py).

Servers warm a model up before they fork their workers. Under ``gunicorn --preload`` this module runs in the master:
the monitor starts, then a few ``generate()`` calls, cached and not, run, so the master's signatures, the decode steps'
memo, quiet decoding's lessons and the no-cache steps' memo all exist before the fork. Each response carries the
worker's own count of the forwards it ran and their rows: the ground truth, from a forward pre-hook on the inner
transformer (a hook on the model itself would keep its calls from running quiet), reset in each forked child.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
import transformers

import perfmon

torch.set_num_threads(1)  # an OpenMP pool of the master's at work can hang a forked child in an op
transformers.logging.set_verbosity_error()
torch.manual_seed(0)
_CONFIG = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=101, n_positions=64, bos_token_id=100,
                                  eos_token_id=100, pad_token_id=100)
monitor = perfmon.Monitor(log_format="json").start()
model = monitor.wrap(transformers.GPT2LMHeadModel(_CONFIG).eval(), name="gpt2")
agent = monitor.wsgi_app

#: This process's forwards and their rows since it was forked (or started).
seen = {"forwards": 0, "rows": 0}


def _count(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    ids = kwargs.get("input_ids", args[0] if args else None)
    seen["forwards"] += 1
    seen["rows"] += int(ids.shape[0])


model.transformer.register_forward_pre_hook(_count, with_kwargs=True)
os.register_at_fork(after_in_child=lambda: seen.update(forwards=0, rows=0))

_IDS = torch.arange(10).reshape(2, 5)


def generate(use_cache: bool) -> torch.Tensor:
    """Two rows of five tokens, six new tokens each."""
    with torch.inference_mode():
        return model.generate(_IDS, attention_mask=torch.ones_like(_IDS), max_new_tokens=6, min_new_tokens=6,
                              do_sample=False, use_cache=use_cache)


for _ in range(4):  # the master's warm-up
    generate(True)
    generate(False)


def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    path = environ.get("PATH_INFO", "/")
    if path.startswith("/perfmon/"):
        return agent({**environ, "PATH_INFO": path[len("/perfmon"):]}, start_response)
    if path == "/generate":
        out = generate(use_cache="nocache" not in environ.get("QUERY_STRING", ""))
        body = json.dumps({"pid": os.getpid(), "url": monitor.url, "tokens": int(out.shape[-1]), **seen}).encode()
        start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
        return [body]
    start_response("404 Not Found", [("Content-Length", "0")])
    return [b""]
