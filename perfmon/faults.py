"""Internal faults: everything that goes wrong inside the agent ends here, never in a request.

``report`` runs wherever the fault happened (possibly a request thread): it counts exactly and
queues a note; the background thread logs each (stage, exception class) once, so a fault that
repeats on every call neither floods the log nor costs a log write per request.
"""

from __future__ import annotations

import collections
import itertools
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["InternalErrors", "count_value"]


def count_value(counter: itertools.count[int]) -> int:
    """The next value an ``itertools.count`` would return, without advancing it.

    itertools.count is the hot path's exact, lock-free counter (``next()`` is one atomic C call
    under the GIL); it has no read accessor, but its repr is documented as ``count(N)``.
    """
    return int(repr(counter)[6:-1])


class InternalErrors:
    """Counts of agent faults by stage, and the once-per-kind log queue."""

    def __init__(self) -> None:
        self._counts: dict[str, itertools.count[int]] = {}
        self._lock = threading.Lock()
        # Bounded: if the logger falls behind, the oldest notes go; the counts stay exact.
        self._notes: collections.deque[tuple[str, BaseException]] = collections.deque(maxlen=64)
        self._logged: set[tuple[str, str]] = set()
        #: Warnings about the workload, not faults (``notice``): logged, never counted.
        self._notices: collections.deque[tuple[str, dict[str, Any]]] = collections.deque(maxlen=64)

    def reset_after_fork(self) -> None:
        """In a forked child: the parent's faults are the parent's; a lock held at fork() is replaced."""
        self._counts = {}
        self._lock = threading.Lock()
        self._notes = collections.deque(maxlen=64)
        self._logged = set()
        self._notices = collections.deque(maxlen=64)

    def notice(self, event: str, **fields: Any) -> None:
        """Queue a warning about the workload that is no fault of the agent's (a model's signatures churned): logged
        at warning level by the background thread, not counted in ``perfmon_internal_errors_total``, which operators
        read as perfmon's own faults. Callers raise each notice once (a state change); never raises."""
        try:
            self._notices.append((event, fields))
        except Exception:  # pragma: no cover - nothing left to report to
            pass

    def report(self, stage: str, exc: BaseException) -> None:
        """Count one fault of ``stage``; never raises."""
        try:
            c = self._counts.get(stage)
            if c is None:
                with self._lock:
                    c = self._counts.setdefault(stage, itertools.count())
            next(c)
            self._notes.append((stage, exc))
        except Exception:  # pragma: no cover - nothing left to report to
            pass

    def counts(self) -> Iterator[tuple[str, int]]:
        """(stage, total) pairs."""
        for stage, c in list(self._counts.items()):
            yield stage, count_value(c)

    def total(self) -> int:
        return sum(n for _, n in self.counts())

    def log_new(self, log: Any) -> None:
        """Log faults of a kind not logged before, and the notices (background thread only)."""
        while self._notices:
            try:
                event, fields = self._notices.popleft()
            except IndexError:
                break
            log.warning(event, **fields)
        while self._notes:
            try:
                stage, exc = self._notes.popleft()
            except IndexError:
                return
            kind = (stage, type(exc).__name__)
            if kind in self._logged:
                continue
            if len(self._logged) < 1024:
                self._logged.add(kind)
            log.error("internal_error", stage=stage, error=type(exc).__name__, detail=str(exc)[:500],
                      note="counted in perfmon_internal_errors_total; logged once per stage and kind")
