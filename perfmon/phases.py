"""Cold vs steady state: the first calls of a model and of each new input signature are cold.

A signature is the shapes and dtypes of the call's tensor arguments. New shapes are where eager
PyTorch pays one-time costs (cuDNN autotuning, allocator growth, torch.compile recompiles), so
those calls are reported apart from steady state instead of polluting its percentiles.

The table is bounded. The request thread only does a dict lookup; insertion and eviction happen
on the (rare) cold path. Eviction is oldest-inserted-first rather than LRU: keeping recency would
cost a write on every call. A model whose signatures churn (every request a new sequence length,
more distinct shapes than the table holds) would make every call "cold"; once the table has
turned over completely, signature tracking is switched off for that model and the warm-up count
alone decides.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any

import torch

__all__ = ["SignatureTable", "signature"]

_Tensor = torch.Tensor


def _part(value: Any) -> Hashable:
    if isinstance(value, _Tensor):
        return (value.shape, value.dtype)
    if isinstance(value, (list, tuple)):
        # One level deep (a list of images, a tuple of tensors), bounded in length.
        if len(value) <= 8:
            return (type(value).__name__, tuple(_part_leaf(v) for v in value))
        return (type(value).__name__, len(value), _part_leaf(value[0]))
    # Other values contribute their type only: a changing int argument (max_new_tokens=...) must not
    # make every call a new signature.
    return type(value).__name__


def _part_leaf(value: Any) -> Hashable:
    if isinstance(value, _Tensor):
        return (value.shape, value.dtype)
    return type(value).__name__


def signature(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Hashable:
    """The general signature of a call. The hot path inlines the one-tensor case itself."""
    key: tuple[Hashable, ...] = tuple(_part(a) for a in args)
    if kwargs:
        key += tuple((k, _part(v)) for k, v in sorted(kwargs.items()))
    return key


class SignatureTable:
    """Signatures seen by one model, with how many of their first calls were cold (capped)."""

    def __init__(self, capacity: int, warm_calls: int) -> None:
        self.capacity = capacity
        self.warm_calls = warm_calls
        #: Read directly by the hot path: key -> number of calls seen, up to warm_calls.
        self.seen: dict[Hashable, int] = {}
        self.evictions = 0
        self.distinct = 0

    def observe(self, key: Hashable, count: int | None) -> bool:
        """Record one more call of ``key`` (seen ``count`` times so far); True if it is cold."""
        seen = self.seen
        if count is None:
            self.distinct += 1
            if len(seen) >= self.capacity:
                try:
                    del seen[next(iter(seen))]
                    self.evictions += 1
                except (StopIteration, KeyError, RuntimeError):
                    pass  # another thread evicted it first
            count = 0
        seen[key] = count + 1
        return count < self.warm_calls

    @property
    def churning(self) -> bool:
        """True once the table has turned over completely: shapes vary too much to call new ones cold."""
        return self.evictions >= self.capacity
