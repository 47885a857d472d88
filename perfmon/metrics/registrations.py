"""What perfmon put on a prometheus_client registry, so that a closed Monitor can take it off again.

A Monitor may share a registry with the application (``prometheus_client.REGISTRY``, served by the app's own
``/metrics``). Its collectors then outlive it unless something remembers them: a second Monitor on that registry
(the next test of a suite, a notebook cell run again) would collide with every name. ``Registrations`` is what
perfmon registers through: it keeps each collector it registered, ``close()`` unregisters them, and a name already
taken is refused with an error that says which Monitor to close, rather than prometheus_client's bare
"Duplicated timeseries".
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import CollectorRegistry

from ..exceptions import ConfigError

__all__ = ["Registrations"]


class Registrations:
    """Registers collectors on ``registry`` and remembers them (``close`` unregisters them)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._mine: list[Any] = []
        self._lock = threading.Lock()
        #: True once ``close()`` ran: nothing is registered any more.
        self.closed = False

    def register(self, collector: Any) -> None:
        """Register ``collector``; ``ConfigError`` (a ValueError) if one of its names is already on the registry."""
        with self._lock:
            if self.closed:
                raise ConfigError("perfmon: this Monitor was closed; make a new one")
            try:
                self.registry.register(collector)
            except ValueError as exc:
                # prometheus_client's DuplicateTimeseries (a ValueError) holds the names taken since 0.21.
                taken = sorted(getattr(exc, "duplicates", None) or [str(exc)])
                shown = ", ".join(taken[:4]) + (f" and {len(taken) - 4} more" if len(taken) > 4 else "")
                raise ConfigError(
                    f"perfmon: the registry already holds {shown}: another Monitor registered them there (close() "
                    "that Monitor first) or the application did; otherwise give this Monitor its own registry "
                    "(registry=...)") from exc
            self._mine.append(collector)

    def refuse(self) -> None:
        """From now on ``register`` is refused and ``closed`` reads True (``close`` to come: a monitor closing)."""
        with self._lock:
            self.closed = True

    def close(self) -> int:
        """Unregister every collector registered through this; returns how many. Idempotent."""
        with self._lock:
            self.closed = True
            mine, self._mine = self._mine, []
        for collector in reversed(mine):
            try:
                self.registry.unregister(collector)
            except KeyError:
                pass  # the application unregistered it itself
        return len(mine)
