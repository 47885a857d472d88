"""Prefill vs decode: which stage of a generate loop a forward call is.

A decoder's forward runs in two very different regimes: prefill (the whole prompt, compute-bound,
its cost grows with the prompt) and decode (one new token against the KV cache, memory-bound, a few
milliseconds). Reported in one series their percentiles are a bimodal mix whose shape follows the
prompt lengths of the traffic, so a model with stages gets one set of series per stage
(``stage="prefill"`` / ``stage="decode"``); cold vs steady stays orthogonal.

Hugging Face-style models are recognised without configuration: a forward that accepts
``past_key_values`` is generative, and a call is a decode step when it is given a cache that already
holds tokens (``Cache.get_seq_length() > 0``, or a non-empty legacy tuple), or, without a cache, a
``cache_position`` of one token. Reading a cache's length is host-side bookkeeping (a tensor shape),
never a device sync. Any other model has one stage; ``wrap(stage=callable)`` labels custom loops.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["DECODE", "MAX_STAGES", "PREFILL", "StageFn", "generative_stage", "is_generative", "stage_label"]

PREFILL = "prefill"
DECODE = "decode"
#: Distinct stage labels per model; beyond, calls are labelled "other" (labels stay bounded).
MAX_STAGES = 8

#: (args, kwargs) of a forward call -> its stage label.
StageFn = Callable[[tuple[Any, ...], Mapping[str, Any]], str]


def is_generative(module: Any) -> bool:
    """True for a module whose ``forward`` takes ``past_key_values`` (a Hugging Face-style decoder)."""
    forward = getattr(module, "forward", None)
    if forward is None:
        return False
    try:
        return "past_key_values" in inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return False


def generative_stage(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
    """``decode`` for a step against a KV cache that already holds tokens, else ``prefill``."""
    cache = kwargs.get("past_key_values")
    if cache is not None:
        length = getattr(cache, "get_seq_length", None)
        if length is not None:
            return DECODE if length() > 0 else PREFILL
        try:
            return DECODE if len(cache) > 0 else PREFILL
        except TypeError:
            return DECODE
    position = kwargs.get("cache_position")
    if position is not None and getattr(position, "shape", None) is not None:
        # No cache object: a one-token step at a known position is a decode step.
        return DECODE if tuple(position.shape)[-1:] == (1,) and _input_length(args, kwargs) == 1 else PREFILL
    return PREFILL


def _input_length(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int | None:
    ids = kwargs.get("input_ids", args[0] if args else None)
    shape = getattr(ids, "shape", None)
    return int(shape[-1]) if shape is not None and len(shape) >= 1 else None


def stage_label(value: Any) -> str:
    """Validate what a ``stage=`` callable returned: a short printable string."""
    if not isinstance(value, str) or not value or len(value) > 32 or not value.isprintable():
        raise ValueError(f"stage callable returned {value!r}: expected a non-empty printable string of <= 32 "
                         "characters")
    return value
