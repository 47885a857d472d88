"""Continuous batching (transformers' ``ContinuousBatchingManager``): requests by id, steps by their mix.

Units: token counts are tokens; times are host ``perf_counter_ns`` stamps taken by ``Generation``
(generation.py) and reported in seconds there. Nothing here reads a device tensor or syncs.

What transformers does (5.x, ``generation/continuous_batching/``): ``model.init_continuous_batching()``
(also behind ``generate_batch`` and ``continuous_batching_context_manager``) returns a manager whose own
thread loops ``prepare_next_batch`` (the scheduler picks request chunks) -> one forward,
``model(**batch_data)`` with every request's tokens flattened into ``input_ids`` of shape ``(1, N)`` and
a paged ``cache=`` (no KV cache to the prefill/decode rule of stages.py: it sees a prefill) ->
``update_batch``, which publishes each request's output (``GenerationOutput``: its id and every token
so far) through ``output_router.deliver_batch`` to the output queue or an async handler. Requests
enter through ``input_queue.put`` in ``add_request``; a cancelled one is dropped by the scheduler's
``clear_cancelled_requests`` and never published again.

``ContinuousBatching`` (one per wrapped generative model) gives the model's class an
``init_continuous_batching`` that instruments each manager it returns, on the manager's own objects
(instance attributes; transformers' classes are untouched):

    input_queue.put            a request enters: one ``Generation`` per request id (and per forked
                               child, ``num_return_sequences``), its prompt tokens
    output_router.deliver(_batch)  an output is published: its new tokens are ``token(n)`` of that
                               request (the first chunk is its TTFT); a final output ends it ok/error
    scheduler.clear_cancelled_requests   cancelled
    batch processor prepare_next_batch   the step's prefill and decode tokens: counted
                               (``BatchTokens``) and handed to the step's forward on this thread
    stop                       requests left once the loop ended: cancelled (error after a fatal one)

and, on first use, a stage function for the model's forwards (``batch_stage``): ``prefill``,
``decode`` or ``mixed`` from the step's mix. It is installed then, not at wrap time, so a model that
never batches pays nothing per forward. With CUDA graphs (transformers' default on GPU when no attention
mask is needed) a replayed step calls no forward: it is in ``perfmon_batch_tokens_total`` (counted when
the step is prepared), not in the forward series. Everything here fails soft: a fault is counted
(``internal.report("batching", exc)``) and the manager runs on unchanged.

Bounds: at most ``MAX_LIVE_REQUESTS`` requests tracked per manager (beyond, a request is not tracked
and counted as an internal error); one entry per model in ``BatchTokens``.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping
from typing import Any

from ..faults import InternalErrors
from .stages import DECODE, PREFILL, StageFn
from .streams import CANCELLED, ERROR, OK, outcome_of

__all__ = ["MAX_LIVE_REQUESTS", "MIXED", "BatchTokens", "ContinuousBatching", "batch_stage", "step_tokens"]

#: Stage label of a step that carries prefill and decode tokens together.
MIXED = "mixed"
#: Requests tracked at once per manager (a Generation each, ~112 bytes, plus the table entry).
MAX_LIVE_REQUESTS = 65_536

#: ``restage(cls, wrap)``: give the model's class the stage function ``wrap(current)`` (wrap.py).
Restage = Callable[[type, Callable[[StageFn], StageFn]], None]


class _Prepared(threading.local):
    """Per thread (a manager's loop): (owner, prefill, decode) of the step prepared and not yet run."""

    batch: tuple[object, int, int] | None = None  # a class default: every thread reads None until it sets one


_step = _Prepared()


class BatchTokens:
    """Prefill and decode tokens of each model's continuous-batching steps: exact, read at scrape time.

    Plain ints under a lock, not ``itertools.count``: a step adds up to ``max_batch_tokens`` at once,
    and there is one addition per step (milliseconds apart), not per token.
    """

    def __init__(self) -> None:
        self._counts: dict[str, list[int]] = {}
        self._lock = threading.Lock()

    def add(self, model: str, prefill: int, decode: int) -> None:
        with self._lock:
            c = self._counts.get(model)
            if c is None:
                c = self._counts[model] = [0, 0]
            c[0] += prefill
            c[1] += decode

    def rows(self) -> list[tuple[str, int, int]]:
        """(model, prefill tokens, decode tokens) per model that ran a step."""
        with self._lock:
            return [(m, c[0], c[1]) for m, c in self._counts.items()]

    def reset_after_fork(self) -> None:
        """In a forked child: the parent's steps are the parent's to report."""
        self._counts = {}
        self._lock = threading.Lock()


def step_tokens(io: Any) -> tuple[int, int]:
    """(prefill, decode) tokens of the batch a manager's inputs-and-outputs object just prepared.

    Host bookkeeping only (lists and ints). A request's chunk covers positions ``[end - q, end)``
    (``end``: its ``position_offset``, already advanced by the chunk's ``q`` tokens); the positions
    before its prompt length are prefill, the rest decode. A re-prefill after a soft reset counts as
    prefill (it is prefill work); tokens skipped by a prefix-cache hit are in no chunk; padding is in
    no request, so it is not counted.
    """
    pairs = getattr(io, "io_pairs", None)
    if pairs is not None:  # async batching: the host side of the pair being prepared
        io = pairs[io.current_pair].host_io
    prefill = decode = 0
    for fs in io.requests_in_batch:
        q = fs.query_length
        state = fs.state
        left = len(state.initial_tokens) - (state.position_offset - q)  # prompt positions left at this chunk
        if left >= q:
            prefill += q
        elif left <= 0:
            decode += q
        else:
            prefill += left
            decode += q - left
    return prefill, decode


def _label(prefill: int, decode: int) -> str:
    if prefill and decode:
        return MIXED
    return DECODE if decode else PREFILL


def batch_stage(fallback: StageFn, owner: object) -> StageFn:
    """The stage function of a model once it ran continuous batching (staged_path calls it per forward).

    A forward on a manager's thread right after its step was prepared is that step's: ``prefill``,
    ``decode`` or ``mixed``. Any other forward (plain ``generate()``, a warm-up or CUDA-graph capture
    call with no prepared step) gets the model's own rule, ``fallback``. A partial of a module-level
    function, not a closure: ~90 ns more per forward than the model's own rule (a class's ``__call__``
    costs ~120), and torch.compile's marks (dynamo.py) find module-level code.
    """
    return functools.partial(_stage_of_step, fallback, owner)


def _stage_of_step(fallback: StageFn, owner: object, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
    batch = _step.batch
    if batch is None or batch[0] is not owner:
        return fallback(args, kwargs)
    _step.batch = None  # one forward per step: a graph capture's second call is not the step's again
    return _label(batch[1], batch[2])


class ContinuousBatching:
    """One wrapped model's continuous batching: ``__call__(base, restage)`` -> methods for its class.

    ``start(prompt_tokens)`` opens a generation request under the model's name (``GenerationTracker.start``),
    ``tokens`` counts the steps' tokens, ``internal`` counts faults.
    """

    def __init__(self, name: str, *, start: Callable[[int | None], Any], tokens: BatchTokens,
                 internal: InternalErrors) -> None:
        self.name = name
        self.start = start
        self.tokens = tokens
        self.internal = internal
        self._staged = False
        self._lock = threading.Lock()  # two threads making their first managers at once restage once

    def __call__(self, base: type, restage: Restage) -> dict[str, Any]:
        """The methods that replace ``base``'s in the model's class namespace (none without continuous batching)."""
        init = getattr(base, "init_continuous_batching", None)
        if not callable(init):
            return {}
        cb = self

        @functools.wraps(init)
        def init_continuous_batching(self: Any, *args: Any, **kwargs: Any) -> Any:
            manager = init(self, *args, **kwargs)
            try:
                with cb._lock:
                    if not cb._staged:
                        cb._staged = True
                        restage(type(self), lambda fallback: batch_stage(fallback, cb))
                if getattr(manager, "_perfmon_requests", None) is None:  # a cached (persistent) manager comes back
                    manager._perfmon_requests = _Requests(cb, manager)
            except Exception as exc:
                cb.internal.report("batching", exc)
            return manager

        return {"init_continuous_batching": init_continuous_batching}


class _Requests:
    """One manager's requests by id (bounded) and the wrappers installed on the manager's own objects.

    The table is written on the caller's thread (``put``) and on the manager's loop (outputs,
    cancellations): a lock, taken once per call or published batch, never per token.
    """

    def __init__(self, cb: ContinuousBatching, manager: Any) -> None:
        self._cb = cb
        self._manager = manager
        #: request id -> [Generation, tokens seen in its outputs]
        self._live: dict[str, list[Any]] = {}
        self._lock = threading.Lock()
        queue, router = manager.input_queue, manager.output_router
        self._put, self._deliver, self._deliver_batch = queue.put, router.deliver, router.deliver_batch
        self._create, self._stop = manager._create_batch_processor, manager.stop
        queue.put = self.put
        router.deliver = self.deliver
        router.deliver_batch = self.deliver_batch
        manager._create_batch_processor = self.create_batch_processor
        manager.stop = self.stop

    # -- caller's thread ----------------------------------------------------------------------

    def put(self, state: Any, *args: Any, **kwargs: Any) -> Any:
        """``input_queue.put``: the request (a ``RequestState``) is registered before the loop can see it."""
        ids: list[str] = []
        try:
            ids = self._register(state)
        except Exception as exc:
            self._cb.internal.report("batching", exc)
        try:
            return self._put(state, *args, **kwargs)
        except BaseException as exc:  # never queued (queue.Full after add_request's timeout): ends here
            self._end(ids, outcome_of(exc))
            raise

    def _register(self, state: Any) -> list[str]:
        rid = state.request_id
        # Forked children (num_return_sequences > 1) are named by the scheduler; they start with the parent.
        ids = [rid] + [f"{rid}__child#{i}" for i in range(int(state.num_children or 0))]
        prompt = len(state.initial_tokens)
        with self._lock:
            room = MAX_LIVE_REQUESTS - len(self._live)
        if room < len(ids):
            raise OverflowError(f"more than {MAX_LIVE_REQUESTS} requests in flight on one manager: "
                                f"{rid!r} is not tracked")
        entries = [(i, [self._cb.start(prompt), 0]) for i in ids]
        with self._lock:
            replaced = [old for i, entry in entries if (old := self._live.get(i)) is not None]
            self._live.update(entries)
        for old in replaced:  # the same id again while in flight: the first can no longer be told apart
            old[0].finish(CANCELLED)
        return ids

    def stop(self, *args: Any, **kwargs: Any) -> Any:
        """``manager.stop``: once the loop has ended, what it left unfinished ends too."""
        try:
            return self._stop(*args, **kwargs)
        finally:
            try:
                if not self._manager.is_running():
                    fatal = getattr(self._manager.background_thread_status, "fatal_error", None)
                    with self._lock:
                        left = list(self._live)
                    self._end(left, ERROR if fatal is not None else CANCELLED)
            except Exception as exc:
                self._cb.internal.report("batching", exc)

    # -- the manager's loop -------------------------------------------------------------------

    def deliver(self, output: Any) -> Any:
        """``output_router.deliver`` (one output, and failures): stamped just before it is handed over."""
        self._published((output,))
        return self._deliver(output)

    def deliver_batch(self, outputs: list[Any]) -> Any:
        """``output_router.deliver_batch``: the step's outputs, stamped just before they are handed over."""
        self._published(outputs)
        return self._deliver_batch(outputs)

    def _published(self, outputs: Any) -> None:
        try:
            news: list[tuple[Any, int, str | None]] = []
            with self._lock:
                live = self._live
                for out in outputs:
                    entry = live.get(out.request_id)
                    if entry is None:  # not ours: a non-driver rank, a warm-up, an untracked request
                        continue
                    n = len(out.generated_tokens) - entry[1]  # the output holds every token so far
                    entry[1] += max(n, 0)
                    outcome = None
                    if out.is_finished():
                        del live[out.request_id]
                        outcome = OK if out.error is None and getattr(out.status, "name", "") == "FINISHED" else ERROR
                    news.append((entry[0], n, outcome))
            for g, n, outcome in news:
                if n > 0:
                    g.token(n)
                if outcome is not None:
                    g.finish(outcome)
        except Exception as exc:
            self._cb.internal.report("batching", exc)

    def _end(self, ids: list[str], outcome: str) -> None:
        try:
            with self._lock:
                ended = [e for i in ids if (e := self._live.pop(i, None)) is not None]
            for entry in ended:
                entry[0].finish(outcome)
        except Exception as exc:
            self._cb.internal.report("batching", exc)

    def create_batch_processor(self) -> Any:
        """``manager._create_batch_processor`` (the loop's start, or ``warmup()``): instrument the processor once."""
        bp = self._create()
        try:
            if getattr(bp, "_perfmon_step", None) is None:
                bp._perfmon_step = _Step(self, bp)
        except Exception as exc:
            self._cb.internal.report("batching", exc)
        return bp


class _Step:
    """A batch processor's ``prepare_next_batch`` (the step's mix) and its scheduler's cancellations."""

    def __init__(self, requests: _Requests, bp: Any) -> None:
        self._requests = requests
        self._cb = requests._cb
        self._bp = bp
        self._prepare = bp.prepare_next_batch
        self._clear = bp.scheduler.clear_cancelled_requests
        bp.prepare_next_batch = self.prepare_next_batch
        bp.scheduler.clear_cancelled_requests = self.clear_cancelled_requests

    def prepare_next_batch(self) -> Any:
        ready = self._prepare()
        if ready:  # a step is prepared: its forward runs next on this thread (warm-up batches never come here)
            cb = self._cb
            try:
                prefill, decode = step_tokens(self._bp.inputs_and_outputs)
                cb.tokens.add(cb.name, prefill, decode)
                _step.batch = (cb, prefill, decode)
            except Exception as exc:
                cb.internal.report("batching", exc)
        return ready

    def clear_cancelled_requests(self) -> Any:
        states = self._clear()
        if states:  # dropped by the scheduler: never published again
            try:
                self._requests._end([s.request_id for s in states], CANCELLED)
            except Exception as exc:
                self._cb.internal.report("batching", exc)
        return states
