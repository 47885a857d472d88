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

#: Exceptions torch raises through a module's forward as control flow, never to the user: non-reentrant activation
#: checkpointing (``torch.utils.checkpoint``, ``use_reentrant=False``) re-runs a forward in backward and stops it with
#: this once the activations it needs are recomputed. Matched by module and name (perfmon imports no checkpointing).
_CONTROL_FLOW = frozenset({("torch.utils.checkpoint", "_StopRecomputationError")})


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
        """The counter for a class ``by_class`` does not hold yet (the first exception of its class); one counted
        nowhere for torch's control-flow exceptions (``_CONTROL_FLOW``): the call is counted, it is not an error."""
        with self._lock:
            if (getattr(cls, "__module__", None), cls.__name__) in _CONTROL_FLOW:
                discard = self.by_class[cls] = itertools.count()
                return discard
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
