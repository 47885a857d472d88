"""When a poller polls, and the thread that does: planned on its readers' reads, so that a reading is taken for
someone.

A poll that nobody reads is pure cost (for NVML, a GIL hand-off per call that a GIL-bound serving thread pays), and
a reading read long after it was taken is stale. ``PollPlan`` keeps the last few read times and says when the next
poll is due (times are seconds of the poller's monotonic clock):

* a steady reader (the latest gaps between reads, at least two, each within 10% of their median and within half
  of ``LEAD_SECONDS``; a period longer than the interval: a Prometheus scraping every 15 s): one poll
  ``lead_seconds(period)`` before each read is due (``LEAD_SECONDS`` and the slack a steady reader's gaps may
  have: a read early by that slack still finds its poll made), and never two closer than the interval; the reading
  a 15 s scrape renders is 1.5 s old. A reader that changes its rhythm may find one read's poll not yet made and
  gets the reading before (at most a period older); the poll follows at once;
* readers with no steady period (an HA pair of Prometheus servers, a status page open beside a scrape, reads
  faster than the interval): a poll every interval, so a reading is never older than that;
* nobody reading for three periods of a steady reader (a minute while no period is known): a poll every
  ``IDLE_POLL_SECONDS`` (or every interval, if longer). The first read after that brings the next poll to now.

``PollThread`` runs a poll function on a daemon thread by that plan, backing off while the poll fails.
``perfmon.testing.DrivenPoller`` runs the NVML poller on it with a hand-driven clock.
"""

from __future__ import annotations

import itertools
import math
import statistics
import threading
from collections import deque
from collections.abc import Callable

from ..backoff import backoff_seconds

__all__ = ["IDLE_POLL_SECONDS", "LEAD_SECONDS", "MAX_BACKOFF_SECONDS", "PollPlan", "PollThread", "lead_seconds"]

#: Seconds between polls while nobody reads: enough to keep a liveness gauge (``perfmon_nvml_up``) honest and the
#: first reading a new reader gets at most a minute old.
IDLE_POLL_SECONDS = 60.0

#: Seconds before a steady reader's next read that its poll is made (at most half the reader's period): an NVML poll
#: takes about a millisecond a GPU on a quiet host and tens of milliseconds when a serving thread holds the GIL (each
#: call waits for a forced switch to take the GIL back).
LEAD_SECONDS = 1.0

#: The longest wait between tries while the poll fails (seconds).
MAX_BACKOFF_SECONDS = 60.0

#: Read times kept to find a steady reader's period.
_READS_KEPT = 8

#: How far a gap between reads may stray from their median (a fraction of it, and at most half of ``LEAD_SECONDS``)
#: for the reader to count as steady: Prometheus scrapes a target on a fixed schedule, and where in the scrape the
#: read falls moves by milliseconds. A read early by more than the lead would find its poll not yet made.
_STEADY_TOLERANCE = 0.1


class PollPlan:
    """The read times of a poller's readers and the poll they call for; ``read`` and ``next_poll`` may be called
    from different threads. ``interval_seconds`` is the shortest time between polls and the oldest reading a
    reader with no steady period gets."""

    def __init__(self, *, interval_seconds: float) -> None:
        self.interval = interval_seconds
        self._lock = threading.Lock()
        self._reads: deque[float] = deque(maxlen=_READS_KEPT)  # clock readings of the last reads

    def read(self, now: float) -> None:
        """A reader read the latest reading at ``now``."""
        with self._lock:
            self._reads.append(now)

    def next_poll(self, now: float, last_poll: float) -> float:
        """The clock reading at which the next poll is due, the last one having begun at ``last_poll``."""
        with self._lock:
            reads = list(self._reads)
        period = _steady_period(reads)
        if not reads or now - reads[-1] > self._quiet_after(period):
            return last_poll + max(IDLE_POLL_SECONDS, self.interval)
        if period is None or period <= self.interval:
            return last_poll + self.interval
        # The first read expected after the one the last poll was for (reads[-1] + k periods), less the lead.
        lead = lead_seconds(period)
        k = max(1, int((last_poll + lead / 2 + lead - reads[-1]) // period) + 1)
        return max(last_poll + self.interval, reads[-1] + k * period - lead)

    def _quiet_after(self, period: float | None) -> float:
        """Seconds without a read after which nobody counts as reading: three periods of a steady reader (or three
        intervals); with no steady period, a minute (or three intervals, if longer)."""
        if period is None:
            return max(3 * self.interval, IDLE_POLL_SECONDS)
        return 3 * max(period, self.interval)

    def reset(self) -> None:
        """Forget every read (a forked child starts with none). A new lock, not the old one taken: in a child
        forked while another thread held it, it stays held for good."""
        self._lock = threading.Lock()
        self._reads = deque(maxlen=_READS_KEPT)


class PollThread:
    """Runs ``poll`` (True when it succeeded; it must not raise) on a daemon thread named ``name`` whenever a poll
    is due, by ``clock`` (monotonic seconds) and the reads (``read()``, a ``PollPlan``); sleeps in between, and is
    woken only by ``stop()`` or a read that brings the next poll forward. While the poll fails, the next try is two
    intervals after the first failure, doubling, capped at ``MAX_BACKOFF_SECONDS``, readers or not. ``woke`` is
    called at each wake (the agent's wake counter)."""

    def __init__(self, poll: Callable[[], bool], *, interval_seconds: float, clock: Callable[[], float], name: str,
                 woke: Callable[[], None] = lambda: None) -> None:
        self._poll = poll
        self.interval = interval_seconds
        self._clock = clock
        self._name = name
        self._woke = woke
        self._plan = PollPlan(interval_seconds=interval_seconds)
        self.reset()

    def reset(self) -> None:
        """Forget every read and poll (a forked child: no thread, nothing polled yet)."""
        self._plan.reset()
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by stop() and by a read that brings the next poll forward
        self._thread: threading.Thread | None = None
        self._planned = math.inf  # clock() the thread sleeps until
        self._last_poll: float | None = None  # clock() when the last poll began
        self._failures = 0
        self._retry_at = 0.0  # clock() of the next try while the poll fails

    def start(self, polled_at: float, ok: bool = True) -> None:
        """Start the thread, a poll having begun at ``polled_at`` (the caller's first, made before; ``ok``: whether it
        succeeded, so that a failing start backs off from its first try)."""
        self._last_poll = polled_at
        self._failed(ok, polled_at)
        self._stop.clear()
        self._wake.clear()
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def stop(self, timeout_seconds: float) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_seconds)
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def read(self) -> None:
        """A reader read the latest reading now; wakes the thread when that brings the next poll forward (e.g. the
        first read after a quiet spell: a poll at once, so the next read is fresh)."""
        now = self._clock()
        self._plan.read(now)
        if self._thread is not None and self.next_poll(now) < self._planned:
            self._wake.set()

    def _run(self) -> None:
        delay = self._plan_next()
        while True:
            self._wake.wait(max(delay, 0.0))
            self._wake.clear()
            if self._stop.is_set():  # checked after the clear: a stop() after it leaves its wake set
                return
            self._woke()
            delay = self.tick()

    def tick(self) -> float:
        """Poll if one is due; returns seconds until the next one is due (the thread sleeps that long)."""
        now = self._clock()
        if now < self.next_poll(now):
            return self._plan_next()
        self._last_poll = now
        self._failed(self._poll(), self._clock())
        return self._plan_next()

    def _plan_next(self) -> float:
        """Plan the next poll; seconds until it. ``_planned`` is cleared first: a read landing while the plan is
        made then wakes the thread (a spare tick at most) rather than being left out of the plan it compares with."""
        self._planned = math.inf
        now = self._clock()
        planned = self._planned = self.next_poll(now)
        return max(planned - now, 0.0)

    def _failed(self, ok: bool, now: float) -> None:
        if ok:
            self._failures = 0
        else:
            self._failures += 1
            self._retry_at = now + backoff_seconds(self._failures, initial=2 * self.interval,
                                                   cap=MAX_BACKOFF_SECONDS)

    def next_poll(self, now: float) -> float:
        """The clock reading at which the next poll is due: the backoff's while failing, else the readers' plan."""
        if self._failures:
            return self._retry_at
        return now if self._last_poll is None else self._plan.next_poll(now, self._last_poll)


def _steady_period(reads: list[float]) -> float | None:
    """The period of reads (seconds): the median of the longest run of latest gaps (at least two) that are steady,
    each within ``_STEADY_TOLERANCE`` of their median and half of ``LEAD_SECONDS``; None when the last two are not.
    Only the latest run counts: reads from before a quiet spell or of a reader since gone do not blur the period."""
    gaps = [b - a for a, b in itertools.pairwise(reads)]
    for k in range(len(gaps), 1, -1):
        run = gaps[-k:]
        median = statistics.median(run)
        if median > 0 and all(abs(g - median) <= _slack(median) for g in run):
            return median
    return None


def _slack(period: float) -> float:
    """How far (seconds) a steady reader's gap may stray from its period."""
    return min(_STEADY_TOLERANCE * period, LEAD_SECONDS / 2)


def lead_seconds(period: float) -> float:
    """Seconds before a steady reader's next read (every ``period`` seconds) that its poll is made: ``LEAD_SECONDS``
    for the poll to finish, plus the slack its gaps may have; at most half the period."""
    return min(LEAD_SECONDS + _slack(period), period / 2)
