"""A monitored model's own ``generate()`` (Hugging Face's), tracked as the requests the caller receives.

Definitions (README, docs/metrics.md "Generation"):

- a **request** is one sequence the caller receives: ``B`` input rows with ``num_return_sequences=k`` are
  ``B * k`` requests (beam search and sampling alike);
- its **generated tokens** are the tokens of its sequence after the prompt, up to and including its own
  first EOS token; a row stopped by stop strings or a criterion of the caller's ends where the padding HF
  appends to finished rows begins (trailing ``pad_token_id`` when it differs from EOS);
- **prompt tokens** are the real tokens of each input row (the attention mask's ones), counted once per
  input row; the mask's zeros are padding, counted apart;
- a token's **time** is when it became available to the caller: when ``generate()`` hands the step's
  tokens to a streamer (greedy, sampling, assisted generation: the same moment with or without a
  streamer of the caller's), and for beam search (no streamer possible, beams are reordered to the end)
  when ``generate()`` returns.

How, without a device sync: a streamer of perfmon's own (``_Tap``, in front of the caller's, if any) gets
each step's tokens from ``generate()`` itself (HF copies them to the host for any streamer, at the point
where it already waits for the step: its stop check) and stamps them (``perf_counter_ns``); when the call
ends, each row's tokens are cut at its EOS and recorded as one timeline per request
(``GenerationTracker.settle``). Beam search keeps no tap: the returned sequences are read when the call
returns; on CUDA that read is handed to the resolver thread (``GenerationTracker.defer``), never done on
the request thread. So are the attention mask's sums when the mask is on the device.

With a streamer its caller iterates (``TextIteratorStreamer``), the request ends when that consumer reads
to the end (``ok``) or drops it (``cancelled``): ``streams.Consumer``. Assisted and speculative generation:
the main model's forwards after the first verify drafts (``stage="verify"``, tokens they produced in
``perfmon_generation_verify_tokens_total``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from sys import _getframe
from time import perf_counter_ns
from typing import Any, Protocol

import torch

from ..faults import InternalErrors
from .active import LEAN_STEPS, Active, generating
from .gen_events import advance
from .generation import Generation, GenerationTracker
from .options import CALL_OPTIONS, CUT_OPTIONS, config_of, options, verifies
from .streams import CANCELLED, ERROR, OK, Consumer, is_streamer, watch_consumer

_Tensor = torch.Tensor

__all__ = ["Call", "GenerateCall", "is_encoder_decoder", "tracked_generate"]

class Call(Protocol):
    """What ``tracked_generate`` needs of a call's tracking: the state its forwards read (its ``model``: what
    ``generate()`` runs on, the model or a quiet view of it, quiet.py), the keywords it runs with, and its end
    (``GenerateCall``, or ``latecall.LateCall`` for a call that times nothing). ``end``'s ``out``: what the call
    returned, or the exception it raised."""

    active: Active
    kwargs: dict[str, Any]

    def end(self, outcome: str, out: Any = None) -> None: ...


class _Tap:
    """The streamer ``generate()`` is given: stamps each step's tokens, then hands them to the caller's.

    Bounded by the call itself: ``generate()`` puts at most ``max_length`` steps.
    """

    __slots__ = ("inner", "prompt_seen", "times", "values")

    def __init__(self, inner: Any, *, keep: bool = True) -> None:
        self.inner = inner
        self.prompt_seen = False
        self.times: list[int] = []  # perf_counter_ns() of each step's put
        #: Its tokens (host tensors: HF copies them for any streamer), when the call needs them (several rows, each
        #: cut at its own EOS; assisted steps' sizes); None for one plain sequence.
        self.values: list[torch.Tensor] | None = [] if keep else None

    def put(self, value: Any) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True  # generate() puts the prompt first
            if self.inner is not None:
                self.inner.put(value)
            return
        self.times.append(perf_counter_ns())  # stamped before the caller's streamer: when it is handed out
        if self.values is not None:
            self.values.append(value)
        if self.inner is not None:
            try:
                self.inner.put(value)
            except BaseException:
                # The caller's streamer refused it (its client gone, a queue closed): not a token it received.
                self.times.pop()
                if self.values is not None:
                    self.values.pop()
                raise

    def end(self) -> None:
        if self.inner is not None:
            self.inner.end()


class GenerateCall:
    """One tracked ``generate()`` call: its requests, its tap, and how they are settled when it ends."""

    __slots__ = ("active", "beam", "consumer", "decoder_len", "encoder_decoder", "ended", "eos", "internal", "k",
                 "kwargs", "mask", "pad", "prompt_len", "requests", "rows", "start", "tap", "tracker", "verify")

    def __init__(self, model: Any, args: tuple[Any, ...], kwargs: dict[str, Any], tracker: GenerationTracker,
                 name: str, timed: bool, internal: InternalErrors, *, streamable: bool = True,
                 encoder_decoder: bool | None = None, timeline: bool = True, own: bool = False,
                 active: Active | None = None, start_ns: int | None = None) -> None:
        """``timed``: every forward of the call is timed. ``timeline``: its tokens are timed (TTFT, inter-token
        latency) through perfmon's streamer; without it (a call not sampled, with no streamer of the caller's and
        no assistant) the call's tokens are counted from what it returns, at no cost a step. ``own``: the
        ``generate()`` is transformers' own (its decode steps keep one shape: they may count in batches). ``active``
        and ``start_ns``: a call opened after it started (``LateCall``), with the state its forwards already read."""
        self.tracker = tracker
        self.internal = internal
        cfg = config_of(model, args, kwargs)
        beams, k, lookup, early_exit = options(kwargs, cfg, CALL_OPTIONS)
        self.k = max(1, int(k or 1))
        self.verify = verifies(kwargs, lookup, early_exit)
        self.beam = int(beams or 1) > 1 and not self.verify
        if encoder_decoder is None:  # known when the model was wrapped (models.py): its config's, read once
            encoder_decoder = is_encoder_decoder(model)
        self.encoder_decoder = encoder_decoder
        inputs = kwargs.get("input_ids")
        embeds = False
        if inputs is None:
            inputs = kwargs.get("inputs", args[0] if args else None)
            if inputs is None:
                inputs = kwargs.get("inputs_embeds")
                embeds = inputs is not None
        shape: Any = getattr(inputs, "shape", None) or ()
        self.rows = int(shape[0]) if len(shape) >= 2 else 1
        self.prompt_len = int(shape[1]) if len(shape) >= 2 else int(shape[0]) if len(shape) == 1 else 0
        self.mask = kwargs.get("attention_mask")
        decoder = kwargs.get("decoder_input_ids")
        self.decoder_len = 1
        if decoder is not None and isinstance(decoder, torch.Tensor) and decoder.dim():
            self.decoder_len = int(decoder.shape[-1])
        # Where the generated tokens start in the sequences generate() returns: after the decoder's start tokens
        # (encoder-decoder), after the prompt, or at 0 when a decoder-only prompt came as embeddings only.
        self.start = self.decoder_len if encoder_decoder else 0 if embeds else self.prompt_len
        if active is None:
            active = Active(model, timed, self.verify, batch=LEAN_STEPS if own and streamable else 0,
                            kwargs=kwargs if own else None)
            if not streamable:
                active.stamps = []
        self.active = active
        streamer = kwargs.get("streamer")
        self.tap: _Tap | None = None
        self.consumer: Consumer | None = None
        self.requests: list[Generation] = []
        rows = self.rows * self.k
        if streamer is not None and rows == 1 and is_streamer(streamer):
            # Tie the request to the streamer its caller iterates (or join the one a Monitor.stream over it
            # opened first): the consumer decides the outcome; this call delivers the tokens.
            made: list[Consumer] = []

            def make() -> Consumer:
                made.append(Consumer(tracker.start(name), fed=True))
                return made[0]

            consumer = watch_consumer(streamer, make)
            # One already fed is an earlier call's (a streamer used twice): this call is a request of its own.
            if consumer is not None and (made or not consumer.fed):
                consumer.fed = True
                self.consumer = consumer
                self.requests = [consumer.g]
        if not self.requests:
            self.requests = ([tracker.start(name, now=start_ns)] if rows == 1
                             else [tracker.start(name, now=start_ns) for _ in range(rows)])
        self.eos: frozenset[int] = frozenset()
        self.pad: int | None = None
        if rows > 1 or self.beam:  # rows are cut at their EOS (_cut): read now, as this call's config says
            eos, pad, stop_strings = options(kwargs, cfg, CUT_OPTIONS)
            self.eos = _token_ids(eos)
            # HF pads a row that one of its per-row criteria ended; only EOS (cut at above) and, when given, stop
            # strings or the caller's own criteria end a single row. Trailing padding is cut only then: a model
            # may well generate the pad id itself (a random T5 does: pad 0 is also its decoder start).
            per_row = bool(kwargs.get("stopping_criteria")) or stop_strings is not None
            self.pad = pad if per_row and isinstance(pad, int) and pad not in self.eos else None
        if streamable and not self.beam and (timeline or streamer is not None or self.verify):
            # One sequence without assisted steps needs only the times (_count): no token values kept.
            self.tap = _Tap(streamer, keep=len(self.requests) > 1 or self.verify)
            kwargs = {**kwargs, "streamer": self.tap}  # the call's own keywords: the caller's dict is untouched
        self.kwargs = kwargs
        self.ended: tuple[Any, ...] = ()

    # -- the call ended ------------------------------------------------------------------------

    def end(self, outcome: str, out: Any = None, *, now: int | None = None) -> None:
        """Settle the requests: on this thread when every value needed is on the host, else on the resolver.
        ``now``: the call ended then (``LateCall``, on a reader's thread: settled there unless on the device)."""
        active = self.active
        here = now is not None
        if now is None:
            now = active.returned(self.internal)
        sequences = None
        counted = None
        if outcome == OK and (self.beam or (self.tap is None and active.stamps is None)):
            # Beam search, or a call not timed: the tokens are in what it returned (a tensor, or an output with them).
            tensor = type(out) is _Tensor or isinstance(out, torch.Tensor)
            sequences = out if tensor else getattr(out, "sequences", None)
            if sequences is not None and not self.beam and len(self.requests) == 1:
                # One sequence stops right after its EOS (or its own stop): its length says how many tokens the
                # caller received. A shape, host metadata: no value read, no device sync.
                counted = max(0, int(sequences.shape[-1]) - self.start)
                sequences = None
        mask = self.mask
        if mask is not None and type(mask) is not _Tensor and not isinstance(mask, torch.Tensor):
            mask = None
        # Settled by a bound method of this call, with what it needs kept here: no closure made a call. Work on the
        # request thread costs 3-5x what it does in the resolver's batch (BENCHMARKS §3b): the type checks above go
        # by ``type() is`` first (isinstance on a tensor type asks its metaclass), a tensor's place by ``is_cpu``.
        self.ended = (outcome, now, sequences, mask, counted)
        if (sequences is not None and not sequences.is_cpu) or (mask is not None and not mask.is_cpu):
            self.tracker.defer(self._settle_ended)  # device values: read on the resolver, woken now
            return
        if here:
            self._settle_ended()
            return
        if self.consumer is not None or not self.tracker.defer(self._settle_ended, wake=False):
            # A streamer's consumer ends with what this call produced: settled now. Otherwise the next drain or read
            # settles it (~20 µs a call here, in situ, against a few µs in the resolver's batch).
            self._settle_ended()

    def _settle_ended(self) -> None:
        self._settle(*self.ended)

    def _settle(self, outcome: str, now: int, sequences: torch.Tensor | None, mask: torch.Tensor | None,
                counted: int | None) -> None:
        try:
            self._count(outcome, now, sequences, mask, counted)
        except Exception as exc:  # never the caller's problem: the requests still end, with what was known
            self.internal.report("generation", exc)
        if self.tap is not None:  # let the caller's streamer (and the step tensors) go with the call
            self.tap.inner = None
            self.tap.values = None
        for g in self.requests:
            try:
                if self.consumer is not None and self.consumer.g is g:
                    self.consumer.produced(outcome, now)
                else:
                    self.tracker.finish_at(g, outcome, now)
            except Exception as exc:
                self.internal.report("generation", exc)

    def _count(self, outcome: str, now: int, sequences: torch.Tensor | None, mask: torch.Tensor | None,
               counted: int | None) -> None:
        requests = self.requests
        counts = requests[0]._counts if requests else None
        # Prompt tokens: real ones per input row, padding apart; each request records its row's.
        if mask is not None and mask.dim() == 2:
            real = [int(x) for x in mask.sum(-1).tolist()]
        else:
            real = [self.prompt_len] * self.rows
        if counts is not None:
            self.tracker.add_prompt(counts, sum(real), max(0, self.prompt_len * len(real) - sum(real)))
        prompts = [real[min(i // self.k, len(real) - 1)] for i in range(len(requests))] if real else []
        if sequences is not None:  # beam search, or an untimed call of several rows: cut each row at its EOS
            rows = sequences[:, self.start:].tolist()
            for i, g in enumerate(requests):
                n = self._cut(rows[i]) if i < len(rows) else 0
                if self.beam:  # everything arrives when generate() returns: that is its tokens' time
                    self.tracker.settle(g, [now], [n], 1 if n else 0, n, prompts[i])
                else:
                    self.tracker.settle(g, [], None, 0, n, prompts[i])
            return
        if counted is not None:  # an untimed call of one sequence: its tokens, no times
            self.tracker.settle(requests[0], [], None, 0, counted, prompts[0])
            return
        stamps = self.active.stamps
        if stamps:  # a custom generate loop: each forward one token per row, no token values to cut at
            for i, g in enumerate(requests):
                self.tracker.settle(g, stamps, None, len(stamps), len(stamps), prompts[i])
            return
        tap = self.tap
        times = tap.times if tap is not None else []
        values = (tap.values or []) if tap is not None else []
        if outcome != OK and tap is not None and tap.inner is None:
            times = []  # a failed call with no streamer of the caller's handed no token to the caller
        if not times:
            for i, g in enumerate(requests):
                self.tracker.settle(g, [], None, 0, 0, prompts[i])
            return
        if len(requests) == 1:
            # One sequence: generate() stops right after its EOS or its own stop (assisted generation crops a
            # verify step's tokens there too), so every token it put is one the caller receives: no token value
            # needs reading (~10 µs a call saved). Assisted steps put several tokens at once: the shapes say how many.
            if not self.verify:
                self.tracker.settle(requests[0], times, None, len(times), len(times), prompts[0])
                return
            chunks = [int(v.shape[-1]) if v.dim() else 1 for v in values]
            n = sum(chunks)
            self.tracker.settle(requests[0], times, chunks, len(chunks), n, prompts[0])
            if len(chunks) > 1:
                advance(requests[0]._counts.verify, n - chunks[0])
            return
        # Several rows: each is cut at its own EOS, which needs the token values (host tensors, one a step:
        # B ids, or B x n for steps that accept several tokens).
        sizes: list[int] | None = None
        if not self.verify:  # one token a row a step: one stack (a reshape a step would cost ~1 µs each)
            table = torch.stack(values, 1).tolist()
        else:
            flat = [v.reshape(v.shape[0], -1) for v in values]
            sizes = [int(v.shape[1]) for v in flat]
            table = torch.cat(flat, 1).tolist()
        for i, g in enumerate(requests):
            n = self._cut(table[i]) if i < len(table) else 0
            if sizes is None:
                self.tracker.settle(g, times, None, n, n, prompts[i])
                continue
            upto, left, kept = 0, n, []
            for size in sizes:
                if left <= 0:
                    break
                kept.append(min(size, left))
                left -= kept[-1]
                upto += 1
            self.tracker.settle(g, times, kept, upto, n, prompts[i])
            if self.verify and upto > 1:
                advance(g._counts.verify, n - kept[0])

    def _cut(self, row: list[int]) -> int:
        """Tokens of one row the caller receives: up to and including its first EOS, trailing padding apart."""
        n = len(row)
        eos = self.eos
        if eos:
            for i, tok in enumerate(row):
                if tok in eos:
                    n = i + 1
                    break
        pad = self.pad
        if pad is not None:
            while n and row[n - 1] == pad:
                n -= 1
        return n


#: The module whose candidate generators call an assistant model's ``generate()`` for a draft (transformers'
#: assisted decoding: ``assistant_model=``).
_DRAFTS = "transformers.generation.candidate_generator"


def tracked_generate(generate: Callable[..., Any],
                     start: Callable[[Any, tuple[Any, ...], dict[str, Any], bool], Call | None],
                     internal: InternalErrors) -> Callable[..., Any]:
    """A model's own ``generate()``, tracked as the requests the caller receives (``GenerateCall``, ``LateCall``).

    ``start(model, args, kwargs, streamable)`` opens the call's requests (None: tracked elsewhere); ``generate`` then
    runs with the call's ``kwargs`` (a copy with perfmon's tap as its ``streamer`` when the call's tokens are timed and
    ``generate`` takes one, as Hugging Face's does; the caller's own keywords otherwise).
    The caller's result and exceptions pass through unchanged; the outcome is ``ok``, ``error``
    (an Exception) or ``cancelled`` (KeyboardInterrupt and the like). A failure inside perfmon runs the
    call untracked and is counted (``perfmon_internal_errors_total{stage="generation"}``).
    """

    streamable = _takes(generate, "streamer")

    @functools.wraps(generate)
    def generate_(self: Any, *args: Any, **kwargs: Any) -> Any:
        outer = generating.get()
        if outer is not None and (outer.verify or _part_of(self, outer)):
            # Nested in an assisted call (its assistant's drafts) or in the call of a model this one is part of (a
            # composite's generate() calling its language model's): the outer call tracks. A call of another model
            # inside one (a guard model run from a stopping criterion) is a request of its own.
            return generate(self, *args, **kwargs)
        if _getframe(1).f_globals.get("__name__") == _DRAFTS:
            # An assistant's drafts (assisted decoding, the assistant wrapped, its main model maybe not): no caller
            # receives them, so they are no requests; their forwards are still counted.
            return generate(self, *args, **kwargs)
        try:
            # kwargs is this call's own dict (packed above): GenerateCall copies it before it adds its tap.
            call: Call | None = start(self, args, kwargs, streamable)
        except Exception as exc:
            internal.report("generation", exc)
            call = None
        if call is None:
            return generate(self, *args, **kwargs)
        active = call.active
        if active.quiet is not None:
            # A quiet call (quiet.py): every forward runs bare on the view, none reads ``generating``.
            try:
                out = generate(active.model, *args, **call.kwargs)
            except BaseException as exc:
                _end(call, ERROR if isinstance(exc, Exception) else CANCELLED, exc, internal)
                raise
            try:
                call.end(OK, out)
            except Exception as exc:
                internal.report("generation", exc)
            return out
        token = generating.set(active)
        try:
            # The model, or the quiet view of it the call runs on (quiet.py): Active.model, which its forwards check.
            out = generate(call.active.model, *args, **call.kwargs)
        except Exception as exc:
            generating.reset(token)
            _end(call, ERROR, exc, internal)
            raise
        except BaseException as exc:
            generating.reset(token)
            _end(call, CANCELLED, exc, internal)
            raise
        generating.reset(token)
        try:  # _end, inline: a frame less between the model's last forward and the caller
            call.end(OK, out)
        except Exception as exc:
            internal.report("generation", exc)
        return out

    return generate_


def _end(call: Call, outcome: str, out: Any, internal: InternalErrors) -> None:
    try:
        call.end(outcome, out)
    except Exception as exc:
        internal.report("generation", exc)


def _part_of(model: Any, outer: Active) -> bool:
    """Whether ``model`` is the model of the tracked call ``outer`` or one of its submodules. Asked only of a
    ``generate()`` nested in a tracked one: a walk of the outer model's modules, once a call and nested model (a guard
    model run from a stopping criterion is asked every step; ``Active.nested`` keeps the answer)."""
    outer_model = outer.model
    if model is outer_model:
        return True
    known = outer.nested
    if known is None:
        known = outer.nested = {}
    part = known.get(id(model))  # (both live while the outer call runs: an id is not reused meanwhile)
    if part is None:
        modules = getattr(outer_model, "modules", None)
        try:
            part = callable(modules) and any(m is model for m in modules())
        except Exception:  # an odd module tree: the call is tracked on its own
            part = False
        known[id(model)] = part
    return part


def _takes(fn: Callable[..., Any], name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def is_encoder_decoder(model: Any) -> bool:
    """True for an encoder-decoder model (T5, BART): its config says so."""
    return bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))


def _token_ids(value: Any) -> frozenset[int]:
    if value is None:
        return frozenset()
    if type(value) is int:  # the common case first: isinstance(x, torch.Tensor) is a metaclass check (~0.2 µs)
        return frozenset((value,))
    if isinstance(value, torch.Tensor):
        return frozenset(int(v) for v in value.reshape(-1).tolist())
    if isinstance(value, int):
        return frozenset((value,))
    return frozenset(int(v) for v in value)
