"""Request spans' series: exact counts read from the tracker at scrape time, histograms fed by its drain.

``observe`` is the tracker's sink (resolver thread); the histograms are perfmon's own store, as for
forwards and generation requests (``store._Histogram``, rendered as ``HistogramRows``).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from ..agent.requests import PARTS, RequestDone, RequestTracker
from ..agent.streams import OUTCOMES
from ..faults import count_value
from .catalog import METRICS, REQUEST_HISTOGRAMS, _family
from .family import HistogramRows
from .store import _Histogram, _le

__all__ = ["RequestCollector"]

_PARTS = "perfmon_request_seconds"
_DURATION = "perfmon_request_duration_seconds"


class RequestCollector(Collector):
    """``perfmon_requests_total{model, outcome}``, ``perfmon_request_seconds{model, part}`` and
    ``perfmon_request_duration_seconds{model}``."""

    def __init__(self, tracker: RequestTracker) -> None:
        self._tracker = tracker
        self._les = {name: tuple(_le(b) for b in (*bounds, math.inf)) for name, bounds in REQUEST_HISTOGRAMS.items()}
        self._hists: dict[tuple[str, tuple[str, ...]], _Histogram] = {}  # (metric, label values)
        self._lock = threading.Lock()

    def reset_after_fork(self) -> None:
        self._hists = {}
        self._lock = threading.Lock()

    def _hist(self, name: str, labels: tuple[str, ...]) -> _Histogram:
        """Lock held."""
        h = self._hists.get((name, labels))
        if h is None:
            h = self._hists[(name, labels)] = _Histogram(REQUEST_HISTOGRAMS[name], self._les[name])
        return h

    def observe(self, batch: list[RequestDone]) -> None:
        """Sink: a batch of ended requests into the histograms (resolver thread)."""
        with self._lock:
            for model, _end, total, *parts in batch:
                self._hist(_DURATION, (model,)).observe(total)
                for part, seconds in zip(PARTS, parts, strict=True):
                    self._hist(_PARTS, (model, part)).observe(seconds)

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        requests = _family("perfmon_requests_total")
        for c in self._tracker.names():
            for outcome in OUTCOMES:
                requests.add_metric([c.name, outcome], count_value(c.requests[outcome]))
        yield requests
        with self._lock:
            rows = [(name, h.row(labels)) for (name, labels), h in sorted(self._hists.items())]
        for name, labels in ((_PARTS, ["model", "part"]), (_DURATION, ["model"])):
            fam = HistogramRows(name, METRICS[name][3], labels=labels)
            for row_name, row in rows:
                if row_name == name:
                    fam.add_row(row)
            yield fam
