"""A model's items, counted exactly: the rows its calls carry, or what its ``items`` callable says.

Through signatures (the default) a call adds nothing here: a signature's calls times its rows is summed
at scrape time (``SignatureTable.items``). Calls are queued here one by one (a deque append on the
request thread, folded in by the resolver or a scrape) only with an ``items`` callable, or once a
model's signatures churned and its calls' rows can no longer be read off a signature.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..faults import InternalErrors
    from .phases import SignatureTable

__all__ = ["ItemCounts"]


class ItemCounts:
    """One model's items and padded items (``perfmon_forward_items_total``, ``..._padded_items_total``)."""

    __slots__ = ("_internal", "_lock", "fn", "on", "padded", "padded_total", "q", "total")

    def __init__(self, fn: Callable[..., Any] | None, on: bool, internal: InternalErrors) -> None:
        """``fn``: the user's ``items`` callable, ``(args, kwargs) -> int | (effective, padded)``, or None (a call's
        items are its batch dimension, counted through signatures); ``on``: False when items are not counted;
        ``internal``: where a failing ``fn`` is counted."""
        self.fn = fn
        self.on = on
        self._internal = internal
        #: Per-call counts waiting to be folded in: an int, an (effective, padded) pair, or None; None while a
        #: model's items are counted through its signatures. The request thread appends (``count``, hot path).
        self.q: collections.deque[Any] | None = collections.deque() if fn is not None else None
        self._lock = threading.Lock()
        self.total = self.padded_total = 0
        #: True once the callable gave a padded count (the padded series is exported from then on).
        self.padded = False

    def per_call(self) -> None:
        """The model's signatures churned: count each call's rows from now on (its signatures no longer can)."""
        if self.fn is None and self.on:
            self.q = collections.deque()

    def reset_after_fork(self, through_signatures: bool) -> None:
        """In a forked child: nothing counted yet; ``through_signatures``: the child counts rows through its
        (fresh) signatures again, not call by call. In place: the hot path holds this object."""
        self._lock = threading.Lock()
        self.total = self.padded_total = 0
        if self.q is not None:
            self.q = None if (through_signatures and self.fn is None) else collections.deque()

    def count(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int | None:
        """Run the user's ``items`` callable; queue (effective, padded); never raises (faults are counted)."""
        try:
            value = self.fn(args, kwargs)  # type: ignore[misc]
            if isinstance(value, tuple):
                effective, padded = value
            else:
                effective, padded = value, None
            for v in (effective, padded):
                if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                    raise ValueError(f"items callable returned {value!r}: expected int >= 0 or (effective, padded)")
            if padded is not None and effective > padded:
                raise ValueError(f"items callable returned {value!r}: effective items exceed padded items")
        except Exception as exc:
            self._internal.report("items", exc)
            return None
        if padded is not None:
            self.padded = True
        self.q.append((effective, padded))  # type: ignore[union-attr]
        return int(effective)

    def drain(self) -> bool:
        """Fold queued per-call items into the totals (resolver housekeeping and scrapes); True if any were."""
        q = self.q
        if not q:
            return False
        effective = padded = 0
        while q:
            try:
                v = q.popleft()
            except IndexError:
                break
            if isinstance(v, tuple):
                effective += v[0]
                padded += v[1] if v[1] is not None else 0
            elif v is not None:
                effective += v
        with self._lock:
            self.total += effective
            self.padded_total += padded
        return True

    def counts(self, table: SignatureTable) -> tuple[int | None, int | None]:
        """(items, padded items) so far, exact, ``table``'s signatures included; None where not counted."""
        self.drain()
        if not self.on:
            return None, None
        with self._lock:
            items, padded = self.total, self.padded_total
        if self.fn is None:
            return items + table.items(), None
        return items, (padded if self.padded else None)
