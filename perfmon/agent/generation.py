"""Generation requests: time to first token, inter-token latency, token counts and outcomes.

    request thread   Generation.token(): one clock read, a few ints, one deque append ─► Tracker.queue
                     Generation.finish(): one lock (live table), one counter, one deque append
    resolver thread  GenerationTracker.drain() (Monitor._tick) ─► sinks: GenerationCollector.observe
                     (metrics.py histograms) and the /stats rings kept here

Times are host time (``perf_counter_ns``) at which a token was handed to the caller: what a user of a
streaming endpoint sees. Counts (requests by outcome, prompt and generated tokens) are exact at any
moment: ``itertools.count`` objects (and one int under a lock) read at scrape time (``defer``'s work done
first). Percentiles and histogram updates happen on the resolver thread, never on the request thread.

Bounds: the record queue holds at most ``generation_queue_size`` records (a full queue drops the
record, counted ``reason="queue_full"``); at most ``max_live_generations`` requests are timed at once
(the rest are counted but not timed, ``reason="live_limit"``). A request's own state is one
``Generation`` (``__slots__``, 112 bytes) held by the caller; the tracker keeps only its start time in
the live table until it ends. The number of distinct names is capped by ``max_models``.

An iterable timed as one request (``Monitor.stream``) and the outcome names: streams.py.
"""

from __future__ import annotations

import collections
import itertools
import threading
from collections.abc import Callable
from time import perf_counter_ns
from types import TracebackType
from typing import Any

from ..exceptions import ConfigError
from ..faults import InternalErrors, count_value
from ..stats.windows import summarize
from .gen_events import (
    DONE,
    DROP_REASONS,
    DURATION_BUCKETS,
    FIRST,
    ITL_BUCKETS,
    NEXT,
    TIMELINE,
    TOKEN_BUCKETS,
    TTFT_BUCKETS,
    EventRings,
    GenerationCounts,
    GenerationEvent,
    GenerationSink,
    RequestDone,
    TokenRun,
    TokenTiming,
    advance,
    check_name,
    done_event,
    events_of,
    prompt_or_none,
)
from .streams import (
    CANCELLED,
    OK,
    OUTCOMES,
    outcome_of,
    token_count,
)

__all__ = [
    "DROP_REASONS",
    "DURATION_BUCKETS",
    "ITL_BUCKETS",
    "TOKEN_BUCKETS",
    "TTFT_BUCKETS",
    "Generation",
    "GenerationCounts",
    "GenerationEvent",
    "GenerationTracker",
    "RequestDone",
    "TokenRun",
    "TokenTiming",
]

_BATCH = 4096  # records turned into events at a time: bounds the resolver's transient memory


class Generation:
    """One generation request: ``token()`` as tokens are handed to the caller, then ``finish()``.

    Use it as a context manager (``with monitor.generation("chat", prompt_tokens=12) as g:``; an
    Exception inside the block ends it as ``error`` and is re-raised unchanged, another BaseException as
    ``cancelled``) or by hand (``g = monitor.generation(...)``, ``g.token()``, ``g.finish()``). One thread
    at a time per request, like any iterator. An unfinished Generation that is garbage-collected ends
    as ``cancelled``.
    """

    __slots__ = ("__weakref__", "_counts", "_key", "_tracker", "first_ns", "last_ns", "outcome",
                 "prompt_tokens", "start_ns", "tokens")

    def __init__(self, tracker: GenerationTracker, counts: GenerationCounts, key: int, start_ns: int,
                 prompt_tokens: int | None) -> None:
        self._tracker = tracker
        self._counts = counts
        self._key = key  # > 0: timed (in the tracker's live table); 0: counted only
        self.start_ns = start_ns  # perf_counter_ns() when the request started
        self.first_ns: int | None = None  # ... when its first token was handed over
        self.last_ns: int | None = None  # ... when its latest token was handed over
        self.tokens = 0  # tokens handed over so far
        self.prompt_tokens = prompt_tokens
        self.outcome: str | None = None  # set once, by finish()

    @property
    def name(self) -> str:
        """The ``model`` label this request is counted under."""
        return self._counts.name

    def token(self, n: int = 1) -> None:
        """Record that ``n`` tokens were handed to the caller now.

        The first call gives the time to first token (from the request's start); each later call gives
        the inter-token latency, the gap since the previous call. A chunk of ``n > 1`` tokens counts
        ``n`` tokens: in the first call they all belong to the first token's TTFT (one observation);
        later, the gap is divided evenly among them (``n`` ITL observations of ``gap / n``), so the ITL
        histogram's count is the tokens after the first chunk and its sum the time from first to last.
        ``n == 0`` records nothing. An invalid ``n`` is an internal error (stage ``generation``) and
        counts as 1. Calls after ``finish()`` are ignored (counted ``reason="after_finish"``).
        """
        now = perf_counter_ns()
        if self.outcome is not None:
            next(self._counts.dropped["after_finish"])
            return
        if n != 1:
            n = self._count_of(n)
            if n == 0:
                return
        counts = self._counts
        last = self.last_ns
        self.last_ns = now
        self.tokens += n
        if n == 1:
            next(counts.generated)
        else:
            advance(counts.generated, n)
        if self._key:
            tracker = self._tracker
            queue = tracker.queue
            if len(queue) >= tracker.queue_size:  # racy by at most one record per thread: still bounded
                next(counts.dropped["queue_full"])
            else:
                if last is None:
                    self.first_ns = now
                queue.append((counts, FIRST, now - self.start_ns, n, now) if last is None
                             else (counts, NEXT, now - last, n, now))
                if len(queue) >= tracker.wake_at and tracker.wake is not None:
                    tracker.wake()
        elif last is None:
            self.first_ns = now

    def _count_of(self, n: Any) -> int:  # a token count other than 1, checked: token()'s slow path
        try:
            return token_count(n)
        except Exception as exc:
            self._tracker._internal.report("generation", exc)
            return 1

    def finish(self, outcome: str = OK) -> None:
        """End the request with ``outcome`` (``ok``, ``error`` or ``cancelled``). Idempotent: the first wins."""
        if self.outcome is not None:
            return
        if outcome not in OUTCOMES:
            raise ConfigError(f"outcome={outcome!r}: expected one of {', '.join(OUTCOMES)}")
        self._tracker.finish_at(self, outcome, perf_counter_ns())

    def __enter__(self) -> Generation:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.finish(outcome_of(exc))

    async def __aenter__(self) -> Generation:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.finish(outcome_of(exc))

    def __del__(self) -> None:
        # Backstop for the manual form and for a stream whose generator never ran (a generator closed
        # before its first next() runs no finally): a request nobody can finish any more was abandoned.
        try:
            if self.outcome is None:
                self.finish(CANCELLED)
        except Exception:  # pragma: no cover - never raise from a finalizer (e.g. at interpreter exit)
            pass

    def __repr__(self) -> str:
        return f"<Generation {self.name!r} tokens={self.tokens} outcome={self.outcome or 'in flight'}>"


class GenerationTracker:
    """Names, the live table, the record queue and the /stats rings for generation requests."""

    def __init__(self, *, internal: InternalErrors, timing: Callable[[], bool] = lambda: True,
                 max_names: int = 64, max_live: int = 10_000, queue_size: int = 65_536,
                 window_seconds: float = 60.0, max_samples: int = 10_000,
                 wake: Callable[[], None] | None = None) -> None:
        self._internal = internal
        self.wake = wake  # request thread, a quarter of the queue used: the resolver drains it now
        self.wake_at = self._wake_at = max(1, queue_size // 4)  # a quarter; one while the resolver dozes
        self._timing = timing  # False while the monitor is stopped: count, do not time
        self.max_names = max_names
        self.max_live = max_live
        self.queue_size = queue_size
        self.window_ns = int(window_seconds * 1e9)
        self.max_samples = max_samples
        self.sinks: list[GenerationSink] = []
        # Keys survive a fork: a request started in the parent and ended in the child must not match a
        # child's request in the live table.
        self._keys = itertools.count(1)
        self._reset()

    def _reset(self) -> None:
        self._names: dict[str, GenerationCounts] = {}
        # Names, the live table, prompt totals. Reentrant: a cyclic garbage Generation can be collected
        # (and finish itself in __del__) at any allocation, including one made while this thread holds it.
        self._lock = threading.RLock()
        #: key -> (counts, start_ns) of the requests being timed. No reference to the Generation itself,
        #: so an abandoned one is still garbage-collected (and ends as cancelled).
        self._live: dict[int, tuple[GenerationCounts, int]] = {}
        self.queue: collections.deque[tuple[Any, ...]] = collections.deque()
        #: Work the request thread handed over (``defer``): that needs device values, run by drain() on the resolver
        #: (a read there may wait for the device: never on a scrape's thread); host work, by drain() or any read.
        self.deferred: collections.deque[Callable[[], None]] = collections.deque()
        self.pending: collections.deque[Callable[[], None]] = collections.deque()
        #: One reader at a time runs the work handed over: a late generate() call's opening must finish before its
        #: closing runs (latecall.LateCall), and two readers popping them could run them at once. Readers only.
        self._settling = threading.RLock()
        self._rings = EventRings(self.max_samples)

    def reset_after_fork(self) -> None:
        """In a forked child: the parent's requests are the parent's; a lock held at fork() is replaced.

        A request started in the parent and finished in the child lands in counts nobody reads.
        """
        self._reset()

    # -- request path -------------------------------------------------------------------------

    def start(self, name: str, prompt_tokens: int | None = None, *, now: int | None = None) -> Generation:
        """A new request under ``name`` (``Monitor.generation``): call ``g.token(n=1)`` as tokens reach the caller.

        ``with tracker.start("chat", prompt_tokens=12) as g:`` ends it as ``ok`` (an Exception in the block:
        ``error``, re-raised unchanged; another BaseException: ``cancelled``); without ``with``, end it with
        ``g.finish(outcome)``. The first ``token()`` gives the time to first token (seconds, host
        ``perf_counter``, from this call), the later ones the inter-token latency. ``name`` is registered on
        first use (the same name as a wrapped model shares its label; at most ``max_names`` names). Never raises (the
        request path): a name perfmon cannot take gives a request counted nowhere, a bad ``prompt_tokens`` one whose
        prompt is unknown, each an internal error (stage ``generation``). Costs a few counters and a dict insert
        here (a lock only with ``prompt_tokens``), one lock in ``finish()``; ``token()`` one clock read and one deque
        append.
        """
        counts = self._names.get(name) if name.__class__ is str else None
        if counts is None and (counts := self._register(name)) is None:  # refused: counts nobody reads
            return Generation(self, GenerationCounts(str(name)), 0, perf_counter_ns() if now is None else now, None)
        prompt = None if prompt_tokens is None else prompt_or_none(prompt_tokens, self._internal)
        timing = self._timing()
        if now is None:  # else the request started earlier (perf_counter_ns): a generate() call opened late
            now = perf_counter_ns()
        key = 0
        # No lock for the live table: one insert (and finish_at's one pop) is atomic under the GIL, and a bound
        # overshot by one request per thread is still a bound. An uncontended lock cost ~2.5 µs here in situ, between
        # two generate() calls (BENCHMARKS §3b); the prompt total is a read-modify-write and keeps it.
        if timing and len(self._live) < self.max_live:
            key = next(self._keys)
            self._live[key] = (counts, now)
        if prompt:
            with self._lock:
                counts.prompt += prompt
        next(counts.started)
        if timing and not key:
            next(counts.dropped["live_limit"])
        return Generation(self, counts, key, now, prompt)

    def _register(self, name: Any) -> GenerationCounts | None:
        """``name``'s counts, made at its first use; None for a name perfmon cannot take (an internal error)."""
        try:
            check_name(name)
            with self._lock:
                counts = self._names.get(name)
                if counts is None:
                    if len(self._names) >= self.max_names:
                        raise ConfigError(f"at most max_models={self.max_names} generation names per monitor "
                                          f"(each is a label value on every generation metric); {name!r} is one more")
                    counts = self._names[name] = GenerationCounts(name)
            return counts
        except ConfigError as exc:
            self._internal.report("generation", exc)
            return None

    def finish_at(self, g: Generation, outcome: str, now: int) -> None:
        """End ``g`` with ``outcome`` at host time ``now`` (``perf_counter_ns``): ``Generation.finish``, and a
        generate() call's requests when the call returns or their streamer's consumer ends. Idempotent."""
        with self._lock:  # check-and-set under the lock: finish() racing __del__ or another thread counts once
            if g.outcome is not None:
                return
            g.outcome = outcome
            live = self._live.pop(g._key, None) if g._key else None
        counts = g._counts
        next(counts.requests[outcome])
        if live is None:  # counted only (live limit, monitor stopped, or started before a fork)
            return
        self._put(counts, (counts, DONE, now - g.start_ns, g.tokens, now, outcome, g.prompt_tokens))

    def count_ended(self, name: str, start_ns: int, end_ns: int, outcome: str, tokens: int, real: int,
                    padding: int) -> None:
        """Count a request that already ended, all at once: what ``start``, ``add_prompt``, ``settle`` (no token times)
        and ``finish_at`` would count for it (started, its prompt's ``real`` tokens and ``padding``, its ``tokens``, its
        ``outcome``, and its end record: duration from ``start_ns`` to ``end_ns``, ``perf_counter_ns``), with no
        ``Generation`` made and no live-table entry (it was never in flight for a reader to see). A ``generate()``
        call's opening that runs after the call returned (``LateCall``, usually: a reader's pass runs both)."""
        counts = self._names.get(name) if name.__class__ is str else None
        if counts is None and (counts := self._register(name)) is None:
            return
        with self._lock:
            counts.prompt += real
            counts.padding += padding
        next(counts.started)
        if tokens:
            advance(counts.generated, tokens)
        next(counts.requests[outcome])
        if not self._timing():  # counted only, as a request started while the monitor is stopped
            return
        self._put(counts, (counts, DONE, end_ns - start_ns, tokens, end_ns, outcome, real))

    def add_prompt(self, counts: GenerationCounts, real: int, padding: int) -> None:
        """Add a generate() call's prompt tokens (real ones and padding), known when the call ends."""
        with self._lock:
            counts.prompt += real
            counts.padding += padding

    def settle(self, g: Generation, times: list[int], sizes: list[int] | None, upto: int, tokens: int,
               prompt: int | None) -> None:
        """Record a whole request's tokens at once (a tracked generate() call, when it ends).

        ``times[:upto]`` are the host times (``perf_counter_ns``) at which its chunks of tokens became
        available to the caller, ``sizes[:upto]`` their sizes (None: one token each), ``tokens`` their sum.
        One queue record, expanded into TTFT and ITL observations on the resolver thread (``events_of``).
        """
        if g.outcome is not None:
            next(g._counts.dropped["after_finish"])
            return
        if tokens:
            advance(g._counts.generated, tokens)
        g.tokens += tokens
        g.prompt_tokens = prompt
        if upto <= 0:
            return
        g.first_ns = times[0]
        g.last_ns = times[upto - 1]
        if g._key:
            self._put(g._counts, (g._counts, TIMELINE, g.start_ns, times, sizes, upto))

    def _put(self, counts: GenerationCounts, record: tuple[Any, ...]) -> None:
        """Queue a request's record, or count it dropped when full; wakes the resolver once a quarter waits."""
        queue = self.queue
        if len(queue) >= self.queue_size:
            next(counts.dropped["queue_full"])
            return
        queue.append(record)
        if len(queue) >= self.wake_at and self.wake is not None:
            self.wake()

    def doze(self, on: bool) -> bool:
        """The resolver dozes (on): the first record or handed-over work wakes it; True if some waits already."""
        self.wake_at = 1 if on else self._wake_at
        return bool(self.queue or self.pending or self.deferred)

    def defer(self, work: Callable[[], None], *, wake: bool = True) -> bool:
        """Run ``work`` off the request thread. ``wake``: work that needs device values, on the resolver's next pass,
        woken now. Without it, host work (a returned generate() call's settling, 3-5x as costly cold between two
        model calls as in the resolver's batch: BENCHMARKS §3b) at that pass, unwoken, or the next read (a scrape,
        /stats); False, nothing kept, while the monitor is stopped (nothing drains) or a queue's worth waits: the
        caller runs it now."""
        if not wake:
            if len(self.pending) >= self.queue_size or not self._timing():
                return False
            self.hand_over(work)
            return True
        self.deferred.append(work)
        if self.wake is not None:
            self.wake()
        return True

    def hand_over(self, work: Callable[[], None]) -> None:
        """Queue host work for the next pass or read, whatever waits already (``defer`` without its bound: a
        ``LateCall``'s settling must follow its opening, queued when it began); the resolver is woken once a quarter
        of a queue's worth waits."""
        pending = self.pending
        pending.append(work)
        if len(pending) >= self.wake_at and self.wake is not None:
            self.wake()

    def settle_pending(self, *, device: bool = False) -> None:
        """Run the host work handed over (``defer(wake=False)``) now, on any thread, each piece once, and with
        ``device`` (the resolver) the device work too. Never raises."""
        if not self.pending and not (device and self.deferred):
            return
        with self._settling:
            for queue in (self.deferred, self.pending) if device else (self.pending,):
                while queue:
                    try:
                        work = queue.popleft()
                    except IndexError:  # another thread took the last one
                        break
                    try:
                        work()
                    except Exception as exc:
                        self._internal.report("generation", exc)

    # -- resolver thread ----------------------------------------------------------------------

    def drain(self, now_ns: int | None = None) -> int:
        """Turn queued records into events for the sinks and the /stats rings; returns how many. Never raises.

        Works in batches (one lock per batch and stage, not per record): ~1 µs a record on this machine.
        """
        self.settle_pending(device=True)
        queue = self.queue
        done = 0
        while queue:
            batch: list[GenerationEvent] = []
            while len(batch) < _BATCH:
                try:
                    rec = queue.popleft()
                except IndexError:
                    break
                try:
                    if rec[1] == DONE:  # every request's last record: one event, no generator
                        batch.append(done_event(rec))
                    else:
                        batch.extend(events_of(rec))
                except Exception as exc:  # pragma: no cover - records are built by this module
                    self._internal.report("generation", exc)
            if not batch:
                break
            done += len(batch)
            for stage in (self._rings.remember, *self.sinks):
                try:
                    stage(batch)
                except Exception as exc:
                    self._internal.report("generation", exc)
        return done

    # -- reading ------------------------------------------------------------------------------

    def names(self) -> list[GenerationCounts]:
        """Every name's counts, in registration order, every returned generate() call settled first (``defer``)."""
        self.settle_pending()
        return list(self._names.values())

    def live(self) -> int:
        """Requests being timed now (in the live table)."""
        self.settle_pending()
        return len(self._live)

    def stats(self, now_ns: int | None = None, started_ns: int | None = None) -> dict[str, Any]:
        """Per name, for /stats: exact counts, and exact percentiles (seconds) over the stats window."""
        self.settle_pending()  # the live table without the calls that have returned
        now = perf_counter_ns() if now_ns is None else now_ns
        cutoff = now - self.window_ns
        if started_ns is not None:
            cutoff = max(cutoff, started_ns)
        span_s = (now - cutoff) / 1e9
        with self._lock:
            live = list(self._live.values())
        rings = self._rings.since(cutoff)
        oldest: dict[str, int] = {}
        for counts, start in live:
            oldest[counts.name] = min(start, oldest.get(counts.name, start))
        out: dict[str, Any] = {}
        for c in self.names():
            requests = c.request_counts()
            output = rings.get((c.name, "output"), [])
            out[c.name] = {
                "requests": requests,
                "in_flight": max(0, count_value(c.started) - sum(requests.values())),
                "oldest_in_flight_seconds": (now - oldest[c.name]) / 1e9 if c.name in oldest else None,
                "prompt_tokens": c.prompt,
                "prompt_padding_tokens": c.padding,
                "verify_tokens": count_value(c.verify),
                "generated_tokens": count_value(c.generated),
                "dropped": {r: n for r, d in c.dropped.items() if (n := count_value(d))},
                "time_to_first_token": summarize(rings.get((c.name, "ttft"), [])),
                "inter_token_latency": summarize(rings.get((c.name, "itl"), [])),
                "duration": summarize(rings.get((c.name, "duration"), [])),
                # Tokens of the requests that ended in the window, any outcome, per second of the window.
                "tokens_per_second": sum(output) / span_s if span_s > 0 else None,
            }
        return out
