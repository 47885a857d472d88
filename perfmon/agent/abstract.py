"""A call's inputs described abstractly, to count its FLOPs and bytes later, off the request thread.

``describe`` runs once per new input signature, on the signature's rare path (phases.py): it keeps each
tensor's shape, dtype and device, and plain values (numbers, strings, flags, ``None``, dtypes and devices)
as they are, looking into lists, tuples and dicts, and an empty Hugging Face KV cache as its class (a prefill).
It never keeps a reference to the caller's tensors or objects: anything else (a cache holding tokens, a
user's class) makes the description ``Opaque``, and that
signature's count is unknown rather than guessed. ``materialize`` rebuilds the arguments as empty tensors
under the fake mode of flopcount.py (no memory, no compute).

What is described is the signature's *first* call: bookkeeping arguments that the signature leaves out
(``attention_mask``, positions: phases.BOOKKEEPING_KWARGS) and plain values that vary between its calls are
taken from that call.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

__all__ = ["CallSpec", "FreshCache", "Opaque", "TensorSpec", "describe", "materialize", "with_dtype"]

#: Containers looked into at most this deep and this long; beyond, the call is opaque.
MAX_DEPTH = 4
MAX_ITEMS = 64
_PLAIN = (int, float, bool, str, bytes, complex, type(None), torch.dtype, torch.device)


class TensorSpec(NamedTuple):
    """A tensor argument as its shape, dtype and device (contiguous: strides do not change FLOPs or bytes)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: str
    requires_grad: bool = False


class Opaque(NamedTuple):
    """A call perfmon cannot rebuild: why (the first argument it could not describe)."""

    reason: str


class FreshCache(NamedTuple):
    """An empty Hugging Face KV cache (a prefill's: ``generate()`` passes one it just made): rebuilt as a new,
    empty instance of its class, which the fake forward fills with fake tensors (never the caller's)."""

    cls: type


class CallSpec(NamedTuple):
    """A call's positional and keyword arguments, tensors as ``TensorSpec``, containers as tuples of parts."""

    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...]


class _Refused(Exception):
    pass


def describe(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> CallSpec | Opaque:
    """The abstract form of one call (``CallSpec``), or ``Opaque`` naming what could not be described."""
    try:
        return CallSpec(tuple(_part(a, 0) for a in args), tuple((k, _part(v, 0)) for k, v in kwargs.items()))
    except _Refused as exc:
        return Opaque(str(exc))


def _part(value: Any, depth: int) -> Any:
    if isinstance(value, torch.Tensor):
        if type(value) is not torch.Tensor and not isinstance(value, torch.nn.Parameter):
            raise _Refused(f"argument of type {type(value).__name__} (a tensor subclass)")
        if value.is_nested:  # a strided nested tensor: no shape to describe
            raise _Refused("a nested tensor")
        return TensorSpec(tuple(value.shape), value.dtype, str(value.device), value.requires_grad)
    if isinstance(value, _PLAIN):
        return value
    if depth >= MAX_DEPTH:
        raise _Refused(f"arguments nested deeper than {MAX_DEPTH}")
    t = type(value)
    if t in (list, tuple):
        if len(value) > MAX_ITEMS:
            raise _Refused(f"a {t.__name__} of more than {MAX_ITEMS} items")
        return (t, tuple(_part(v, depth + 1) for v in value))
    if t is dict:
        if len(value) > MAX_ITEMS:
            raise _Refused(f"a dict of more than {MAX_ITEMS} items")
        if any(not isinstance(k, _PLAIN) for k in value):  # dropping the entry would count another call
            key = next(k for k in value if not isinstance(k, _PLAIN))
            raise _Refused(f"a dict key of type {type(key).__name__}")
        return (dict, tuple((k, _part(v, depth + 1)) for k, v in value.items()))
    if _empty_hf_cache(value):
        return FreshCache(t)
    raise _Refused(f"argument of type {t.__name__}")


def _empty_hf_cache(value: Any) -> bool:
    """A transformers ``Cache`` holding no token yet (a non-empty one is a decode step's: its contents are the
    caller's, which a description cannot keep, so that call stays opaque)."""
    if not type(value).__module__.startswith("transformers."):
        return False
    length = getattr(value, "get_seq_length", None)
    try:
        return callable(length) and length() == 0
    except Exception:
        return False


def materialize(spec: CallSpec) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` for a call of ``spec``: new empty tensors (call it under a fake mode: no memory)."""
    return tuple(_build(a) for a in spec.args), {k: _build(v) for k, v in spec.kwargs}


def _build(part: Any) -> Any:
    if isinstance(part, FreshCache):
        return part.cls()
    if isinstance(part, TensorSpec):
        t = torch.empty(part.shape, dtype=part.dtype, device=part.device)
        return t.requires_grad_(True) if part.requires_grad else t
    if isinstance(part, tuple) and len(part) == 2 and part[0] in (list, tuple, dict):
        kind, items = part
        if kind is dict:
            return {k: _build(v) for k, v in items}
        return kind(_build(v) for v in items)
    return part


def with_dtype(spec: CallSpec | Opaque | None, dtype: torch.dtype) -> CallSpec | Opaque | None:
    """A one-tensor call's spec in another dtype (the hot path keys such calls on the shape alone)."""
    if not isinstance(spec, CallSpec) or len(spec.args) != 1 or spec.kwargs or not isinstance(spec.args[0], TensorSpec):
        return spec
    return CallSpec((spec.args[0]._replace(dtype=dtype),), ())
