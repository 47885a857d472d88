"""A ``generate()`` call that times nothing, opened and settled off the request thread (``LateCall``)."""

from __future__ import annotations

from time import perf_counter_ns
from typing import Any

import torch

from ..faults import InternalErrors
from .active import LEAN_STEPS, Active
from .decoding import GenerateCall
from .generation import Generation, GenerationTracker
from .quiet import VIEWS, Quiet, QuietDecode
from .streams import OK

__all__ = ["LateCall"]

_Tensor = torch.Tensor


class LateCall:
    """A ``generate()`` call that times nothing, opened and settled off the request thread.

    A call whose tokens are not timed (most: ``generation_sample_rate``), of transformers' own ``generate()``, with no
    streamer of the caller's and no assistant, needs nothing of its requests while it runs: no tap, no timed step.
    So the request thread makes only the state its forwards read (``Active``: the lean decode steps, the prefill's
    label) and hands two pieces of work to the tracker's pending queue: opening its requests (a ``GenerateCall``, with
    the call's start time) and, when it returns, settling them. Every read (a scrape, /stats, the resolver's drain)
    runs what is pending first, in order, one reader at a time (``GenerationTracker.settle_pending``): in-flight
    requests, counts and durations are the same as if opened at the start. Between two model calls a ``GenerateCall``
    made here cost ~20 µs and its settling hand-over ~13 (BENCHMARKS §3b): what is left here is a few µs.
    """

    __slots__ = ("active", "args", "call", "closed", "decoder", "encoder_decoder", "ended", "internal", "kwargs",
                 "mask", "model", "name", "one", "options", "prompt_len", "quiet", "start_ns", "tracker", "whole")

    def __init__(self, model: Any, args: tuple[Any, ...], kwargs: dict[str, Any], tracker: GenerationTracker,
                 name: str, internal: InternalErrors, encoder_decoder: bool, quiet: QuietDecode | None = None,
                 options: list[Any] | None = None, start_ns: int | None = None) -> None:
        """``quiet``: the model's quiet decoding (quiet.py), when it has one: the call may run on its view.
        ``options``: the call's ``options.untimed_options``, which quiet decoding keys it by. ``start_ns``: when the
        call started (``perf_counter_ns``; the sampling decision's clock read), now if not given. (Positional: keywords
        make a class call build a dict, ~0.2 µs warm, more on the request thread between two model calls.)"""
        active = None
        if quiet is not None:  # generate() may then run on the view quiet.begin() puts in Active.model
            try:
                active = quiet.begin(model, args, kwargs, options or [None, None, None, None])
            except Exception as exc:
                internal.report("generation", exc)
        self.active = active or Active(model, False, False, batch=LEAN_STEPS, kwargs=kwargs)
        self.decoder = quiet
        self.quiet: Quiet | None = None  # the call's Quiet when it ran quiet to its end (end: its Active goes back)
        self.model = model
        self.args = args
        self.kwargs = kwargs
        self.tracker = tracker
        self.name = name
        self.internal = internal
        self.encoder_decoder = encoder_decoder
        self.options = options
        self.call: GenerateCall | None = None
        self.one: Generation | None = None  # a call of one row: its request (``_open``), without a GenerateCall
        self.mask: Any = None
        self.prompt_len = 0
        self.ended: tuple[Any, ...] = ()
        self.whole = False  # counted whole when it closes (``_open``: it had returned)
        self.closed = False
        self.start_ns = perf_counter_ns() if start_ns is None else start_ns
        # GenerationTracker.hand_over, inline: a frame less on the request thread, where each costs ~1 µs in situ.
        pending = tracker.pending
        pending.append(self._open)
        if len(pending) >= tracker.wake_at and tracker.wake is not None:
            tracker.wake()

    def _open(self) -> None:
        """Open the call's requests (on a reader's thread). The common call, one sequence from one row of input ids (a
        CPU attention mask or none, no beams), is one request whose settling needs its prompt's length and mask only:
        tracked here (``_settle_one``). Any other call is a ``GenerateCall``: several rows are cut at their EOS, and so
        on. Between two resolver ticks of a server, the first call's work is cold: the less code a call takes, the
        less of it (BENCHMARKS §3b)."""
        kwargs, args = self.kwargs, self.args
        beams, k = (self.options or (None, None))[:2]
        ids = kwargs.get("input_ids")
        if ids is None:
            ids = kwargs.get("inputs", args[0] if args else None)
        mask = kwargs.get("attention_mask")
        if (not self.encoder_decoder and (beams or 1) <= 1 and (k or 1) == 1 and type(ids) is _Tensor
                and ids.dim() == 2 and ids.shape[0] == 1
                and (mask is None or (type(mask) is _Tensor and mask.dim() == 2 and mask.is_cpu))):
            self.prompt_len = int(ids.shape[1])
            self.mask = mask
            if self.ended:  # it returned before this ran (usual: one pass runs both): counted whole, no Generation
                self.whole = True
                self._close()
                return
            self.one = self.tracker.start(self.name, now=self.start_ns)
            return
        self.call = GenerateCall(self.model, args, kwargs, self.tracker, self.name, False, self.internal,
                                 encoder_decoder=self.encoder_decoder, timeline=False, own=True, active=self.active,
                                 start_ns=self.start_ns)

    def end(self, outcome: str, out: Any = None) -> None:
        """The call returned ``out`` (or raised it, an exception): count its lean steps (or its quiet ones: quiet.py),
        stamp a request span, hand the settling over. Only the returned sequences are kept: an output object
        may hold the KV cache (``return_dict_in_generate``), which must not outlive the call for want of a read."""
        try:
            active = self.active
            quiet = self.quiet = active.quiet
            if quiet is not None and type(out) is _Tensor:
                # The common quiet call, returned: nothing to flush (its forwards ran bare), no span to stamp
                # (quiet.py); its view and this Active back to the pool for the next call (the settling reads
                # neither: ``self.quiet`` is its own).
                now = perf_counter_ns()
                views = quiet.owner.views  # Quiet.release, inline: a frame less on the request thread (~1 µs in situ)
                if len(views) < VIEWS:
                    views.append((quiet.view, active))
            else:
                error = out if isinstance(out, BaseException) else None
                if error is not None:
                    out = None
                elif out is not None and type(out) is not _Tensor:
                    out = getattr(out, "sequences", None)
                if quiet is not None:  # its forwards are counted when the settling runs, which a read runs first
                    now = perf_counter_ns()
                    quiet.ended(error)
                else:
                    now = active.returned(self.internal)
                    if (type(active.prefill) is tuple and error is None and active.key is not None
                            and self.decoder is not None and self.kwargs.get("max_new_tokens") == 1):
                        # A lean call of one token (its prefill, no decode step) teaches its shape to later such calls
                        # (here, not at its settling: the next call may come before any read).
                        self.decoder.learn(active.key, None, active.prefill)
        except Exception as exc:  # the requests still end (opened: they must not stay in flight), with what is known
            self.internal.report("generation", exc)
            out, now = None, perf_counter_ns()
        self.ended = (outcome, out, now)
        tracker = self.tracker  # GenerationTracker.hand_over, inline (as when the call opened)
        pending = tracker.pending
        pending.append(self._close)
        if len(pending) >= tracker.wake_at and tracker.wake is not None:
            tracker.wake()

    def _close(self) -> None:
        """Settle the returned call (on a reader's thread, once: ``_open`` runs it first for a call counted whole)."""
        if self.closed:
            return
        self.closed = True
        quiet = self.quiet
        outcome, out, now = self.ended
        if quiet is not None:
            try:
                quiet.count(out)
            except Exception as exc:
                self.internal.report("generation", exc)
        if self.one is not None or self.whole:
            self._settle_one(self.one, outcome, out, now)
        elif self.call is not None:  # None: opening it failed (counted as an internal error)
            self.call.end(outcome, out, now=now)

    def _settle_one(self, g: Generation | None, outcome: str, out: Any, now: int) -> None:
        """End a call of one sequence as ``GenerateCall`` would: its prompt's real tokens (the mask's ones; padding
        apart), its generated tokens (the returned sequence's columns after the prompt: it stops right after its EOS),
        none for a call that raised; the request ends either way. ``g`` None: the request was never opened (the call
        returned before its opening ran): counted whole (``GenerationTracker.count_ended``)."""
        tracker = self.tracker
        real = tokens = 0
        try:
            mask, prompt = self.mask, self.prompt_len
            if mask is None:
                real = prompt
            elif prompt <= 64:  # a short row read as a list: ~0.4 µs against ~2 for torch's sum (its dispatch)
                real = int(sum(mask.tolist()[0]))
            else:
                real = int(mask.sum())
            tokens = max(0, int(out.shape[-1]) - prompt) if outcome == OK and type(out) is _Tensor else 0
            if g is not None:
                tracker.add_prompt(g._counts, real, max(0, prompt - real))
                tracker.settle(g, [], None, 0, tokens, real)
        except Exception as exc:  # never the caller's problem: the request still ends, with what was known
            self.internal.report("generation", exc)
        try:
            if g is None:
                tracker.count_ended(self.name, self.start_ns, now, outcome, tokens, real,
                                    max(0, self.prompt_len - real))
            else:
                tracker.finish_at(g, outcome, now)
        except Exception as exc:
            self.internal.report("generation", exc)
