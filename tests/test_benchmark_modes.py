"""The decoding modes ``benchmarks/instructions.py --mode`` prices: each returns one sequence of the asked tokens, so
its "a token" is a token the caller receives, and perfmon counts that request and those tokens in every mode."""

from __future__ import annotations

import pytest
import torch

from benchmarks.common import tiny_gpt2
from benchmarks.instructions import MODES, generate_kwargs

from .conftest import value

pytest.importorskip("transformers")

TOKENS = 5


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_returns_one_sequence_of_the_asked_tokens_and_perfmon_counts_them(make_monitor, mode: str) -> None:
    mon = make_monitor(sample_rate=0.01)
    threads = torch.get_num_threads()
    try:
        net = tiny_gpt2()  # (which sets one torch thread, for the benchmarks)
    finally:
        torch.set_num_threads(threads)
    model = mon.wrap(net, name="gpt2")
    prompt = torch.randint(2, 1000, (1, 8))
    requests = 3
    for _ in range(requests):
        kw = generate_kwargs(mode, TOKENS)
        with torch.inference_mode():
            out = model.generate(prompt, **kw)
        # Ground truth apart from perfmon: what generate() returned, and what the caller's streamer was handed.
        assert out.shape == (1, 8 + TOKENS), mode
        if mode == "streamer":  # the prompt's put, then one a token
            assert kw["streamer"].puts == 1 + TOKENS
    mon.flush()
    assert value(mon, "perfmon_generation_requests_total", model="gpt2", outcome="ok") == requests
    assert value(mon, "perfmon_generated_tokens_total", model="gpt2") == requests * TOKENS
    assert value(mon, "perfmon_prompt_tokens_total", model="gpt2") == requests * 8
