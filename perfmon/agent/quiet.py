"""Quiet decoding: an untimed ``generate()`` call whose forwards run with no perfmon code at all.

Most ``generate()`` calls time nothing (``LateCall``): their forwards only need counting. Counted in Python one forward
at a time, the least any design does (read a context variable, advance a counter) cost ~0.5-1.2 µs a step in situ and
perfmon's lean step ~1.7-2 (BENCHMARKS §3b), and a prefill through perfmon's path (its stage, its signature, three
frames that repack its keywords) ~4 µs more: over the ≤ 2 µs a token #23 allows once a request's own part is paid. So
a quiet call's forwards, its prefill and its decode steps, are counted once, when it ends, from what it returned:
transformers' ``_sample`` runs one prefill, then appends one column to the sequences a step.

How the forwards run without perfmon: the call runs on a *view* of the model, an object of a subclass of the model's
monitored class (``QuietDecode.view_class``, made once a model) whose ``__call__`` is ``nn.Module._call_impl`` itself,
and whose ``__dict__`` *is* the model's (the same dict object: its parameters, submodules, buffers, hooks and
attributes, and whatever a call sets on ``self``, exactly as on the model). ``self(...)`` (the prefill) and
``self.__call__`` (what ``_sample``'s decode steps call) both find the bare call: one frame fewer than
``nn.Module.__call__``. Views are kept for later calls (``QuietDecode.views``), so the interpreter's attribute caches,
specialised by class, stay warm on the view's class, which most calls run on.

A call is quiet (``QuietDecode.begin``) when: it times nothing and is not assisted (``LateCall``); the model is
decoder-only, not compiled, with transformers' ``_sample`` and ``_prefill`` (5.x) and a ``DynamicCache`` by default;
the caller passes no cache, asks for no cache implementation, beam search or ``use_cache=False``, runs in no process
group (``synced_gpus`` runs steps that append nothing), on no MPS tensor (transformers runs a step more than it keeps
there) and in no request span (a span's model part starts at the call's first forward: ``requests.py``); the prefill
and decode stages are past their warm-up, with no capture armed and no sampling floor due (``next_index`` 0); and an
earlier call of the same rows, keywords and prompt length, run by ``_sample``, found its prefill's and its decode
steps' signatures warm (``Stages.remember`` teaches them here), so the quiet forwards are counted under them, items
included. With the prefill stage's signatures churned (not tracked), its calls are counted with their rows as items,
and one call of a shape teaches every prompt length of it. A call whose prefill may run in chunks
(``prefill_chunk_size``: several forwards) teaches nothing. Anything else takes the lean path (stages.py).

What a quiet call gives up: its forwards are never timed, and a read while it runs sees none of them (a lean call
lags by at most ``LEAN_STEPS``; its tokens were always counted at its end). A stage's timed calls are those of the calls
that time every step (one in 1/sample_rate, ``CallSampler``): the stage's sampling rate still; a regular sampling index
a quiet call passes is drawn again after it.

A call that raises: the exception's traceback says whether a forward on the view raised it (a frame of
``nn.Module._call_impl``; counted under its stage's errors: the prefill's when it raised inside ``_prefill``) and,
through ``_sample``'s frame, how long the running sequence was (its ``input_ids``: the prompt, then a column a step that
returned), so every forward that ran is counted, the raising one included, wherever in the step it raised. For a
failure outside ``_sample`` (after it returned), the cache ``generate()`` made (its ``model_kwargs``) says how many ran.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

from ..faults import InternalErrors
from .active import LEAN_STEPS, Active
from .gen_events import advance
from .options import chunked_prefill
from .phases import Signature
from .requests import current as requests_current
from .stages import DECODE, PREFILL, Stages, kv_cache

__all__ = ["VIEWS", "Quiet", "QuietDecode"]

_Tensor = torch.Tensor
_CALL_IMPL = torch.nn.Module._call_impl
_CALL_IMPL_CODE = _CALL_IMPL.__code__
_set = object.__setattr__
#: Whether this torch can hold MPS tensors at all: where it cannot (every Linux and Windows build), a prompt's place is
#: not read a call (a tensor's getter costs ~1 µs in situ, between two model calls).
_MPS = bool(torch.backends.mps.is_built())
#: torch's process-wide forward hooks (``register_module_forward_hook`` and its pre-hook twin): dicts torch fills in
#: place, so read at each call (an empty one where a torch has none).
_GLOBAL_HOOKS: tuple[dict[Any, Any], ...] = tuple(
    _hooks if (_hooks := getattr(torch.nn.modules.module, _name, None)) is not None else {}
    for _name in ("_global_forward_hooks", "_global_forward_pre_hooks"))
#: Keyed shapes of calls kept per model (rows, positional count, keyword names, the prompt's length); cleared when
#: full.
MEMO_SIZE = 256
#: Views kept per model for later calls: as many as its calls that run at once, up to this.
VIEWS = 16


class Quiet:
    """One quiet call (``Active.quiet``): what counting its forwards at its end needs."""

    __slots__ = ("active", "entry", "owner", "prefill", "prefills", "rows", "seq0", "state", "steps", "view")

    def __init__(self, owner: QuietDecode, view: Any, active: Active, state: Any, entry: Signature | None,
                 prefill: tuple[Any, Signature | None], rows: int, seq0: int) -> None:
        self.owner = owner
        self.view = view
        self.active = active  # the call's Active, kept with the view for the next call on it
        self.state = state  # the decode stage's ModelState (None: none yet, for a call of one token)
        self.entry = entry  # the decode steps' signature (None: a call of one token)
        self.prefill = prefill  # the prefill stage's ModelState and its signature (None: that stage's churned)
        self.rows = rows  # the prompt's rows: a prefill's items
        self.seq0 = seq0  # the prompt's length: the running sequence's at the prefill, and the cache's after it
        self.prefills = 1  # prefill forwards that ran (0: the call raised before its prefill's forward; ``ended``)
        self.steps = -1  # decode steps ran (-1: read from the returned sequences, ``count``)

    def ended(self, error: BaseException | None) -> None:
        """The request thread's part of the end of a call that did not return a tensor: one that returned an output
        object is counted from its sequences by ``count``; for one that raised, how many forwards ran and whether one
        raised, read now (its traceback holds the call's tensors, which must not wait for a reader)."""
        if error is None:
            self.release()
            return
        raised, in_prefill, running, cache = _where(error, self.view)
        if raised:
            (self.prefill[0] if in_prefill or self.state is None else self.state).error(error)
        if running is not None:  # the loop's sequence: one column a step that returned, then the step that raised
            # Inside _prefill, its forward ran only if it raised (a failure before it, preparing its inputs, did not).
            self.prefills = int(raised) if in_prefill else 1
            self.steps = max(0, running - self.seq0)
            return
        # Not raised inside _sample: before it (nothing ran), or after it returned (the cache holds every step's).
        grown = int(cache.get_seq_length()) - self.seq0 if cache is not None else -1
        self.prefills = int(grown >= 0)
        self.steps = max(0, grown)

    def release(self) -> None:
        """Give the view back for a later call, with its Active (its generate() returned: nothing runs on it any more,
        and the call's settling reads neither: ``LateCall``). A call that raised keeps its view: the caller's traceback
        holds it."""
        views = self.owner.views
        if len(views) < VIEWS:
            views.append((self.view, self.active))

    def count(self, out: Any) -> None:
        """Add the call's forwards to their stages' and signatures' calls (items included: a signature's calls times
        its rows); ``out``: the sequences the call returned (None if it raised). A reader runs this (the call's
        settling, handed over: ``LateCall``) before it reads a model's counters (``Models.states``). A regular sampling
        index the forwards passed is drawn again."""
        if self.prefills:
            st, entry = self.prefill
            if entry is not None:
                next(entry.calls)
            elif st.item_counts.q is not None:  # its signatures churned: items are counted a call (hotpath)
                st.item_counts.q.append(self.rows)
            _passed(st, next(st.calls))
        n = self.steps
        if n < 0:
            # _sample appends one column to the sequences a step: the prefill's, then one a decode step.
            n = max(0, int(out.shape[-1]) - self.seq0 - 1) if type(out) is _Tensor else 0
        if n <= 0 or self.entry is None:  # (None: a call of one token, max_new_tokens=1, runs no decode step)
            return
        advance(self.entry.calls, n - 1, self.state.calls)  # both counters n - 1 steps in one C call, ...
        next(self.entry.calls)
        _passed(self.state, next(self.state.calls))  # ... then the last step's, to read the index it reached


def _passed(st: Any, last: int) -> None:
    """Counted forwards of ``st`` reached call ``last``: draw the next sampling index if they passed it."""
    due = st.next_index
    if due and last >= due and st.capture is None:
        st.next_index = st.sampler.next_index(last)


def _where(exc: BaseException, view: Any) -> tuple[bool, bool, int | None, Any]:
    """Where ``exc`` came from: whether a forward of ``view`` raised it (a frame of ``nn.Module._call_impl`` on the
    view), whether it came through transformers' ``_prefill``, the length of the running sequence in its ``_sample``
    when the traceback passes through that loop (its ``input_ids``: the prompt, then one column a decode step that
    returned), else None; and the cache ``generate()`` made (from its ``model_kwargs``), else None."""
    raised = in_prefill = False
    running = cache = None
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        code = frame.f_code
        if code is _CALL_IMPL_CODE and frame.f_locals.get("self") is view:
            raised = True
            break
        name = code.co_name
        if name == "_sample":
            ids = frame.f_locals.get("input_ids")
            if type(ids) is _Tensor and ids.dim() == 2:
                running = int(ids.shape[-1])
        elif name == "_prefill":
            in_prefill = True
        elif name == "generate" and cache is None:
            kw = frame.f_locals.get("model_kwargs")
            if isinstance(kw, dict):
                cache = kv_cache(kw)
        tb = tb.tb_next
    return raised, in_prefill, running, cache


class QuietDecode:
    """Per model with stages and transformers' own ``generate()``: which untimed calls run quiet, on a view."""

    def __init__(self, stages: Stages, internal: InternalErrors) -> None:
        self.stages = stages
        self.internal = internal
        #: Views calls have returned, with their Active, for the next calls. At most ``VIEWS`` are kept.
        self.views: list[tuple[Any, Active]] = []
        #: (rows, positional count, keyword names, prompt length or None) -> the decode steps' signature and the
        #: prefill's (None where the prefill stage's signatures are not tracked: then so is the length), taught by
        #: ``Stages.remember``.
        self.memo: dict[Hashable, tuple[Signature | None, Signature | None]] = {}
        #: The monitored class the views' class was made for, and that class (``view_class``).
        self.base: type | None = None
        self.view_cls: type | None = None

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

    def view_class(self, base: type) -> type:
        """The views' class for a model of monitored class ``base``: a subclass whose ``__call__`` is the bare
        ``nn.Module._call_impl`` (its name and module are the model's: what a traceback or a repr shows)."""
        if self.base is not base or self.view_cls is None:
            self.view_cls = type(base.__name__, (base,), {
                "__slots__": (), "__module__": base.__module__, "__qualname__": base.__qualname__,
                "__call__": _CALL_IMPL})
            self.base = base
        return self.view_cls

    def begin(self, model: Any, args: tuple[Any, ...], kwargs: dict[str, Any], options: list[Any]) -> Active:
        """An untimed call opens: its ``Active``, keyed by the call's shape (``Active.key``, for ``Stages.remember`` to
        teach) and, when it can run quiet, on a view: ``Active.model`` (what ``generate()`` runs on) and
        ``Active.quiet``. One frame for all: between two model calls every function entered and object made costs ~1 µs
        in situ, so a view comes back with its Active (``Quiet.release``).

        The key is the call's decode rows (input rows x returned sequences), its positional count and its
        keyword names (which decide the decode steps' keywords); ``options``: its ``num_beams``,
        ``num_return_sequences``, ``cache_implementation`` and ``use_cache`` (``options.untimed_options``). A call
        without a cache (``use_cache=False``) reruns the sequence each step, none a decode step: never quiet (a server
        passing ``use_cache=`` through gives both kinds of call one key)."""
        beams, k, implementation, use_cache = options
        theirs = model.__dict__
        # A forward hook on the model (its own or torch's global ones) is given the module called: on a view, a second
        # object, and a hook that keys on the module or compares it with the model would miss. So such calls run on
        # the model itself, untimed all the same.
        if (len(args) > 1 or implementation is not None or (beams or 1) > 1  # beam search calls self() a step
                or use_cache is False
                or kwargs.get("past_key_values") is not None
                or kwargs.get("cache") is not None or kwargs.get("synced_gpus")
                or theirs.get("_compiled_call_impl") is not None
                or theirs.get("_forward_hooks") or theirs.get("_forward_pre_hooks")
                or _GLOBAL_HOOKS[0] or _GLOBAL_HOOKS[1]):
            return Active(model, False, False, batch=LEAN_STEPS, kwargs=kwargs)
        ids = kwargs.get("input_ids")
        if ids is None:
            ids = kwargs.get("inputs", args[0] if args else None)
        shape = ids.shape if type(ids) is _Tensor else ()  # one read: each of a tensor's getters costs ~1 µs in situ
        if len(shape) != 2:
            return Active(model, False, False, batch=LEAN_STEPS, kwargs=kwargs)
        states = self.stages.states
        st = states.get(DECODE)
        pst = states.get(PREFILL)
        stages = self.stages
        # The key: the decode steps' rows, positional count and keyword names, and the prompt's length where the
        # prefill stage's signatures are tracked (its signature goes with it); churned, any length of the shape counts
        # alike (its rows as items, Quiet.count). One lookup gives both signatures.
        tracked = pst is not None and pst.sigs is not None
        key = (shape[0] * (k or 1), len(args), tuple(kwargs), shape[1] if tracked else None)
        taught = self.memo.get(key)
        entry, pentry = taught if taught is not None else (None, None)
        if entry is None:  # taught by calls of one token (no decode step): quiet only for another (max_new_tokens=1)
            decoding = taught is None or kwargs.get("max_new_tokens") != 1
        else:
            decoding = (entry.warm_left or entry.evicted_ns or st is None or not st.next_index
                        or st.capture is not None or st.sigs is None)
        if (decoding
                or pst is None or not pst.next_index or pst.capture is not None
                or (tracked and (pentry is None or pentry.warm_left or pentry.evicted_ns))
                or (stages.hub.requests and requests_current.get() is not None)
                or (_MPS and ids.is_mps)):  # type: ignore[union-attr]
            active = Active(model, False, False, batch=LEAN_STEPS, kwargs=kwargs)
            active.key = key
            # What it may teach of its prefill (Stages.prefilled): one forward of the whole prompt, when nothing (or a
            # call of one token, or a signature since evicted from its table) taught this shape. A prefill in chunks
            # (prefill_chunk_size) runs several, whose number depends on the prompt's length: never taught.
            if ((entry is None or entry.evicted_ns or (pentry is not None and pentry.evicted_ns))
                    and not chunked_prefill(model, args, kwargs)):
                active.prefill = shape[1]
            return active
        if not tracked:
            pentry = None
        try:
            view, active = self.views.pop()  # a view a call before left: the model's dict, unless it has another now
            if view.__dict__ is not theirs:
                raise IndexError
        except IndexError:
            cls: Any = self.view_class(type(model))
            view = cls.__new__(cls)
            _set(view, "__dict__", theirs)
            active = Active(view, False, False, batch=LEAN_STEPS, kwargs=kwargs)
        active.key = key
        active.quiet = Quiet(self, view, active, st, entry, (pst, pentry), shape[0], shape[1])
        return active

    def learn(self, key: tuple[Any, ...], entry: Signature | None,
              prefill: tuple[int | None, Signature | None] | None) -> None:
        """A call of shape ``key`` run by transformers' ``_sample`` found its decode steps' signature warm
        (``Stages.remember``), or ran no decode step (``entry`` None: a call of one token, ``LateCall``): later calls
        of that shape may run quiet and be counted under them (with None, only calls of one token). ``prefill``: its
        prompt's length and its prefill's signature ((None, None): that stage's signatures churned), when its prefill
        was one forward of the whole prompt (``Stages.prefilled``); else it teaches nothing."""
        if prefill is None or prefill[0] != key[-1]:
            return
        memo = self.memo
        if entry is None and key in memo:  # what a call with decode steps taught serves calls of one token too
            return
        if len(memo) >= MEMO_SIZE and key not in memo:
            memo.clear()
        memo[key] = (entry, prefill[1])


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
