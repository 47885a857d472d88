"""Live efficiency at its edges: inputs and models whose count would be wrong or costly; unknown, with the reason."""

from __future__ import annotations

from typing import Any

import torch

import perfmon

from .conftest import wait_until


def _settled(mon: perfmon.Monitor, model: str) -> dict[str, Any]:
    """Resolve the samples, then wait until the model's signature is counted or known to be uncountable."""
    mon.flush()
    return wait_until(lambda: (e := mon.stats()["models"][model]["efficiency"]).get("samples")
                      and not any(w.startswith("not counted yet") for w in e["unknown"]) and e,
                      what=f"{model}'s signature to be counted or refused")


class _SumOfLinears(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, parts: dict[Any, torch.Tensor]) -> torch.Tensor:
        return sum((self.lin(v).sum() for v in parts.values()), torch.zeros(()))


def test_a_dict_with_a_key_that_cannot_be_described_is_unknown_not_undercounted(make_monitor) -> None:
    """A dict argument with a tuple key is unknown ("a dict key of type tuple"): dropping that entry would count a
    call with fewer tensors than the real one."""
    mon = make_monitor(sample_rate=1.0, warmup_calls=0, stats_window_seconds=3600)
    model = mon.wrap(_SumOfLinears(), name="parts")
    parts = {("a", 1): torch.randn(2, 8), "b": torch.randn(4, 8)}
    with torch.no_grad():
        for _ in range(3):
            model(parts)
    eff = _settled(mon, "parts")
    assert eff["flops_per_call"] is None and eff["counted_samples"] == 0, eff
    assert any(w == "a dict key of type tuple" for w in eff["unknown"]), eff
