"""generate() on a real GPU: token and prompt counts read on the resolver thread, never on the request thread.

A beam search's returned sequences and a left-padded batch's attention mask live on the device; perfmon hands
their reading to the resolver (GenerationTracker.defer). Skipped without CUDA.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

transformers = pytest.importorskip("transformers")


def _gpt2() -> Any:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=101, n_positions=64,
                                  bos_token_id=100, eos_token_id=100, pad_token_id=100)
    return transformers.GPT2LMHeadModel(cfg).to("cuda").eval()


class _NoEos(transformers.LogitsProcessor):
    def __call__(self, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores[:, 100] = -float("inf")
        return scores


def test_beam_search_and_a_padded_batch_on_cuda_count_exactly(make_monitor) -> None:
    mon = make_monitor(sample_rate=0.01)
    model = mon.wrap(_gpt2(), name="gpt2")
    ids = torch.randint(0, 100, (2, 6), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # row 1 is left-padded by 2
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=8, num_beams=3, num_return_sequences=2,
                             logits_processor=transformers.LogitsProcessorList([_NoEos()]))
        model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                       logits_processor=transformers.LogitsProcessorList([_NoEos()]))
    assert out.shape == (4, 14)
    assert mon.flush()
    gen = mon.stats()["generation"]["gpt2"]
    assert gen["requests"]["ok"] == 4 + 2
    assert gen["generated_tokens"] == 4 * 8 + 2 * 8
    assert gen["prompt_tokens"] == 2 * (6 + 4) and gen["prompt_padding_tokens"] == 2 * 2
