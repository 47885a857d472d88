"""One fake forward's cost, op by op: FLOPs by torch's own formulas, bytes moved (an estimate), and whether its
FLOPs run in 16 bits or fewer. flopcount.py runs a fake copy's forward under ``OpCounting`` on its counting thread.

FLOPs: ``torch.utils.flop_counter``'s registry (matmuls, convolutions, attention, CPU's fused attention too); an
op it has no formula for is decomposed, as ``FlopCounterMode`` does, and elementwise ops count 0. Bytes: for every
aten op that is not a view, its tensor inputs and outputs; a lookup (embedding, index_select, gather) counts the
rows it returns, read and written, and its indices, not the whole table (flopcount.py's docstring says what that
leaves out).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpCounting", "flop_registry"]

_HALF = frozenset({torch.float16, torch.bfloat16, *(getattr(torch, n) for n in (
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz") if hasattr(torch, n))})
_aten = torch.ops.aten
#: Ops that read metadata or allocate without touching memory: no bytes (nor have prim:: ops, nor views).
_NO_BYTES = frozenset({_aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default,
                       _aten.lift_fresh.default, _aten.detach.default, _aten.alias.default,
                       _aten.sym_size.int, _aten.sym_stride.int, _aten.sym_numel.default,
                       _aten.sym_storage_offset.default, _aten.is_contiguous.default})

#: Ops that read only the rows they return from their first argument: bytes are the output (read, then written)
#: and the indices.
_GATHERS = frozenset({_aten.embedding.default, _aten.index_select.default, _aten.gather.default,
                      _aten.index.Tensor})


#: Fused attention kernels torch's registry has no formula for, though they compute what its flash-attention
#: formula counts (same query, key, value arguments first, (batch, heads, sequence, head dim) each): on CPU,
#: ``scaled_dot_product_attention`` runs the first (transformers' default attention), so without it a tiny
#: BertModel's count lacked its 262,144 attention FLOPs, not reported as unknown (session 36).
_SDPA_LIKE = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_fused_attention_overrideable")


def flop_registry() -> dict[Any, Any]:
    """torch's FLOP formulas by op packet, with its flash-attention formula for the fused kernels in ``_SDPA_LIKE``
    (empty on a torch without them: every count then fails, none is guessed)."""
    try:
        from torch.utils.flop_counter import flop_registry as registry
    except ImportError:  # an older or newer torch without it
        return {}
    out = dict(registry)
    flash = registry.get(getattr(_aten, "_scaled_dot_product_flash_attention", None))
    for name in _SDPA_LIKE if flash is not None else ():
        packet = getattr(_aten, name, None)
        if packet is not None:
            out.setdefault(packet, flash)
    return out


class OpCounting(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's base is untyped
    """Counts FLOPs and bytes of each aten op (as FlopCounterMode decomposes what it has no formula for), calling
    ``check`` first at every op (flopcount.py's clock: it raises to end the count, or pauses it)."""

    def __init__(self, check: Callable[[], None], registry: dict[Any, Any]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.check = check
        self.registry = registry
        self.flops = 0
        self.bytes = 0
        self.half = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.check()
        packet = getattr(func, "_overloadpacket", None)
        formula = self.registry.get(packet)
        if formula is None and isinstance(func, torch._ops.OpOverload) and func is not torch.ops.prim.device.default:
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        if formula is not None:
            self.flops += int(formula(*args, **kwargs, out_val=out))
            if not self.half:
                self.half = any(t.dtype in _HALF for t in _tensors(args))
        if func in _GATHERS:  # a lookup reads the rows it returns, not its whole table (an embedding's vocabulary)
            moved = 2 * _nbytes(out) + sum(_nbytes(t) for t in _tensors(args[1:]) if not t.is_floating_point())
            self.bytes += moved
        elif func not in _NO_BYTES and not getattr(func, "is_view", False) and getattr(func, "namespace", "") != "prim":
            self.bytes += _nbytes((args, kwargs, out))
        return out


def _nbytes(tree: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(tree))


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]
