"""Which calls get timed: 1 in N steady-state calls, a floor for low traffic, every cold call.

The request thread compares its call index with ``next_index`` (one integer comparison); only a
call that is timed asks the sampler for the following index. The floor is enforced from the
background: when a model has had no timed call for ``floor_seconds``, the resolver sets its
``next_index`` to 0 so its next call is timed. The request thread never reads a clock to decide.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

__all__ = ["EVERY_STEP", "TIMELINE", "CallSampler", "Sampler"]


class Sampler:
    """1-in-N sampling with a random phase and a jittered stride.

    A fixed stride aliases with periodic traffic (a server that alternates two batch shapes with
    N even would only ever time one of them), so each gap is drawn uniformly from 1 .. 2N-1:
    the mean stays N, i.e. the configured rate.
    """

    def __init__(self, rate: float, floor_seconds: float, *, seed: int | None = None) -> None:
        self.rate = rate
        self.every = max(1, round(1.0 / rate))
        self.floor_ns = int(floor_seconds * 1e9)
        self._random = random.Random(seed).random

    def first_index(self, warmup_calls: int) -> int:
        """The first steady-state call to time: a random phase after the warm-up calls."""
        return warmup_calls + int(self._random() * self.every)

    def next_index(self, index: int) -> int:
        """The call to time after timing call ``index``."""
        return index + self.gap()

    def gap(self) -> int:
        """A gap to the next call to time (calls, >= 1): uniform over 1 .. 2N-1, so its mean is N.

        ``ModelState`` draws it after a timed call and adds it at the next one: before a timed call's start stamp
        the request thread does an addition, not a draw (BENCHMARKS §3b, "Before the start stamp")."""
        every = self.every
        if every == 1:
            return 1
        return 1 + int(self._random() * (2 * every - 1))

    def gaps(self, n: int) -> Iterator[int]:
        """``n`` gaps drawn as ``gap`` draws them, to be taken one by one with ``next()`` (a C call, where ``gap`` is
        a Python frame: a timed call's cold cost after its end stamp, docs/design.md "After the end stamp")."""
        every = self.every
        if every == 1:
            return itertools.repeat(1, n)
        draw, width = self._random, 2 * every - 1
        return iter([1 + int(draw() * width) for _ in range(n)])

    def floor_due(self, last_sample_ns: int, now_ns: int) -> bool:
        """True when the model has gone ``floor_seconds`` without a timed call."""
        return now_ns - last_sample_ns >= self.floor_ns


class CallSampler:
    """Which of a model's own ``generate()`` calls get their tokens timed: the first, then 1 in N with the
    ``Sampler``'s jittered stride, and at least one per ``floor_seconds``.

    Asked once per call on the request thread (a counter, compares): a call, not a step, so the floor compares
    the call's own clock read rather than waiting for the resolver. Unlocked: two threads racing may time one
    call more or one fewer, never change a count.
    """

    # Slots: the reads a call makes are slot reads, not an instance dict's lookups (each ~0.3 µs in situ).
    __slots__ = ("_sampler", "calls", "every", "floor_ns", "last_ns", "next")

    def __init__(self, rate: float, floor_seconds: float, *, seed: int | None = None, every: int = 0) -> None:
        """``every``: ``pick`` also says which calls have every step timed: the first, then one in ``every``
        (a fixed stride: the share of the model's forwards that are timed stays ``1/every``)."""
        self._sampler = Sampler(rate, floor_seconds, seed=seed)
        #: The calls so far (``next()``: a call's index), the every-step stride and the floor (ns): fixed.
        self.calls = itertools.count()
        self.every = every if every > 0 else 1 << 62  # 0: only the first call (index 0)
        self.floor_ns = self._sampler.floor_ns
        #: The next call whose tokens are timed, and when the last one started (``perf_counter_ns``).
        self.next = 0
        self.last_ns = -self.floor_ns  # the first call is due

    def pick(self, now_ns: int) -> int:
        """One decision for the call starting at ``now_ns`` (``perf_counter_ns``): 0 (counted, not timed),
        ``TIMELINE`` (its tokens timed) or ``TIMELINE | EVERY_STEP`` (its tokens and every forward timed). One
        counter and three compares, on the request thread between two calls of the model, where every object
        touched costs ~0.3-1 µs (BENCHMARKS §3b): the floor is compared here, not asked of the Sampler. A caller
        on the request path may take the same test inline (its frame costs ~2 µs in situ) and ask ``due`` only
        for a call it finds due."""
        index = next(self.calls)
        if index % self.every and index < self.next and now_ns - self.last_ns < self.floor_ns:
            return 0
        return self.due(index, now_ns)

    def due(self, index: int, now_ns: int) -> int:
        """Call ``index``, starting at ``now_ns``, is due (``pick``'s test failed): the next index drawn; what it
        times."""
        self.next = self._sampler.next_index(index)
        self.last_ns = now_ns
        return TIMELINE | EVERY_STEP if index % self.every == 0 else TIMELINE


#: ``CallSampler.pick``: the call's tokens are timed (TTFT, inter-token latency) ...
TIMELINE = 1
#: ... and every forward of it too.
EVERY_STEP = 2
