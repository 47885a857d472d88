"""Dozing: how long the resolver sleeps after a pass that found nothing to do.

On a GIL-bound server every wake of a background thread costs the serving thread a GIL hand-off, and an idle wake's
step runs cold (~140-300 µs after a second asleep, against ~7 µs warm: BENCHMARKS §3b). A wrapped model with traffic
gives the resolver work every second (samples, the sampling floor); an agent with nothing arriving (a replica between
bursts, a monitor whose models are unwrapped) should not wake each second to find nothing.

So after a quiet pass (nothing delivered, no records, items or GC pauses folded, no work due within
``idle_seconds``) it sleeps up to ``doze_seconds`` (8 s), and still wakes when the next work falls due: a detector
window closing, a baseline capture's look, a port retry, a status-page history point, a model's sampling floor.
Meanwhile every record queue wakes the thread on its first record instead of a quarter of the queue (``Dozer``: the
same compare on the request thread, against a threshold of one), so the first timed call, token record or request
span after a quiet spell is resolved at once and the usual cadence resumes; arming a capture and opening the status
page wake it too. No ramp: a record ends a doze at once, so dozing early costs at most one wake more a quiet pass.
What is seen later while dozing: a parameter moved without ``.to()`` (the device re-read) and a fault's first log
line, up to ``doze_seconds``; nothing a user's call produces (a GC pause is work: a pass that drained one is not quiet,
so the pause ring, 4,096, fills no faster than before).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from time import perf_counter_ns

from ..faults import InternalErrors

__all__ = ["Doze", "Dozer"]

#: A record queue's switch: ``dozer(True)`` makes its first record wake the resolver and says whether a record waits
#: already; ``dozer(False)`` restores its usual threshold (a quarter of the queue).
Dozer = Callable[[bool], bool]


class Doze:
    """The quiet passes counted and the sleep they earn; the record queues' thresholds while it lasts."""

    def __init__(self, dozers: Iterable[Dozer], *, internal: InternalErrors, seconds: float = 8.0) -> None:
        #: The longest sleep once dozing (seconds).
        self.seconds = seconds
        self.dozers = list(dozers)
        #: Passes in a row that found nothing to do and had no work due within the idle cadence (one earns a doze).
        self.quiet_passes = 0
        #: Whether the thread sleeps past its idle cadence now (every record queue's first record wakes it).
        self.dozing = False
        self._internal = internal

    def passed(self, quiet: bool) -> None:
        """A pass ended; ``quiet``: it found nothing to do and nothing falls due within the idle cadence."""
        self.quiet_passes = self.quiet_passes + 1 if quiet else 0

    def sleep(self, idle_seconds: float, interval: float, dues: Iterable[int | None]) -> float:
        """Seconds to sleep with nothing in flight: ``idle_seconds``, or ``seconds`` after a quiet pass, ending at
        the soonest of ``dues`` (perf_counter_ns; one already past keeps the idle cadence), at least ``interval``.
        Past ``idle_seconds`` it dozes: the record queues wake the thread on their first record."""
        sleep = max(self.seconds, idle_seconds) if self.quiet_passes else idle_seconds
        now = perf_counter_ns()
        for due in dues:
            if due is not None:  # one past is work the pass just did (it said so): the usual cadence
                sleep = min(sleep, (due - now) / 1e9 if due > now else idle_seconds)
        sleep = max(interval, sleep)
        if sleep > idle_seconds and self.set(True):
            self.set(False)  # a record came in between the pass and the threshold: drain it now
            return interval
        return sleep

    def set(self, on: bool) -> bool:
        """Every record queue's wake threshold to its first record (on) or back; True if a record waits."""
        self.dozing = on
        waiting = False
        for dozer in self.dozers:
            try:
                waiting = dozer(on) or waiting
            except Exception as exc:  # that queue keeps a threshold it may not wake at: do not doze on it
                self._internal.report("resolver", exc)
                waiting = True
        return waiting

    def reset(self) -> None:
        """Awake, no quiet pass counted (a forked child, a stopped thread)."""
        self.quiet_passes = 0
        if self.dozing:
            self.set(False)
