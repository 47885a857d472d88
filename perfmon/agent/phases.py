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

import collections
import itertools
import threading
import time
import warnings
from collections.abc import Hashable, Mapping
from typing import Any

import torch

from ..faults import count_value
from .abstract import CallSpec, describe, with_dtype

__all__ = ["BOOKKEEPING_KWARGS", "LOOKED_INTO", "Signature", "SignatureTable", "batch_of", "nested_key", "signature"]

_Tensor = torch.Tensor
#: Values whose type alone is not their signature part (``_part`` reads a tensor subclass, looks one level
#: into a list or tuple); any other value is its type's name.
LOOKED_INTO = (list, tuple, torch.Tensor)


def nested_key(t: torch.Tensor) -> Hashable:
    """A nested tensor's signature part: its rank and dtype, not its ragged sizes. A strided one has no ``shape``
    (it raises), a jagged one's shape holds a symbolic size new with each offsets tensor; either way a ragged
    batch is what it is for, and keying on its layout would make every call a new, cold signature."""
    return ("nested", t.dim(), t.dtype)


def _tensor_part(value: torch.Tensor) -> Hashable:
    return nested_key(value) if value.is_nested else (value.shape, value.dtype)


def _part(value: Any) -> Hashable:
    if isinstance(value, _Tensor):
        return _tensor_part(value)
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
        return _tensor_part(value)
    return type(value).__name__


#: Keyword arguments that are bookkeeping, not work: in a decode loop the attention mask grows by one
#: column every step (and positions move) while the step's work, one token per sequence against the
#: cache, stays the same. Counted in a signature, every decode step would be a "new" input: half the
#: calls cold and the table churning. The work's shape is in the inputs (``input_ids``: B x 1).
#: Continuous batching (transformers' paged path) passes the same kind of bookkeeping for its packed step:
#: sequence offsets, which logits to keep, the paged cache's read/write indices and block table; the step's
#: work is its ``input_ids`` (1 x tokens in the step).
BOOKKEEPING_KWARGS = frozenset({"attention_mask", "cache_position", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k",
                                "logits_indices", "read_index", "write_index", "block_table"})


def signature(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Hashable:
    """The general signature of a call: what work it does, not its bookkeeping (see BOOKKEEPING_KWARGS).

    The hot path inlines the one-tensor case itself. Keyword arguments are taken in the caller's order,
    not sorted: a call site passes them in one order (sorting cost ~0.2 µs of ~2 µs on a Hugging Face
    decode step), and one passing them in another order only costs one more cold call. Plain tensors
    are read inline, not through ``_part``: a decode step's signature went from 2.2 to ~1.2 µs.
    """
    tensor, kinds, skip = _Tensor, _LOOK_INTO, BOOKKEEPING_KWARGS
    parts: list[Hashable] = []
    try:
        for a in args:
            parts.append((a.shape, a.dtype) if type(a) is tensor else _part(a))
        for k, v in kwargs.items():
            if k in skip:
                continue
            t = type(v)
            if t is tensor:  # the common values inline (a tensor, a flag, a cache object), _part for the rest
                parts.append((k, (v.shape, v.dtype)))
            else:
                look = kinds.get(t)
                if look is None:
                    look = _look_into(t)
                parts.append((k, _part(v) if look else t.__name__))
    except RuntimeError:  # a strided nested tensor read inline: no shape (free until raised, Python 3.11+)
        return tuple([_part(a) for a in args] + [(k, _part(v)) for k, v in kwargs.items() if k not in skip])
    return tuple(parts)


#: type -> whether ``signature`` looks into its values (lists, tuples, tensor subclasses) or takes its name.
#: ``isinstance(v, torch.Tensor)`` goes through the tensor metaclass's ``__instancecheck__`` (~0.1 µs): a
#: decode step's four non-tensor keywords paid it every call. Bounded: past it, types are not remembered.
_LOOK_INTO: dict[type, bool] = {}
_LOOK_INTO_MAX = 256


def _look_into(t: type) -> bool:
    look = issubclass(t, LOOKED_INTO)
    if len(_LOOK_INTO) < _LOOK_INTO_MAX:
        _LOOK_INTO[t] = look
    return look


def work_of(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int | None:
    """A call's work for like-for-like latency comparison: the element count of ``input_ids`` when passed
    (batch x tokens for a prefill, batch for a decode step), else of the first tensor argument."""
    ids = kwargs.get("input_ids") if kwargs else None
    if isinstance(ids, _Tensor):
        return _int(ids.numel())
    for value in (*args, *kwargs.values()):
        if isinstance(value, _Tensor):
            return _int(value.numel())
    return None


def batch_of(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int | None:
    """Default items of a call: the first dimension of its first tensor argument (1 for a scalar tensor)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, _Tensor):
            return _int(value.size(0)) if value.dim() else 1  # size(0), not shape[0]: a nested tensor has one
    return None


def _int(n: Any) -> int:
    """A size as an int. Under ``torch.jit.trace`` sizes are traced tensors, and ``int()`` of one warns that the trace
    may be wrong: perfmon's own bookkeeping, not the model's data flow, so its warning is not the user's."""
    if type(n) is int:
        return n
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)  # type: ignore[attr-defined]
        return int(n)


class Signature:
    """One input signature: its calls (exact), the items each call carries, and cold calls still due."""

    __slots__ = ("calls", "count", "dtypes", "evicted_ns", "items", "spec", "variants", "warm_left", "work")

    def __init__(self, items: int | None, warm_left: int, dtypes: frozenset[Any] = frozenset(),
                 work: int | None = None, spec: Any = None) -> None:
        self.calls = itertools.count()
        self.items = items  # per call (the batch dimension), None when unknown or counted elsewhere
        self.work = work  # per call (work_of): the size class of its timed calls, read without recomputing
        self.warm_left = warm_left
        self.evicted_ns = 0
        #: Dtypes seen with a shape-only key (one tensor argument: the hot path keys on its shape).
        self.dtypes = dtypes
        #: The first call's inputs, abstractly (abstract.py; None unless FLOPs are counted), and what counting
        #: them gave (flopcount.py: a Count, an Unknown, or None while not counted), written off the request thread.
        self.spec = spec
        self.count: Any = None
        #: A shape-keyed signature's other dtypes: dtype -> a Signature of the same shape in it, for its own FLOPs and
        #: bytes (``add_dtype``); None while it was seen in one dtype only, or has no spec.
        self.variants: dict[Any, Signature] | None = None

    def add_dtype(self, dtype: Any) -> None:
        """A known shape in a new dtype (a deployment switch, fp32 to bf16): from now on the timed calls in ``dtype``
        are priced by a count of their own (``variants``), and the calls in the others keep theirs, the samples taken
        before the switch included (the efficiency window reads each sample's signature's count when it is read)."""
        if self.spec is not None:
            # A new dict, not an update: the resolver and the readers look it up without a lock.
            self.variants = {**(self.variants or {}),
                             dtype: Signature(self.items, 0, self.dtypes, self.work, with_dtype(self.spec, dtype))}

    def moved(self, target: Any) -> str | None:
        """Why this shape-keyed signature seen in several dtypes cannot be counted now, or None: the model
        (``target``, a weakref) holds its floating parameters in another dtype than these calls had, so it was
        converted after them and before the count (which runs on the model as it is then) and a count would mix the
        two (fp32 inputs with bf16 weights, a call that never happened)."""
        spec = self.spec
        if len(self.dtypes) < 2 or target is None or not isinstance(spec, CallSpec) or len(spec.args) != 1:
            return None
        dtype = getattr(spec.args[0], "dtype", None)
        module = target()
        if dtype is None or not dtype.is_floating_point or not isinstance(module, torch.nn.Module):
            return None
        for p in module.parameters():
            if p.is_floating_point():
                if p.dtype == dtype:
                    return None
                return f"the model moved to {p.dtype} before its {dtype} calls were counted"
        return None


class SignatureTable:
    """Signatures seen by one model: which calls are cold, and exact item counts per signature.

    The hot path reads ``seen`` directly (its general path) and ``warm`` (its one-tensor fast path):
    a hit costs one ``next()`` on the signature's counter. Items are ``calls x items-per-call`` summed
    at scrape time, so counting them adds nothing to the request path. Evicted signatures are kept
    aside for a second before their totals are folded in, so a call racing the eviction is still counted.
    """

    def __init__(self, capacity: int, warm_calls: int, *, count_items: bool = True, specs: bool = False,
                 warm: dict[Hashable, Signature] | None = None) -> None:
        """``warm``: a dict this table keeps filled with the signatures of ``seen`` that are warm (``warm_left``
        0), emptied of them when they turn cold again or leave (``rewarm``, eviction); None: not kept. The
        caller owns it: the hot path holds it for the model's life (one dict across tables: ``reset_after_fork``),
        and a hit there needs no ``warm_left`` read (~50 ns a call on Linear(64, 64): docs/design.md)."""
        self.capacity = capacity
        #: Keep each new signature's abstract inputs (abstract.describe: a few µs, on this rare path only).
        self.specs = specs
        self.warm_calls = warm_calls
        self.count_items = count_items
        self.seen: dict[Hashable, Signature] = {}
        self.warm = warm
        if warm is not None:
            warm.clear()
        self.evicted: collections.deque[Signature] = collections.deque()
        self.retired_items = 0
        self.evictions = 0
        self.distinct = 0
        self._lock = threading.Lock()

    def observe(self, key: Hashable, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
        """Count one call of ``key`` on the slow path (new, or still warming up); True if it is cold."""
        seen = self.seen
        entry = seen.get(key)
        if entry is None:
            with self._lock:
                entry = seen.get(key)
                if entry is None:
                    self.distinct += 1
                    if len(seen) >= self.capacity:
                        try:
                            oldest = next(iter(seen))
                            old = seen.pop(oldest)
                            if self.warm is not None:
                                self.warm.pop(oldest, None)
                            old.evicted_ns = time.monotonic_ns()
                            self.evicted.append(old)
                            self.evictions += 1
                        except (StopIteration, KeyError, RuntimeError):
                            pass
                    items = batch_of(args, kwargs) if self.count_items else None
                    # A one-tensor call's dtype (its key is the shape alone, or a nested tensor's layout: the hot path
                    # checks the dtype on timed calls, ``new_dtype``).
                    one = len(args) == 1 and not kwargs and isinstance(args[0], _Tensor)
                    dtypes = frozenset((args[0].dtype,)) if one else frozenset()
                    spec = describe(args, kwargs) if self.specs else None
                    entry = seen[key] = Signature(items, self.warm_calls, dtypes, work_of(args, kwargs), spec)
        next(entry.calls)
        warm = self.warm
        if entry.warm_left > 0:
            entry.warm_left -= 1
            if not entry.warm_left and warm is not None:
                warm[key] = entry  # this call is still cold; the next ones may take the fast path
            return True
        if warm is not None:
            warm[key] = entry  # warm from the start (signature_warmup_calls=0)
        return False

    def items(self, now_ns: int | None = None) -> int:
        """Items of every call counted through signatures (live, recently evicted and retired)."""
        now = time.monotonic_ns() if now_ns is None else now_ns
        with self._lock:
            # Fold signatures evicted over a second ago: no call can still be incrementing them.
            while self.evicted and now - self.evicted[0].evicted_ns > 1_000_000_000:
                old = self.evicted.popleft()
                if old.items is not None:
                    self.retired_items += old.items * count_value(old.calls)
            entries = [*self.seen.values(), *self.evicted]
            total = self.retired_items
        for e in entries:
            if e.items is not None:
                total += e.items * count_value(e.calls)
        return total

    def rewarm(self) -> None:
        """Make the next calls of every known signature cold again (the model moved to another device:
        its first calls there pay for kernel selection and workspace allocation, like a new shape)."""
        warm = max(self.warm_calls, 1)
        with self._lock:
            if self.warm is not None:
                self.warm.clear()
            for entry in list(self.seen.values()):
                entry.warm_left = max(entry.warm_left, warm)

    def orphan(self) -> None:
        """In a forked child, before this table is replaced: mark every signature evicted, so that a memo holding one
        (the decode steps', ``Stages.last``, quiet decoding's lessons, the no-cache steps' memo: each checks
        ``evicted_ns``) lets go of it instead of counting the child's calls into the parent's copy, which nothing
        reads. No lock: a parent thread may have held it at fork()."""
        now = time.monotonic_ns() or 1
        for entry in [*self.seen.values(), *self.evicted]:
            entry.evicted_ns = now

    @property
    def churning(self) -> bool:
        """True once the table has turned over completely: shapes vary too much to call new ones cold."""
        return self.evictions >= self.capacity
