"""Which calls get timed: 1 in N steady-state calls, a floor for low traffic, every cold call.

The request thread compares its call index with ``next_index`` (one integer comparison); only a
call that is timed asks the sampler for the following index. The floor is enforced from the
background: when a model has had no timed call for ``floor_seconds``, the resolver sets its
``next_index`` to 0 so its next call is timed. The request thread never reads a clock to decide.
"""

from __future__ import annotations

import random

__all__ = ["Sampler"]


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
