"""Quiet decoding: an untimed ``generate()`` call whose decode steps run with no perfmon code at all.

Most ``generate()`` calls time nothing (``LateCall``): their decode steps only need counting. Counted in Python one
step at a time, the least any design does (read a context variable, advance a counter) cost ~0.5-1.2 µs a step in
situ and perfmon's lean step ~1.7-2 (BENCHMARKS §3b): over the ≤ 2 µs a token #23 allows once a request's own part
is paid. So a quiet call's decode steps are counted once, when it ends, from what it returned: transformers' ``_sample``
appends one column to the sequences a step.

How the steps run without perfmon: the call runs on a *view* of the model, a second object of the model's own
(monitored) class whose ``__dict__`` is a shallow copy of the model's (the same parameters, submodules, buffers, hooks
and attributes) with one entry more, ``__call__``: ``nn.Module._call_impl`` bound to the view. ``_sample`` reads
``self.__call__`` once, before the prefill, as what its decode steps call (``model_forward``), and an attribute read
finds an instance's own entry before a method of its class: on the view, every decode step is the model's bare call
(one frame fewer than ``nn.Module.__call__``). ``self(...)`` goes by the class, so the prefill (``_prefill`` calls
``self``) takes perfmon's path as before: its stage, signature (the last prefill's on the same view when its input has
the same shape and as many keywords: ``stages.step_signature``), cold calls and sampling; then ``in_generate`` keeps the
cache the steps grow (``Quiet.cache``), for a call that fails. Beam search calls ``self`` for its steps: it is not
quiet, and a loop that would call ``self`` anyway has them counted on perfmon's path (the first such step ends the
call's quiet, ``Active.quiet``; its view is not kept for later calls). The view has
the model's class, so the interpreter's attribute caches, specialised by class, stay warm; what a call sets on
``self`` lands on the view (transformers' loops set nothing there on the dynamic-cache path).

A call is quiet (``QuietDecode.begin``) when: it times nothing and is not assisted (``LateCall``); the model is
decoder-only, not compiled, with transformers' ``_sample`` and ``_prefill`` (5.x) and a ``DynamicCache`` by default; the
caller passes no cache, asks for no cache implementation or beam search and runs in no process group (``synced_gpus``
runs steps that append nothing); the decode stage is past its warm-up, with no capture armed and no sampling floor due
(``next_index`` 0); and an earlier call with the same rows and keywords found its decode steps' signature warm
(``Stages.remember`` teaches it here), so the quiet steps are counted under it, items included. Anything else takes the
lean path (stages.py).

What a quiet call gives up: its decode steps are never timed, and a read while it runs sees none of them (a lean call
lags by at most ``LEAN_STEPS``; its tokens were always counted at its end). The decode stage's timed steps are those of
the calls that time every step (one in 1/sample_rate, ``CallSampler``): the stage's sampling rate still; a regular
sampling index a quiet call passes is drawn again after it.

A step that raises: the exception's traceback says whether a forward on the view raised it (a frame of
``nn.Module._call_impl``; counted under the model's errors) and, through ``_sample``'s frame, how long the running
sequence was (its ``input_ids``: the prompt, then a column a step that returned), so every forward that ran is counted,
the raising one included, wherever in the step it raised. On MPS, where transformers defers its stop check and runs
one step more than it keeps, and for a failure outside ``_sample``, the cache's length counts instead.
"""

from __future__ import annotations

from collections.abc import Hashable
from types import MethodType
from typing import Any

import torch

from ..faults import InternalErrors
from .active import LEAN_STEPS, Active
from .gen_events import advance
from .phases import Signature
from .requests import current as requests_current
from .stages import DECODE, Stages

__all__ = ["Quiet", "QuietDecode"]

_Tensor = torch.Tensor
_CALL_IMPL = torch.nn.Module._call_impl
_CALL_IMPL_CODE = _CALL_IMPL.__code__
_set = object.__setattr__
#: Keyed shapes of calls kept per model (rows, positional count, keyword names); cleared when full.
MEMO_SIZE = 64
#: Views kept per model for later calls: as many as its calls that run at once, up to this.
VIEWS = 16


class Quiet:
    """One quiet call's decode steps (``Active.quiet``): what counting them at its end needs."""

    __slots__ = ("active", "cache", "call", "entry", "exact", "own", "owner", "prefilled", "seq0", "state", "steps",
                 "view")

    def __init__(self, owner: QuietDecode, view: Any, own: dict[str, Any], call: Any, active: Active, state: Any,
                 entry: Signature, seq0: int, exact: bool) -> None:
        self.owner = owner
        self.view = view
        self.own = own  # the view's __dict__, and its __call__ entry (``QuietDecode.views``)
        self.call = call
        self.active = active  # the call's Active, kept with the view for the next call on it
        self.state = state  # the decode stage's ModelState
        self.entry = entry  # the decode steps' signature
        self.seq0 = seq0  # the prompt's length: the running sequence's at the prefill, and the cache's after it
        #: The returned sequences have one column a step: not on MPS, where transformers defers its stop check and
        #: runs one step more than it keeps (``DeferredStopCheck``): the cache says how many ran there.
        self.exact = exact
        #: The prefill's forward returned (stages.in_generate sets this and ``cache``, the KV cache the decode steps
        #: grow, or None: read only for a call on MPS or one that raised outside ``_sample``, dropped at the end).
        self.prefilled = False
        self.cache: Any = None
        self.steps = -1  # decode steps ran (-1: read from the returned sequences, ``count``)

    def ended(self, error: BaseException | None) -> None:
        """The request thread's part of the call's end: let the cache go (it must not outlive the call for want of a
        read); for a call that raised, how many decode steps ran and whether one raised (counted now: its traceback
        holds the call's tensors, which must not wait for a reader either). A call that returned is counted from its
        sequences by ``count``, off this thread."""
        cache, self.cache = self.cache, None
        if not self.prefilled:  # the prefill raised (its own path counted it) or never ran
            self.steps = 0
            self.release()
            return
        if error is None:
            if not self.exact and cache is not None:  # MPS: a step more ran than the sequences show
                self.steps = max(0, int(cache.get_seq_length()) - self.seq0)
            self.release()  # (a returned call on CPU and CUDA: LateCall.end, which inlines the rest of this)
            return
        raised, running = _where(error, self.view)
        if raised:
            self.state.error(error)
        if running is not None:  # the loop's sequence: one column a step that returned, then the step that raised
            self.steps = max(0, running - self.seq0)
            return
        # Not raised inside _sample's loop: the cache, where a step that raised before the first layer left no trace.
        grown = max(0, int(cache.get_seq_length()) - self.seq0) if cache is not None else 0
        layers = getattr(cache, "layers", None)
        partial = bool(layers) and int(layers[-1].get_seq_length()) - self.seq0 < grown  # type: ignore[index]
        self.steps = grown + 1 if raised and not partial else grown

    def release(self) -> None:
        """Give the view back for a later call, with its Active (its generate() returned: nothing runs on it any more,
        and the call's settling reads neither: ``LateCall``). A call that raised keeps its view: the caller's traceback
        holds it."""
        views = self.owner.views
        if len(views) < VIEWS:
            views.append((self.view, self.own, self.call, self.active))

    def count(self, out: Any) -> None:
        """Add the decode steps to the decode stage's and their signature's calls (items included: a signature's calls
        times its rows); ``out``: the sequences the call returned (None if it raised). A reader runs this (the call's
        settling, handed over: ``LateCall``) before it reads a model's counters (``Models.states``). A regular sampling
        index the steps passed is drawn again."""
        n = self.steps
        if n < 0:
            # _sample appends one column to the sequences a step: the prefill's, then one a decode step.
            n = max(0, int(out.shape[-1]) - self.seq0 - 1) if type(out) is _Tensor else 0
        if n <= 0:
            return
        st = self.state
        advance(self.entry.calls, n - 1, st.calls)  # both counters n - 1 steps in one C call, ...
        next(self.entry.calls)
        last = next(st.calls)  # ... then the last step's, to read the index it reached
        due = st.next_index
        if due and last >= due and st.capture is None:
            st.next_index = st.sampler.next_index(last)


def _where(exc: BaseException, view: Any) -> tuple[bool, int | None]:
    """Where ``exc`` came from: whether a forward of ``view`` raised it (a frame of ``nn.Module._call_impl`` on the
    view), and the length of the running sequence in transformers' ``_sample`` when the traceback passes through that
    loop (its ``input_ids``: the prompt, then one column a decode step that returned), else None."""
    raised = False
    running = None
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        code = frame.f_code
        if code is _CALL_IMPL_CODE and frame.f_locals.get("self") is view:
            raised = True
            break
        if code.co_name == "_sample":
            ids = frame.f_locals.get("input_ids")
            if type(ids) is _Tensor and ids.dim() == 2:
                running = int(ids.shape[-1])
        tb = tb.tb_next
    return raised, running


class QuietDecode:
    """Per model with stages and transformers' own ``generate()``: which untimed calls run quiet, on a view."""

    def __init__(self, stages: Stages, internal: InternalErrors) -> None:
        self.stages = stages
        self.internal = internal
        #: Views calls have returned, with their dict, bound call and Active, for the next calls (a view's type and dict
        #: stay the same from call to call, and the interpreter's caches with them). At most ``VIEWS`` are kept.
        self.views: list[tuple[Any, dict[str, Any], Any, Active]] = []
        #: (rows, positional count, keyword names) -> the decode steps' signature (``Stages.remember``).
        self.memo: dict[Hashable, Signature] = {}

    @staticmethod
    def supports(model: Any, *, encoder_decoder: bool) -> bool:
        """Whether calls of ``model``'s ``generate()`` can run quiet: a decoder-only model with transformers' own loop
        (``_sample``, whose ``model_forward`` is read before its ``_prefill``) and a ``DynamicCache`` by default, not
        sharded for generation across processes (``_synced``)."""
        base = type(model)
        loop, prefill = getattr(base, "_sample", None), getattr(base, "_prefill", None)
        return (not encoder_decoder and callable(loop) and callable(prefill)
                and str(getattr(loop, "__module__", "")).startswith("transformers.")
                and _default_dynamic(base) and not _synced(model))

    def begin(self, model: Any, args: tuple[Any, ...], kwargs: dict[str, Any], options: list[Any]) -> Active:
        """An untimed call opens: its ``Active``, keyed by the call's shape (``Active.key``, for ``Stages.remember`` to
        teach) and, when it can run quiet, on a view: ``Active.model`` (what ``generate()`` runs on and its forwards are
        checked against) and ``Active.quiet``. One frame for all: between two model calls every function entered and
        object made costs ~1 µs in situ, so a view comes back with its Active (``Quiet.release``).

        The key is the call's decode rows (input rows x returned sequences), its positional count and its
        keyword names (which decide the decode steps' keywords); ``options``: its ``num_beams``,
        ``num_return_sequences`` and ``cache_implementation`` (``decoding.untimed_options``)."""
        beams, k, implementation = options
        if (len(args) > 1 or implementation is not None or (beams or 1) > 1  # beam search calls self() a step
                or kwargs.get("past_key_values") is not None
                or kwargs.get("cache") is not None or kwargs.get("synced_gpus")
                or model.__dict__.get("_compiled_call_impl") is not None):
            return Active(model, False, False, batch=LEAN_STEPS, kwargs=kwargs)
        ids = kwargs.get("input_ids")
        if ids is None:
            ids = kwargs.get("inputs", args[0] if args else None)
        shape = ids.shape if type(ids) is _Tensor else ()  # one read: each of a tensor's getters costs ~1 µs in situ
        if len(shape) != 2:
            return Active(model, False, False, batch=LEAN_STEPS, kwargs=kwargs)
        key = (shape[0] * (k or 1), len(args), tuple(kwargs))
        entry = self.memo.get(key)
        st = self.stages.states.get(DECODE)
        if (entry is None or entry.warm_left or entry.evicted_ns
                or st is None or not st.next_index or st.capture is not None or st.sigs is None):
            active = Active(model, False, False, batch=LEAN_STEPS, kwargs=kwargs)
            active.key = key
            return active
        seq0, exact = shape[1], not ids.is_mps  # type: ignore[union-attr]  # a tensor: it has a shape
        theirs = model.__dict__
        try:
            view, own, call, active = self.views.pop()  # a view a call before left: its dict refreshed in place
            own.update(theirs)
            if len(own) != len(theirs) + 1:  # an attribute the model no longer has (or a __call__ of its own)
                raise IndexError
            own["__call__"] = call
            active.prefilled = False  # what its last call's prefill set (it ran quiet to its end: nothing else)
        except IndexError:
            cls: Any = type(model)
            view = cls.__new__(cls)
            own = dict(theirs)
            call = own["__call__"] = MethodType(_CALL_IMPL, view)  # what self.__call__ reads on the view: bare
            _set(view, "__dict__", own)
            active = Active(view, False, False, batch=LEAN_STEPS, kwargs=kwargs)
        active.key = key
        active.quiet = Quiet(self, view, own, call, active, st, entry, seq0, exact)
        # A request span open in the caller's context: the call's end stamps it (Active.returned), as a lean call's.
        active.span = requests_current.get() if self.stages.hub.requests else None
        return active

    def learn(self, key: Hashable, entry: Signature) -> None:
        """A call of shape ``key`` found its decode steps' signature warm (``Stages.remember``): later calls of that
        shape may run quiet and be counted under it."""
        memo = self.memo
        if len(memo) >= MEMO_SIZE and key not in memo:
            memo.clear()
        memo[key] = entry


def _synced(model: Any) -> bool:
    """Whether transformers' ``generate()`` runs ``model`` with ``synced_gpus`` by default: DeepSpeed ZeRO-3 or FSDP
    (a finished process keeps running forwards in step with the others, which append no column). Read when the model
    is wrapped, as those are set when it is loaded; a caller's own ``synced_gpus=True`` is read a call."""
    try:
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
        from transformers.integrations.fsdp import is_fsdp_managed_module

        return bool(is_deepspeed_zero3_enabled() or is_fsdp_managed_module(model))  # type: ignore[no-untyped-call]
    except Exception:  # a transformers without them: a process group is the sign
        dist = torch.distributed
        return bool(dist.is_available() and dist.is_initialized())


def _default_dynamic(base: type) -> bool:
    """Whether ``generate()`` gives ``base`` a ``DynamicCache`` when the caller asks for none."""
    supports = getattr(base, "_supports_default_dynamic_cache", None)
    try:
        return bool(supports()) if callable(supports) else False
    except Exception:
        return False
