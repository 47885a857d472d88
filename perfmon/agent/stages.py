"""Prefill vs decode: which stage of a generate loop a forward call is.

A decoder's forward runs in two very different regimes: prefill (the whole prompt, compute-bound,
its cost grows with the prompt) and decode (one new token against the KV cache, memory-bound, a few
milliseconds). Reported in one series their percentiles are a bimodal mix whose shape follows the
prompt lengths of the traffic, so a model with stages gets one set of series per stage
(``stage="prefill"`` / ``stage="decode"``); cold vs steady stays orthogonal.

Hugging Face-style models are recognised without configuration: a forward that accepts
``past_key_values`` (transformers before 5.24), or ``cache`` with ``use_cache`` (5.24 renamed it), is
generative, and a call is a decode step when it is given a cache that already holds tokens
(``Cache.get_seq_length() > 0``, or a non-empty legacy tuple), or, without a cache, a ``cache_position``
of one token. Reading a cache's length is host-side bookkeeping (a tensor shape),
never a device sync. Any other model has one stage; ``wrap(stage=callable)`` labels custom loops.

A model with stages gets a ``ModelState`` and a hot path per stage (``Stages``), and a ``__call__``
that picks the call's stage first (``staged_path``); its own ``generate()``, when it has one, is
tracked as the requests its caller receives (decoding.py); inside it, the forwards of assisted generation
after the first are ``stage="verify"``, and an encoder-decoder's encoder forward is ``stage="encode"``.
"""

from __future__ import annotations

import inspect
import sys
import threading
from collections.abc import Callable, Hashable, Mapping
from time import perf_counter_ns
from typing import Any

import torch

from ..faults import InternalErrors
from .active import generating
from .hotpath import due_step, hot_path, sampled_path
from .phases import Signature, signature
from .requests import current as requests_current
from .reruns import MISS, Reruns
from .state import ModelState

_Tensor = torch.Tensor

__all__ = ["CACHE_KWARGS", "DECODE", "ENCODE", "MAX_STAGES", "PREFILL", "VERIFY", "StageFn", "Stages",
           "generative_stage", "is_generative", "kv_cache", "stage_label", "staged_path", "step_signature"]

PREFILL = "prefill"
DECODE = "decode"
#: A main-model forward of assisted/speculative generation after the first: it verifies the drafts.
VERIFY = "verify"
#: The encoder forward of an encoder-decoder model (run once per generate() call, before the decoder's).
ENCODE = "encode"
#: Distinct stage labels per model; beyond, calls are labelled "other" (labels stay bounded).
MAX_STAGES = 8

#: (args, kwargs) of a forward call -> its stage label.
StageFn = Callable[[tuple[Any, ...], Mapping[str, Any]], str]


#: The keywords a Hugging Face-style forward takes its KV cache under: ``past_key_values`` (transformers before
#: 5.24, and callers still using the deprecated name) and ``cache`` (5.24 on; its ``generate()`` passes this one).
CACHE_KWARGS = ("past_key_values", "cache")


def is_generative(module: Any) -> bool:
    """True for a module whose ``forward`` takes a KV cache (a Hugging Face-style decoder): ``past_key_values``, or
    ``cache`` together with ``use_cache`` (the pair transformers 5.24 on declares; ``cache`` alone is too common a
    name to mean a KV cache)."""
    forward = getattr(module, "forward", None)
    if forward is None:
        return False
    try:
        params = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return False
    return "past_key_values" in params or ("cache" in params and "use_cache" in params)


def kv_cache(kwargs: Mapping[str, Any]) -> Any:
    """The KV cache a forward call was given (``CACHE_KWARGS``), or None.

    Under ``cache`` only a cache object (one with ``get_seq_length``) or a legacy tuple counts: continuous batching
    passes its paged cache there, which holds no sequence length (batching.py labels those steps)."""
    cache = kwargs.get("past_key_values")
    if cache is not None:
        return cache
    cache = kwargs.get("cache")
    if cache is not None and (hasattr(cache, "get_seq_length") or isinstance(cache, (tuple, list))):
        return cache
    return None


def generative_stage(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
    """``decode`` for a step against a KV cache that already holds tokens, else ``prefill``."""
    cache = kv_cache(kwargs)
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


class Stages:
    """The stages of one model (prefill/decode, or a ``stage=`` callable's labels): a state and a hot
    path per stage, made on the (rare) first call of a new stage, at most ``MAX_STAGES``."""

    def __init__(self, stage_fn: StageFn, make_state: Callable[[str], ModelState], fn: Callable[..., Any], *,
                 first: ModelState, internal: InternalErrors) -> None:
        self.stage_fn = stage_fn
        self._make = make_state
        self._fn = fn
        self.internal = internal
        #: label -> state; every state of the model holds this same dict as ``stages``.
        self.states: dict[str, ModelState] = {}
        #: label -> that stage's hot path (read without a lock by staged_path).
        self.calls: dict[str, Callable[..., Any]] = {}
        #: label -> the same, for the decode steps of the model's own generate() (``step_signature``).
        self.steps: dict[str, Callable[..., Any]] = {}
        #: The decode stage's call target and timed path (``hotpath.sampled_path``), for the decode short path
        #: (``remember`` puts them on ``Active``).
        self.decode: tuple[Callable[..., Any], Callable[..., Any]] | None = None
        #: The last decode signature ``remember`` found, with what it was found from: (input elements, keyword count,
        #: cache type, its ``Signature``). A new ``generate()`` call whose first decode step matches takes it.
        self.last: tuple[int, int, type, Signature] | None = None
        #: The model's quiet decoding (quiet.py), when it has one: ``remember`` tells it the signatures it finds.
        self.quiet: Any = None
        #: The memo of the no-cache steps of its ``generate()`` calls (reruns.py), made with the prefill stage.
        self.reruns: Reruns | None = None
        self.hub = first.hub
        self._lock = threading.Lock()
        for st in list((first.stages or {}).values()):  # wrapped again after unwrap(): same counters
            if st is not first:
                self._register(st)
        self._first = first.stage
        self.fallback = self._register(first)

    def call_with(self, fn: Callable[..., Any]) -> None:
        """Run every stage's calls through ``fn`` from now on (``module.compile()``: the full ``nn.Module.__call__``,
        which runs the compiled call, instead of ``_call_impl``)."""
        with self._lock:
            self._fn = fn
            for st in list(self.states.values()):
                self._register(st)
            self.fallback = self.calls[self._first]

    def _register(self, st: ModelState) -> Callable[..., Any]:
        pending = next((s.capture for s in self.states.values() if s.capture is not None), None)
        if pending is not None and st.capture is None:  # a capture of the model is armed: this stage too
            st.capture = pending
            st.next_index = 0
        st.stages = self.states
        self.states[st.stage] = st
        self.steps[st.stage] = hot_path(st, self._fn, signature_of=step_signature)
        if st.stage == DECODE:
            self.decode = (self._fn, sampled_path(st, self._fn))
        elif st.stage == PREFILL:
            self.reruns = Reruns(st, self._fn, sampled_path(st, self._fn), internal=self.internal)
        call = self.calls[st.stage] = hot_path(st, self._fn)
        return call

    def remember(self, active: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """A decode step of a model's own ``generate()`` outside the short path: when its signature is warm, make the
        short path's memo (``Active.entry``) from it and say so (the step then takes it). Not with an ``items``
        callable (it sees every call) or without signature tracking (the signature's calls are how a step's items
        are counted). A request span open in the caller's context is kept on ``Active``: the call stamps it when it
        ends (``GenerateCall.end``)."""
        try:
            st = self.states.get(DECODE)
            decode = self.decode
            if st is None or decode is None or st.items_fn is not None or st.sigs is None:
                return False
            ids = kwargs.get("input_ids")
            if ids is None:
                ids = kwargs.get("decoder_input_ids")
            if type(ids) is not _Tensor:
                return False
            # The keyword this call's steps pass their cache under (CACHE_KWARGS): the short path reads that one.
            cache_key = "past_key_values" if kwargs.get("past_key_values") is not None else "cache"
            numel = ids.numel()
            keywords = len(kwargs)
            cache_type = type(kwargs.get(cache_key))
            # The call before's first decode step, when this one is like it (as many input elements and keywords, the
            # same kind of cache): its signature, without computing it again (~5 µs in situ). The same rule as from one
            # step to the next inside a call (step_signature), applied from one call to the next.
            last = self.last
            entry = None
            if last is not None and last[0] == numel and last[1] == keywords and last[2] is cache_type:
                entry = last[3]
                if entry.warm_left or entry.evicted_ns:
                    entry = None
            if entry is None:
                entry = st.sigs.get(step_signature(args, kwargs))
                if entry is None or entry.warm_left or entry.evicted_ns:
                    return False
                self.last = (numel, keywords, cache_type, entry)
            quiet = self.quiet
            key = active.key
            if quiet is not None and key is not None and key[0] == numel:  # later calls of this shape may run quiet
                quiet.learn(key, entry, active.prefill)
            active.key = None  # taught once
            active.cache_key = cache_key
            active.span = requests_current.get() if self.hub.requests else None
            active.numel = numel
            active.keywords = keywords
            active.state = st
            active.fn, active.sampled = decode
            active.entry = entry
            return True
        except Exception as exc:
            self.internal.report("stage", exc)
            return False

    def prefilled(self, active: Any, kwargs: dict[str, Any]) -> None:
        """The prefill (its keywords: ``kwargs``) of a call that may teach quiet decoding returned: when it was one
        forward of the whole prompt (``active.prefill``: the prompt's length, set by ``QuietDecode.begin``), keep on
        ``active`` for ``remember`` the prompt's length and its signature's entry, or (None, None) where the prefill
        stage's signatures are not tracked (churned): then any prompt length of the call's shape counts alike."""
        try:
            length, active.prefill = active.prefill, None
            st = self.states.get(PREFILL)
            ids = kwargs.get("input_ids")
            if st is None or type(length) is not int or type(ids) is not _Tensor or ids.dim() != 2:
                return
            if ids.shape[1] != length or not _in_sample(active.model):  # a part of the prompt (a prefill in chunks),
                return  # or a loop other than _sample (whose prefill, then a column a step, a quiet call is counted by)
            sigs = st.sigs
            if sigs is None:
                active.prefill = (None, None)
                return
            memo = active.step_key  # this prefill's signature (step_signature)
            entry = sigs.get(memo[2]) if memo is not None and memo[0] == ids.shape else None
            if entry is not None:  # (its warm-up is checked when a call would run quiet)
                active.prefill = (length, entry)
        except Exception as exc:
            self.internal.report("stage", exc)

    def state(self, label: str) -> ModelState:
        """The state of stage ``label``, made if new (a stage timed by a hot path of its own: the encoder's)."""
        with self._lock:
            st = self.states.get(label)
            if st is None:
                self._register(self._make(label))
                st = self.states[label]
        return st

    def add(self, label: Any) -> Callable[..., Any]:
        """The hot path for a stage label not seen before (validated; bounded; "other" beyond)."""
        try:
            label = stage_label(label)
        except ValueError as exc:
            self.internal.report("stage", exc)
            return self.fallback
        with self._lock:
            call = self.calls.get(label)
            if call is not None:
                return call
            if len(self.states) >= MAX_STAGES:
                label = "other"
                if label in self.calls:
                    return self.calls[label]
            return self._register(self._make(label))


def _in_sample(model: Any) -> bool:
    """Whether transformers' ``_sample`` on ``model`` is the loop running this forward (a few frames up: its prefill
    through ``_prefill``). Asked by the calls that may teach quiet decoding (until a shape is taught)."""
    frame = sys._getframe(1)
    for _ in range(8):
        frame = frame.f_back  # type: ignore[assignment]
        if frame is None:
            return False
        if frame.f_code.co_name == "_sample" and frame.f_locals.get("self") is model:
            return True
    return False


def step_signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
    """The signature of a decode step inside a model's own ``generate()``: the step before's, when this step has
    its input shape and as many keywords, else computed (``phases.signature``) and kept for the next.

    Each step of one ``generate()`` passes the same keywords (the cache object, flags, bookkeeping that the
    signature leaves out) with an input of B x 1: the signature is the same every step. Computed every step it
    cost ~1 µs in a tight loop and several µs a token inside ``generate()`` (BENCHMARKS §3b). A step whose
    input or keywords differ (another width, a keyword added) is computed again.
    """
    active = generating.get()
    if active is None:
        return signature(args, kwargs)
    ids = kwargs.get("input_ids")
    if ids is None:  # an encoder-decoder's decoder step (T5, BART): the encoder's output rides along
        ids = kwargs.get("decoder_input_ids")
    shape = ids.shape if ids is not None and type(ids) is _Tensor else None
    memo: tuple[Any, int, Hashable] | None = active.step_key
    if memo is not None and shape is not None and memo[0] == shape and memo[1] == len(kwargs):
        return memo[2]
    key = signature(args, kwargs)
    active.step_key = (shape, len(kwargs), key)
    return key


def staged_path(stages: Stages) -> Callable[..., Any]:
    """``__call__`` of a model with stages: find the call's stage, then run that stage's hot path.

    One more Python call and the stage function per call (for Hugging Face models: a kwargs lookup
    and the cache's ``get_seq_length()``), on models whose forwards take milliseconds. Inside the model's own
    ``generate()``: ``in_generate``.
    """
    pick = stages.stage_fn
    generative = pick is generative_stage  # a stage= callable of the user's is always asked
    calls = stages.calls
    steps = stages.steps
    add = stages.add
    internal = stages.internal
    current_active = generating.get
    tensor = _Tensor

    def in_generate(active: Any, self: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A forward inside this model's own ``generate()`` that ``__call__``'s short path did not take: find its stage
        (decode against the cache this call made, without asking the stage function), run that stage's hot path,
        and let the next decode steps take the short path (``Stages.remember``)."""
        if active.armed:  # lean steps before a step unlike them: counted under the signature they took
            active.flush()
        label = None
        short = learn = rerun = False
        try:
            if generative and active.prefilled and kv_cache(kwargs) is not None:
                # A step after the first, against the cache this generate() made: that cache holds the prompt, so
                # pick() would say decode too (its get_seq_length() costs ~0.5 µs a token).
                label = DECODE
                # Its signature already warm: make the short path's memo from this step and take it now (the first
                # decode step of a call; one signature and one lookup, ~25 µs in situ through the hot path instead).
                short = not active.verify and not active.timed and stages.remember(active, args, kwargs)
                call = steps.get(DECODE) or add(DECODE)  # its signature: the step before's (step_signature)
            else:
                # The first forward of a transformers generate() given no cache: a prefill (its fresh cache is empty).
                first = active.first if generative and not active.prefilled else None
                label = first if first is not None else pick(args, kwargs)
                # A forward given no cache reruns the whole sequence (use_cache=False: every step, the prompt's first):
                # a prefill whose signature the model's memo keeps for the later steps of this length (reruns.py). Only
                # in transformers' own loop (Active.batch, as for lean steps): its steps' keywords follow their input.
                rerun = (generative and label == PREFILL and active.batch > 0 and not active.verify
                         and not active.timed and (active.prefilled or kwargs.get("use_cache") is False))
                active.prefilled = True
                call = calls.get(label) or add(label)
                if rerun and not active.rerun:
                    active.rerun = True
                    active.span = requests_current.get() if stages.hub.requests else None  # stamped at the call's end
                # A call that may teach quiet decoding its shape (quiet.py): its prefill's signature is kept on its
                # Active (step_signature), to be looked up once it returns.
                learn = type(active.prefill) is int and label == PREFILL
                if rerun or learn:
                    call = steps.get(label, call)  # step_signature: this forward's signature kept on active.step_key
        except Exception as exc:  # the stage function failed: count it, time the call under the fallback
            internal.report("stage", exc)
            call = stages.fallback
        if short:
            return __call__(self, *args, **kwargs)  # the memo matches this step: __call__ takes the short path
        if active.verify and label == DECODE:  # assisted/speculative: a step against the cache verifies drafts
            label = VERIFY
            call = calls.get(VERIFY) or add(VERIFY)
        if active.timed:  # a timed request: every step of it is timed (CUDA events on GPU: device time per step)
            st = stages.states.get(label)  # type: ignore[arg-type]
            if st is not None:
                st.next_index = 0
        out = call(self, *args, **kwargs)
        stamps = active.stamps
        if stamps is not None:
            stamps.append(perf_counter_ns())  # a custom generate loop: each forward is a token of each row
        if learn:
            stages.prefilled(active, kwargs)
        if rerun:
            reruns = stages.reruns
            if reruns is not None:
                try:
                    reruns.keep(active.step_key, args, kwargs)
                except Exception as exc:
                    internal.report("stage", exc)
        return out

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        active = current_active()
        if active is not None and active.model is self:  # inside this model's own generate()
            # The lean step: after a checked step of the short path (below), up to Active.batch steps (never past the
            # decode stage's next sampling index) call the forward and leave their counting to Active.flush, which
            # the next checked step and the call's end run: a step touches Active and its keywords only (~1.5 µs a
            # token less in situ: BENCHMARKS §3b). Transformers' own loops keep one step's inputs for every decode
            # step of a call; the checked step re-reads them.
            left = active.left
            if left and len(kwargs) == active.keywords:
                active.left = left - 1
                try:
                    return active.fn(self, *args, **kwargs)
                except BaseException as exc:
                    active.state.error(exc)
                    raise
            # The short path of a decode step like the one before (Active.entry: a step with as many input elements
            # and keywords and a cache, the step before's signature still warm in the table): count the call and its
            # signature's calls, and call the forward. No stage function, no signature, no second keyword hop: ~0.5
            # µs a step in a tight loop against ~1.6 through in_generate. The call in 1/sample_rate (and every call
            # while a capture is armed) is timed as the hot path would (hotpath.due_step). A timed request
            # (Active.timed), assisted decoding and a step whose inputs differ go through in_generate.
            entry = active.entry
            if entry is not None:
                ids = kwargs.get("input_ids")
                if ids is None:  # an encoder-decoder's decoder step (T5, BART)
                    ids = kwargs.get("decoder_input_ids")
                # The element count, not the shape: an int compare, no torch.Size made and compared (~0.3 µs a step
                # in generate()); within one call a step of another batch or width has another count.
                if (type(ids) is tensor and len(kwargs) == active.keywords and ids.numel() == active.numel
                        and not entry.warm_left and not entry.evicted_ns and kwargs.get(active.cache_key) is not None):
                    st = active.state
                    if active.armed:
                        active.flush()
                    n = next(st.calls)
                    next(entry.calls)
                    if n >= st.next_index:
                        out = due_step(st, active.fn, active.sampled, n, entry, self, args, kwargs)
                    else:
                        if active.batch:
                            active.arm(n)
                        try:
                            out = active.fn(self, *args, **kwargs)
                        except BaseException as exc:
                            st.error(exc)
                            raise
                    stamps = active.stamps
                    if stamps is not None:  # a custom generate loop: each forward is a token of each row
                        stamps.append(perf_counter_ns())
                    return out
            elif active.rerun:  # a no-cache step: a prefill of a length the memo may hold (reruns.py)
                reruns = stages.reruns
                if reruns is not None:
                    out = reruns.step(self, args, kwargs, active.stamps)
                    if out is not MISS:
                        return out
            return in_generate(active, self, args, kwargs)
        try:
            label = pick(args, kwargs)
            call = calls.get(label) or add(label)
        except Exception as exc:  # the stage function failed: count it, time the call under the fallback
            internal.report("stage", exc)
            call = stages.fallback
        return call(self, *args, **kwargs)

    return __call__
