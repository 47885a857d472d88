"""What the generation tracker counts and records: exact counts per name, queue records, and the events
the resolver hands the sinks.

    request thread   GenerationCounts (itertools.count objects: exact at any moment, read at scrape time)
                     queue records: tuples, cheapest to build (one per token, or one per request: a timeline)
    resolver thread  events_of(record) -> TokenTiming / RequestDone events for the sinks

A *timeline* record carries a whole request's token arrivals at once: a tracked ``generate()`` call learns
which tokens each returned sequence received only when the call ends (a row stops at its own EOS), so it
records each request once, with the host times (``perf_counter_ns``) at which its chunks of tokens became
available to the caller, instead of one record per token as they go.
"""

from __future__ import annotations

import collections
import itertools
import operator
import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from ..config import log_buckets
from ..exceptions import ConfigError
from ..faults import count_value
from .streams import OK, OUTCOMES

__all__ = [
    "DONE",
    "DROP_REASONS",
    "FIRST",
    "NEXT",
    "TIMELINE",
    "EventRings",
    "GenerationCounts",
    "GenerationEvent",
    "GenerationSink",
    "RequestDone",
    "TokenRun",
    "TokenTiming",
    "advance",
    "check_name",
    "check_prompt",
    "done_event",
    "events_of",
    "prompt_or_none",
]

#: TTFT buckets (s): 12 per decade (adjacent bounds 21% apart, histogram_quantile within ~10%; the same
#: bounds as the forward latency's DEFAULT_BUCKETS where they overlap) from 1 ms to 60 s: a prefill on a
#: warm GPU is milliseconds, a long prompt queued behind others is seconds. 58 bounds, within the per-model
#: series budget (docs/metrics.md); a Prometheus that scrapes native histograms gets 9% resolution instead.
TTFT_BUCKETS: tuple[float, ...] = log_buckets(0.001, 60.0, 12)
#: Inter-token latency buckets (s): 12 per decade from 0.46 ms to 1 s (a modern GPU's decode step is
#: 3-5 ms, which vLLM's and OpenTelemetry's 10 ms first bucket cannot resolve), coarse tails below for
#: chunks divided into tokens and above for stalls. 47 bounds; native histograms as for TTFT.
ITL_BUCKETS: tuple[float, ...] = (0.0001, 0.0002, 0.0003) + log_buckets(0.0005, 1.0, 12) + (2.0, 5.0, 10.0)
#: Request duration buckets (s): 1-2-5 from 10 ms to 10 min. Coarse on purpose: a request's duration is
#: mostly its output length times the ITL, so its distribution follows the traffic mix, not the model's
#: speed (TTFT and ITL are the latency signals); it answers "how long does a request hold a slot".
DURATION_BUCKETS: tuple[float, ...] = tuple(
    float(f"{m * 10.0**e:.4g}") for e in range(-2, 3) for m in (1, 2, 5)
) + (600.0,)
#: Tokens per request: powers of two from 1 to 128 Ki (131072).
TOKEN_BUCKETS: tuple[float, ...] = tuple(float(2**k) for k in range(18))

#: Why a timing record never reached the histograms (the ``reason`` label; all always exported).
DROP_REASONS = (
    "queue_full",  # the resolver fell behind: a token or request record found the queue full
    "live_limit",  # a request started while max_live_generations were being timed: counted, not timed
    "after_finish",  # token() on a request that had already ended: ignored
)

#: Record kinds on the queue: (counts, FIRST, ttft_ns, n, end_ns), (counts, NEXT, gap_ns, n, end_ns),
#: (counts, DONE, duration_ns, tokens, end_ns, outcome, prompt), (counts, TIMELINE, start_ns, times, sizes, upto).
FIRST, NEXT, DONE, TIMELINE = 0, 1, 2, 3


class TokenTiming(NamedTuple):
    """One TTFT or inter-token observation, as the resolver hands it to the sinks."""

    model: str
    kind: str  # "ttft" or "itl"
    seconds: float
    tokens: int  # how many tokens this observation stands for (its histogram weight; 1 for TTFT)
    end_ns: int  # perf_counter_ns() when the token(s) were handed over


class RequestDone(NamedTuple):
    """A request that ended."""

    model: str
    outcome: str  # one of OUTCOMES
    duration_seconds: float  # from the request's start to its end
    prompt_tokens: int | None
    output_tokens: int
    end_ns: int


class TokenRun(NamedTuple):
    """The inter-token observations of one request's timeline at once (a tracked generate() call's): one event for
    its tokens after the first, so the sinks fold them in a loop of their own rather than an event each."""

    model: str
    seconds: list[float]  # each observation's gap (a chunk's gap divided by its tokens)
    tokens: list[int] | None  # each observation's weight (the tokens of its chunk); None: 1 each
    end_ns: list[int]  # perf_counter_ns() when each was handed over


GenerationEvent = TokenTiming | TokenRun | RequestDone
#: A stage that consumes a batch of generation events (resolver thread).
GenerationSink = Callable[[list[GenerationEvent]], None]


class EventRings:
    """The /stats rings of generation events: (end_ns, value) per name and kind (``ttft``, ``itl``, ``duration``: an
    ``ok`` request's seconds, ``output``: a request's tokens), each bounded by ``cap`` (the latest kept)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._rings: dict[tuple[str, str], collections.deque[tuple[int, float]]] = {}
        self._lock = threading.Lock()

    def _ring(self, model: str, kind: str) -> collections.deque[tuple[int, float]]:
        r = self._rings.get((model, kind))
        if r is None:
            r = self._rings[(model, kind)] = collections.deque(maxlen=self.cap)
        return r

    def remember(self, events: list[GenerationEvent]) -> None:
        """Sink: a drained batch (resolver thread). A chunk's n tokens are n observations, as in the histograms."""
        ring, cap = self._ring, self.cap
        with self._lock:
            for ev in events:
                if isinstance(ev, TokenRun):
                    if ev.tokens is None:
                        ring(ev.model, "itl").extend(zip(ev.end_ns, ev.seconds))
                    else:
                        itl = ring(ev.model, "itl")
                        for end, seconds, n in zip(ev.end_ns, ev.seconds, ev.tokens):
                            itl.extend(itertools.repeat((end, seconds), min(n, cap)))
                elif isinstance(ev, TokenTiming):
                    if ev.tokens == 1:
                        ring(ev.model, ev.kind).append((ev.end_ns, ev.seconds))
                    else:
                        ring(ev.model, ev.kind).extend(itertools.repeat((ev.end_ns, ev.seconds), min(ev.tokens, cap)))
                else:
                    if ev.outcome == OK:
                        ring(ev.model, "duration").append((ev.end_ns, ev.duration_seconds))
                    ring(ev.model, "output").append((ev.end_ns, float(ev.output_tokens)))

    def since(self, cutoff_ns: int) -> dict[tuple[str, str], list[float]]:
        """(name, kind) -> the values of the events that ended at ``cutoff_ns`` or later (``perf_counter_ns``)."""
        with self._lock:
            return {key: [v for end, v in ring if end >= cutoff_ns] for key, ring in self._rings.items()}


class GenerationCounts:
    """Exact counts for one name, written on the request path and read at scrape time."""

    __slots__ = ("dropped", "generated", "name", "padding", "prompt", "requests", "started", "verify")

    def __init__(self, name: str) -> None:
        self.name = name
        self.requests = {o: itertools.count() for o in OUTCOMES}
        self.started = itertools.count()
        self.generated = itertools.count()
        # ints, not counts: a prompt adds up to 128 Ki at once (under the tracker's lock)
        self.prompt = 0  # real prompt tokens (the attention mask's ones)
        self.padding = 0  # prompt positions that were padding (the attention mask's zeros)
        self.verify = itertools.count()  # tokens produced by speculative verify steps (accepted drafts + 1 each)
        self.dropped = {r: itertools.count() for r in DROP_REASONS}

    def request_counts(self) -> dict[str, int]:
        return {o: count_value(c) for o, c in self.requests.items()}


def events_of(rec: tuple[Any, ...]) -> Iterator[GenerationEvent]:
    """The events one queue record stands for (resolver thread)."""
    counts, kind = rec[0], rec[1]
    name = counts.name
    if kind == FIRST:
        yield TokenTiming(name, "ttft", rec[2] / 1e9, 1, rec[4])
    elif kind == NEXT:
        n = rec[3]
        yield TokenTiming(name, "itl", rec[2] / 1e9 / n, n, rec[4])
    elif kind == TIMELINE:
        # The first chunk is the TTFT (one observation, whatever its size); each later chunk of n tokens
        # arriving `gap` after the previous one is n inter-token observations of gap / n.
        _, _, start, times, sizes, upto = rec
        if upto <= 0:
            return
        yield TokenTiming(name, "ttft", (times[0] - start) / 1e9, 1, times[0])
        if upto == 1:
            return
        if sizes is None:  # one token a step
            ends = times[1:upto]
            yield TokenRun(name, [(t - prev) / 1e9 for prev, t in zip(times, ends)], None, ends)
            return
        seconds: list[float] = []
        weights: list[int] = []
        ends = []
        prev = times[0]
        for i in range(1, upto):
            t = times[i]
            n = sizes[i]
            if n > 0:
                seconds.append((t - prev) / 1e9 / n)
                weights.append(n)
                ends.append(t)
                prev = t
        if seconds:
            yield TokenRun(name, seconds, weights, ends)
    else:
        yield done_event(rec)


def done_event(rec: tuple[Any, ...]) -> RequestDone:
    """The one event a ``DONE`` record stands for, every request's last: the resolver takes it without a generator
    (``GenerationTracker.drain``), built as a plain tuple of its class (a NamedTuple's ``__new__`` is a Python call)."""
    counts, _, duration_ns, output, end, outcome, prompt = rec
    return _tuple_new(RequestDone, (counts.name, outcome, duration_ns / 1e9, prompt, output, end))


_tuple_new = tuple.__new__


def advance(counter: itertools.count[int], n: int, *more: itertools.count[int]) -> None:
    """Advance an itertools.count (and ``more``, each as many) by n in C, in one call (each step atomic; other
    threads' steps may interleave)."""
    _discard(zip(range(n), counter, *more) if more else _islice(counter, n))


#: Consumes an iterator in C, keeping nothing: one zero-length deque for every call (making one a call cost ~0.3 µs
#: more in a tight loop and ~4 µs in situ, between two forwards of a model). extend() holds the GIL throughout.
_discard: Callable[[Iterator[Any]], None] = collections.deque(maxlen=0).extend
_islice = itertools.islice


def check_name(name: Any, what: str = "generation name") -> None:
    """A generation name (or ``what`` else takes this rule: a request span's): the ``model`` label on every render
    (ConfigError otherwise, naming ``what``)."""
    # The same rule as Monitor._new_state: the name is the ``model`` label on every render.
    if not isinstance(name, str) or not name or len(name) > 128:
        raise ConfigError(f"{what} {name!r}: expected a non-empty string of at most 128 characters")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        ok = False
    else:
        ok = name.isprintable()
    if not ok:
        raise ConfigError(f"{what} {name!r}: expected printable characters that encode as UTF-8 "
                          "(no control characters, no lone surrogates)")


def check_prompt(prompt_tokens: Any) -> int:
    """A prompt token count: an integer >= 0 (ConfigError otherwise)."""
    try:
        if isinstance(prompt_tokens, bool):
            raise TypeError
        v = operator.index(prompt_tokens)
    except TypeError:
        raise ConfigError(f"prompt_tokens={prompt_tokens!r}: expected an integer >= 0 or None") from None
    if v < 0:
        raise ConfigError(f"prompt_tokens={prompt_tokens!r}: expected an integer >= 0 or None")
    return v


def prompt_or_none(prompt_tokens: Any, internal: Any) -> int | None:
    """``check_prompt``'s count, or None for a bad one, counted in ``internal`` (an ``InternalErrors``, stage
    ``generation``): the request path never raises."""
    try:
        return check_prompt(prompt_tokens)
    except ConfigError as exc:
        internal.report("generation", exc)
        return None
