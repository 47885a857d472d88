"""Which calls get timed: 1 in N steady-state calls, a floor for low traffic, every cold call.

The request thread compares its call index with ``next_index`` (one integer comparison); only a
call that is timed asks the sampler for the following index. The floor is enforced from the
background: when a model has had no timed call for ``floor_seconds``, the resolver sets its
``next_index`` to 0 so its next call is timed. The request thread never reads a clock to decide.
"""

from __future__ import annotations

import itertools
import random

__all__ = ["CallSampler", "Sampler"]


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
        every = self.every
        if every == 1:
            return index + 1
        return index + 1 + int(self._random() * (2 * every - 1))

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

    def __init__(self, rate: float, floor_seconds: float, *, seed: int | None = None) -> None:
        self._sampler = Sampler(rate, floor_seconds, seed=seed)
        self._calls = itertools.count()
        self._next = 0
        self._last_ns: int | None = None

    def due(self, now_ns: int) -> bool:
        """Whether the call starting at ``now_ns`` (``perf_counter_ns``) is timed."""
        index = next(self._calls)
        last = self._last_ns
        if index >= self._next or last is None or self._sampler.floor_due(last, now_ns):
            self._next = self._sampler.next_index(index)
            self._last_ns = now_ns
            return True
        return False
