"""The state of one tracked ``generate()`` call that its model's forwards read (``stages.staged_path``).

``generating`` holds it for the context the call runs in; ``Active`` is what a forward needs to know inside it: which
model's call it is, whether every step is timed, the decode steps' short path (their signature, found once) and how
many of its steps still go uncounted (the lean step: counted in batches, ``Active.flush``). decoding.py makes one per
call (``GenerateCall``), stages.py reads it on every forward.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextvars import ContextVar
from time import perf_counter_ns
from typing import Any

__all__ = ["LEAN_STEPS", "Active", "generating"]


class Active:
    """What ``staged_path`` needs while a monitored model's ``generate()`` runs in this context."""

    __slots__ = ("armed", "batch", "cache_key", "entry", "first", "fn", "key", "keywords", "left", "model", "nested",
                 "numel", "prefill", "prefilled", "quiet", "rerun", "sampled", "span", "stamps", "state", "step_key",
                 "timed", "verify")

    def __init__(self, model: Any, timed: bool, verify: bool, *, batch: int = 0,
                 kwargs: Mapping[str, Any] | None = None) -> None:
        """``kwargs``: the ``generate()`` call's keywords, for a transformers ``generate()`` (``first``)."""
        self.model = model
        self.timed = timed  # every step of this call is timed (the first call, then one in 1/sample_rate)
        self.verify = verify  # assisted/speculative: decode-stage forwards verify drafts
        #: The first forward of this generate() has run (staged_path: later ones against its cache are decode).
        self.prefilled = False
        #: The first forward's stage when the caller passed no cache (generate() makes an empty one: a prefill), else
        #: None (a cache of the caller's may hold a prefix: the stage function reads it).
        self.first: str | None = None
        if kwargs is not None and kwargs.get("past_key_values") is None and kwargs.get("cache") is None:
            self.first = "prefill"  # stages.PREFILL (stages imports this module)
        #: A generate() that takes no streamer (a custom loop): host time as each forward returns, one token
        #: per row each (what such a loop is assumed to do). None when a tap stamps the tokens.
        self.stamps: list[int] | None = None
        #: The decode steps' signature in this call, with what it was taken from (stages.step_signature).
        self.step_key: tuple[Any, int, Any] | None = None
        #: The decode steps' short path (stages.staged_path), set by ``Stages.remember`` once their signature is warm:
        #: the signature's entry (None: no short path), the input's element count and the keyword count a step must
        #: have to take it, the keyword its cache comes under (stages.CACHE_KWARGS), the decode stage's state, its
        #: call target and timed path (hotpath.sampled_path), and the request span of the caller's context (stamped
        #: when the call ends: the short path does not stamp it). Slots of this one object, which a step reads
        #: anyway: the fewer objects a step touches, the fewer cache misses it pays after the model's forward ran
        #: (BENCHMARKS §3b).
        self.entry: Any = None
        self.numel = 0
        self.keywords = 0
        self.cache_key = "past_key_values"
        self.state: Any = None
        self.fn: Any = None
        self.sampled: Any = None
        self.span: Any = None
        #: This call's steps rerun the whole sequence (no cache, ``use_cache=False``): ``staged_path`` looks each up in
        #: the model's memo of such steps (reruns.py) before the full path.
        self.rerun = False
        #: ``id(model)`` -> whether a model whose ``generate()`` ran nested in this call is part of this one
        #: (``decoding._part_of``); None until one does.
        self.nested: dict[int, bool] | None = None
        #: Counting the short path's steps in batches (stages.staged_path): up to ``batch`` steps after a checked one
        #: take the lean step (the call, counted here), ``left`` of the ``armed`` still to go; ``flush`` adds the ones
        #: taken to the decode stage's and the signature's counters. 0: every step is checked and counted (a
        #: ``generate()`` that is not transformers' own: its loop may change a step's shape between two steps).
        self.batch = batch
        self.armed = 0
        self.left = 0
        #: The call's shape for quiet decoding (quiet.py: ``QuietDecode.begin``), when its model has it; and the call's
        #: ``Quiet`` when it runs quiet (``model`` is then the view it runs on).
        self.key: Any = None
        self.quiet: Any = None
        #: A call that may teach quiet decoding its shape: its prompt's length (an int, ``QuietDecode.begin``); once its
        #: prefill returned as one forward of the whole prompt, (length, the prefill's signature): ``Stages.prefilled``.
        self.prefill: Any = None

    def flush(self) -> None:
        """Count the lean steps taken since the last checked one (``staged_path``): the decode stage's calls and its
        signature's. Runs on the checked step that follows them and when the call ends, so each call's steps are all
        counted by the time it returns, and a read while it runs misses at most ``batch`` of them."""
        taken = self.armed - self.left
        self.armed = self.left = 0
        if taken > 0:
            # next() in a loop, not gen_events.advance: the counters' own C code, which every checked step runs, is
            # warm here; islice and a deque's extend, first touched after a forward, cost ~4 µs in situ.
            calls, entry_calls = self.state.calls, self.entry.calls
            for _ in range(taken):
                next(calls)
                next(entry_calls)

    def returned(self, internal: Any) -> int:
        """The request thread's part of the call's end: its time (``perf_counter_ns``, returned), its lean decode steps
        counted, and the caller's request span stamped (the short path leaves that to the call's end). ``internal``:
        the ``InternalErrors`` a failing stamp is counted in."""
        now = perf_counter_ns()
        if self.armed:
            self.flush()
        span = self.span
        if span is not None:
            try:
                span.model_call(now, now, None)
            except Exception as exc:
                internal.report("requests", exc)
        return now

    def arm(self, index: int) -> None:
        """After checked step ``index`` (counted, not sampled): let the next steps take the lean path, up to ``batch``
        and never past the decode stage's next sampling index (that step is checked, and timed)."""
        left = min(self.batch, self.state.next_index - index - 1)
        if left > 0:
            self.armed = self.left = left


#: Decode steps a checked step of the short path lets through uncounted until the next (``Active.flush``): a read
#: while a call runs misses at most this many of its steps; one checked step in this many costs ~1 µs more in situ.
LEAN_STEPS = 16

#: The ``Active`` of the generate() call running in this context (``None`` outside one). A context variable rather
#: than a thread-local: ``get()`` is ~16 ns against ~50 for a thread-local's dictionary, once per forward.
generating: ContextVar[Active | None] = ContextVar("perfmon_generating", default=None)
