"""The user's own exceptions of one model, counted exactly by class name.

The request thread counts an exception with one dict lookup by class and one ``next()``; a class not
seen before takes a lock once. Names are capped (``max_exception_labels``): past the cap, new classes
count under ``other``, so a model raising many distinct classes cannot grow the label set without bound.
"""

from __future__ import annotations

import itertools
import threading

from ..faults import count_value

__all__ = ["ErrorCounts"]

_OTHER = "other"


class ErrorCounts:
    """One model's exceptions by class name (the ``exception`` label of ``perfmon_forward_errors_total``)."""

    __slots__ = ("_lock", "_max", "_names", "by_class")

    def __init__(self, max_labels: int) -> None:
        """``max_labels``: distinct class names kept; further classes count as ``other``."""
        #: Exception class -> its name's counter: the request thread's lookup (bounded: ``counter``).
        self.by_class: dict[type, itertools.count[int]] = {}
        self._names: dict[str, itertools.count[int]] = {}
        self._lock = threading.Lock()
        self._max = max_labels

    def counter(self, cls: type) -> itertools.count[int]:
        """The counter for a class ``by_class`` does not hold yet (the first exception of its class)."""
        with self._lock:
            names = self._names
            name = cls.__name__
            counter = names.get(name)
            if counter is None:
                if len(names) >= self._max:
                    name = _OTHER
                counter = names.setdefault(name, itertools.count())
            # Bounded too: beyond this, unseen classes take the lock path (errors are rare anyway).
            if len(self.by_class) < 4 * self._max:
                self.by_class[cls] = counter
            return counter

    def counts(self) -> dict[str, int]:
        """Exceptions so far by class name (``other`` past the cap)."""
        return {name: count_value(c) for name, c in list(self._names.items())}
