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
span after a quiet spell is resolved at once; arming a capture and opening the status page wake it too. A wake that
ends a doze lingers: the thresholds stay at one for the next ``LINGER_WAKES`` wakes (or until a wait times out with
nothing come), since the request that ended it queues more as it ends (its generation's TTFT/ITL record, its span),
which would otherwise wait for the next tick, a full second after the woken pass (a helper measured ~1.0 s each,
against 0-1 s at the old cadence); then the usual cadence resumes. At most that many wakes more per doze.
No ramp: a record ends a doze at once, so dozing early costs at most one wake more a quiet pass.
What is seen later while dozing, up to ``doze_seconds``: a parameter moved without ``.to()`` (the device re-read), a
fault's first log line, and the GC pauses of collections that began during the doze (the collection hook takes no lock,
so it cannot wake the thread; its ring holds 8 s of them at 4,096 a second); nothing a user's call produces. A GC
pause is work: a pass that drained one is not quiet, so while the process collects the cadence stays a second.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from time import perf_counter_ns

from ..faults import InternalErrors

__all__ = ["LINGER_WAKES", "Doze", "Dozer"]

#: Wakes after a doze's end for which every record queue's first record still wakes the resolver (``Doze.woke``).
LINGER_WAKES = 3

#: A record queue's switch: ``dozer(True)`` makes its first record wake the resolver and says whether a record waits
#: already; ``dozer(False)`` restores its usual threshold (a quarter of the queue).
Dozer = Callable[[bool], bool]


class Doze:
    """Whether the last pass was quiet and the sleep that earns; the record queues' thresholds while it lasts."""

    def __init__(self, dozers: Iterable[Dozer], *, internal: InternalErrors, seconds: float = 8.0) -> None:
        #: The longest sleep once dozing (seconds).
        self.seconds = seconds
        self.dozers = list(dozers)
        #: Whether the last pass found nothing to do and had no work due within the idle cadence (it earns a doze).
        self.quiet = False
        #: Whether every record queue's first record wakes the thread now (it dozes past its idle cadence, or lingers
        #: after a doze's end).
        self.dozing = False
        #: Wakes left for which the thresholds stay at one (``LINGER_WAKES`` after a doze ends by a wake).
        self.linger = 0
        self._long = False  # whether the current sleep is a doze (past the idle cadence)
        self._internal = internal

    def passed(self, quiet: bool) -> None:
        """A pass ended; ``quiet``: it found nothing to do and nothing falls due within the idle cadence."""
        self.quiet = quiet

    def sleep(self, idle_seconds: float, interval: float, floor_due: int | None, tick_due: int | None) -> float:
        """Seconds to sleep with nothing in flight: ``idle_seconds``, or ``seconds`` after a quiet pass, ending at
        the sooner of ``floor_due`` (a sampling floor; one just past: ``interval``, to arm it now) and ``tick_due``
        (the housekeeping's next work, perf_counter_ns; one past is work the pass did: the idle cadence), at least
        ``interval``. Past ``idle_seconds`` it dozes: the record queues wake the thread on their first record."""
        sleep = max(self.seconds, idle_seconds) if self.quiet else idle_seconds
        now = perf_counter_ns()
        if tick_due is not None:
            sleep = min(sleep, (tick_due - now) / 1e9 if tick_due > now else idle_seconds)
        if floor_due is not None:
            sleep = min(sleep, (floor_due - now) / 1e9)
        sleep = max(interval, sleep)
        if sleep > idle_seconds or self.linger > 0:
            if self.set(True):
                self.set(False)  # a record came in between the pass and the threshold: drain it now
                return interval
            self._long = sleep > idle_seconds
        return sleep

    def woke(self, woken: bool) -> None:
        """The thread woke from a sleep with the thresholds at one (``dozing``): put them back. ``woken``: by a wake
        (a record, a capture armed, a reader), not the sleep's end. A doze ended by one lingers for ``LINGER_WAKES``
        wakes; a lingering wait uses one, and one that ran out with nothing come ends the lingering."""
        self.set(False)
        if not woken:
            self.linger = 0
        elif self._long:
            self.linger = LINGER_WAKES
        else:
            self.linger = max(0, self.linger - 1)

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
        """Awake, no quiet pass, every threshold back (a forked child, a stopped thread: even one that forked
        or stopped inside ``set``)."""
        self.quiet = False
        self.linger = 0
        self.set(False)
