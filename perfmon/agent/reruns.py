"""The steps of a ``generate()`` given no KV cache (``use_cache=False``): each reruns the whole sequence.

Without a cache every step after the first is a forward of the prompt and the tokens so far: a prefill's work, counted
as one (stages.py), whose signature follows the sequence's length. Through the staged path in full such a step paid the
stage function, the general signature and the hot path's lookup, ~27 Python calls: ~7.6 µs a token by instruction count
and +10..+20 µs in wall time, the model's forward having evicted perfmon's code and data from the caches (BENCHMARKS
§3b, session 39). No step repeats within a call, but every call of a prompt length runs the same lengths again, so the
memo is the model's, across calls: (the input's shape and dtype, the keyword names, their values' types) -> that step's
signature in the prefill stage's table, once it is warm. A step it finds is counted and called as the decode short path
does (``Reruns.step``), and its timed calls (one in 1/sample_rate, or every one while a capture is armed) take the
prefill stage's timed path.

A step whose signature holds more than that is never memoed: a positional argument, or a keyword other than the input
and the bookkeeping (``phases.BOOKKEEPING_KWARGS``: masks, positions) whose value the signature looks into (a tensor, a
list or tuple: an encoder's states of their own length under cross-attention would share the first length's
signature). So a step the memo finds has the very signature it was memoed under. A signature evicted from the table
(shapes churning; a forked child's copy of the parent's, ``SignatureTable.orphan``) is let go of: its step takes the
full path again. Bounded: past ``MAX_RERUNS`` keys the memo starts over.
"""

from __future__ import annotations

from collections.abc import Callable
from time import perf_counter_ns
from typing import Any

import torch

from .hotpath import due_step
from .phases import BOOKKEEPING_KWARGS, LOOKED_INTO, Signature

__all__ = ["MAX_RERUNS", "MISS", "Reruns"]

_Tensor = torch.Tensor

#: Keys a model's memo holds before it is cleared: a server's prompt lengths times the
#: tokens it generates stay well under it; a churning mix turns signature tracking off first anyway.
MAX_RERUNS = 4096

#: What ``Reruns.step`` returns for a step the memo does not hold (a model's forward never returns this object).
MISS: Any = object()


class Reruns:
    """One model's memo of the no-cache steps of its ``generate()`` calls (``staged_path`` reads it)."""

    __slots__ = ("fn", "internal", "memo", "sampled", "state")

    def __init__(self, state: Any, fn: Callable[..., Any], sampled: Callable[..., Any], *, internal: Any) -> None:
        """``state``: the prefill stage's ``ModelState``; ``fn`` its call target and ``sampled`` its timed path
        (``hotpath.sampled_path``); ``internal``: the ``InternalErrors`` a fault of the memo's is counted in
        (``stage``)."""
        self.memo: dict[tuple[Any, Any, tuple[str, ...], tuple[type, ...]], Signature] = {}
        self.state = state
        self.fn = fn
        self.sampled = sampled
        self.internal = internal

    def step(self, model: Any, args: tuple[Any, ...], kwargs: dict[str, Any], stamps: list[int] | None) -> Any:
        """Run a no-cache step of a ``generate()`` (``Active.rerun``) when the memo holds its signature, warm and
        in its table: count it (the stage's calls and the signature's, which count its items) and call it, or time
        it when due. ``MISS`` (nothing run) otherwise. ``stamps``: the call's ``Active.stamps`` (a custom loop's
        tokens, one a forward)."""
        st = self.state
        try:
            ids = kwargs.get("input_ids")
            if type(ids) is not _Tensor or args:
                return MISS
            entry = self.memo.get((ids.shape, ids.dtype, tuple(kwargs), tuple(map(type, kwargs.values()))))
            if entry is None or entry.warm_left or entry.evicted_ns or st.sigs is None:
                return MISS
            n = next(st.calls)
            next(entry.calls)
        except RuntimeError:  # a strided nested tensor has no shape: the full path keys it (phases.nested_key)
            return MISS
        except Exception as exc:  # nothing counted or run: the full path takes the step
            self.internal.report("stage", exc)
            return MISS
        if n >= st.next_index:
            out = due_step(st, self.fn, self.sampled, n, entry, model, args, kwargs)
        else:
            try:
                out = self.fn(model, *args, **kwargs)
            except BaseException as exc:
                st.error(exc)
                raise
        if stamps is not None:
            stamps.append(perf_counter_ns())
        return out

    def keep(self, key: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """After a no-cache step took the full path: memo its signature when it is warm in the prefill stage's table
        and follows from what the memo keys on. ``key``: the step's ``Active.step_key`` (its input shape, keyword count
        and signature: ``step_signature``)."""
        st = self.state
        sigs = st.sigs
        ids = kwargs.get("input_ids")
        if sigs is None or key is None or args or type(ids) is not _Tensor or ids.is_nested or st.items_fn is not None:
            return
        if key[0] != ids.shape:  # (the shape step_signature kept the signature with)
            return
        for name, value in kwargs.items():
            if name != "input_ids" and name not in BOOKKEEPING_KWARGS and isinstance(value, LOOKED_INTO):
                return
        entry = sigs.get(key[2])
        if entry is None or entry.warm_left or entry.evicted_ns:
            return
        memo = self.memo
        if len(memo) >= MAX_RERUNS:
            memo.clear()
        memo[(ids.shape, ids.dtype, tuple(kwargs), tuple(map(type, kwargs.values())))] = entry
