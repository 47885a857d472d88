"""A ``generate()`` call that times nothing, opened and settled off the request thread (``LateCall``)."""

from __future__ import annotations

from time import perf_counter_ns
from typing import Any

import torch

from ..faults import InternalErrors
from .active import LEAN_STEPS, Active
from .decoding import GenerateCall
from .generation import GenerationTracker
from .quiet import VIEWS, Quiet, QuietDecode

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

    __slots__ = ("active", "args", "call", "encoder_decoder", "ended", "internal", "kwargs", "model", "name", "quiet",
                 "start_ns", "tracker")

    def __init__(self, model: Any, args: tuple[Any, ...], kwargs: dict[str, Any], tracker: GenerationTracker,
                 name: str, internal: InternalErrors, *, encoder_decoder: bool, quiet: QuietDecode | None = None,
                 options: list[Any] | None = None, start_ns: int | None = None) -> None:
        """``quiet``: the model's quiet decoding (quiet.py), when it has one: the call may run on its view.
        ``options``: the call's ``decoding.untimed_options``, which quiet decoding keys it by. ``start_ns``: when the
        call started (``perf_counter_ns``; the sampling decision's clock read), now if not given."""
        active = None
        if quiet is not None:  # generate() may then run on the view quiet.begin() puts in Active.model
            try:
                active = quiet.begin(model, args, kwargs, options or [None, None, None])
            except Exception as exc:
                internal.report("generation", exc)
        self.active = active or Active(model, False, False, batch=LEAN_STEPS, kwargs=kwargs)
        self.quiet: Quiet | None = None  # the call's Quiet when it ran quiet to its end (end: its Active goes back)
        self.model = model
        self.args = args
        self.kwargs = kwargs
        self.tracker = tracker
        self.name = name
        self.internal = internal
        self.encoder_decoder = encoder_decoder
        self.call: GenerateCall | None = None
        self.ended: tuple[Any, ...] = ()
        self.start_ns = perf_counter_ns() if start_ns is None else start_ns
        pending = tracker.pending  # GenerationTracker.hand_over, inline: a frame less on the request thread
        pending.append(self._open)
        if len(pending) >= tracker.wake_at and tracker.wake is not None:
            tracker.wake()

    def _open(self) -> None:
        self.call = GenerateCall(self.model, self.args, self.kwargs, self.tracker, self.name, False, self.internal,
                                 encoder_decoder=self.encoder_decoder, timeline=False, own=True, active=self.active,
                                 start_ns=self.start_ns)

    def end(self, outcome: str, out: Any = None) -> None:
        """The call returned ``out`` (or raised it, an exception): count its lean steps (or its quiet ones: quiet.py),
        stamp a request span, hand the settling over. Only the returned sequences are kept: an output object
        may hold the KV cache (``return_dict_in_generate``), which must not outlive the call for want of a read."""
        try:
            active = self.active
            quiet = self.quiet = active.quiet
            if (quiet is not None and type(out) is _Tensor and quiet.prefilled and quiet.exact
                    and active.span is None):
                # The common quiet call, returned: Active.returned and Quiet.ended inline (between the model's last
                # forward and the caller, each frame entered costs ~1-2 µs in situ). Nothing to flush (its steps ran
                # bare), no span to stamp; the cache goes, the view and this Active back to the pool for the next
                # call (the settling reads neither: ``self.quiet`` is its own).
                now = perf_counter_ns()
                quiet.cache = None
                views = quiet.owner.views
                if len(views) < VIEWS:
                    views.append((quiet.view, quiet.own, quiet.call, active))
            else:
                error = out if isinstance(out, BaseException) else None
                if error is not None:
                    out = None
                elif out is not None and type(out) is not _Tensor:
                    out = getattr(out, "sequences", None)
                now = active.returned(self.internal)
                if quiet is not None:  # its decode steps are counted when the settling runs, which a read runs first
                    quiet.ended(error)
        except Exception as exc:  # the requests still end (opened: they must not stay in flight), with what is known
            self.internal.report("generation", exc)
            out, now = None, perf_counter_ns()
        self.ended = (outcome, out, now)
        self.tracker.hand_over(self._close)

    def _close(self) -> None:
        quiet = self.quiet
        if quiet is not None:
            try:
                quiet.count(self.ended[1])
            except Exception as exc:
                self.internal.report("generation", exc)
        if self.call is not None:  # None: opening it failed (counted as an internal error)
            outcome, out, now = self.ended
            self.call.end(outcome, out, now=now)
