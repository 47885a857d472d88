"""A histogram family as perfmon's store holds it: one row of plain numbers per label set, samples only on demand.

At the documented limits (64 models and 64 generation names) a scrape holds ~19,000 sample lines, ~17,000
of them histogram buckets. Built the prometheus_client way, each line is a ``Sample`` with a label dict,
made at every scrape and then formatted label by label: ~100 ms of GIL-holding Python a scrape on this
project's machine, which the agent's 1%-of-a-core budget (``http_cpu_budget``) refills only every 10 s.
``HistogramRows`` keeps the rows instead; the encoders (``exposition.py``: text and OpenMetrics,
``promproto.py``: protobuf) read them directly, and what they derive from a series' labels (its line
template) is made once and kept with the series (``HistogramRow.cache``). Anything else that reads
``samples`` (``get_sample_value``, another encoder) gets exactly the samples ``HistogramMetricFamily``
would have made.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, NamedTuple

from prometheus_client.core import Metric
from prometheus_client.samples import Exemplar, Sample

from .native import NativeSnapshot

__all__ = ["HistogramRow", "HistogramRows"]

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


class HistogramRow(NamedTuple):
    """One label set's histogram, copied under the store's lock at scrape time."""

    #: Label values, in the family's label order.
    labels: tuple[str, ...]
    #: Finite upper bounds (the unit of the histogram, e.g. seconds), ascending; +Inf is implied.
    bounds: tuple[float, ...]
    #: The ``le`` strings of ``bounds`` then "+Inf", formatted once by the store.
    les: tuple[str, ...]
    #: Observations per bucket (not cumulative), +Inf last: ``len(les)`` ints.
    counts: list[int]
    #: Sum of the observed values (the histogram's unit).
    sum: float
    #: The latest exemplar per bucket (None where there is none), or None when the series has none at all.
    exemplars: list[Exemplar | None] | None
    #: Exponential buckets for the protobuf exposition, or None (classic buckets only).
    native: NativeSnapshot | None
    #: What the encoders derive from the labels alone (the exposition's line template, ``"lines"``), made at
    #: the series' first scrape and kept by the store with the series: its label values never change.
    cache: dict[str, Any]


class HistogramRows(Metric):
    """A histogram family built from ``HistogramRow``s (``add_row``); ``samples`` are made when first read."""

    def __init__(self, name: str, documentation: str, labels: Sequence[str]) -> None:
        # Legacy names only (perfmon's own are): the encoders write them as they are, unquoted, unescaped.
        if not _NAME.fullmatch(name) or not all(_LABEL.fullmatch(k) and k != "le" for k in labels):
            raise ValueError(f"HistogramRows takes legacy metric and label names (no 'le'): {name!r} {list(labels)!r}")
        self.rows: list[HistogramRow] = []
        self._samples: list[Sample] = []
        self._made = 0  # rows already turned into samples
        super().__init__(name, documentation, "histogram")
        self.labelnames = tuple(labels)

    def add_row(self, row: HistogramRow) -> None:
        self.rows.append(row)

    @property  # type: ignore[override]
    def samples(self) -> list[Sample]:
        """The samples ``HistogramMetricFamily.add_metric`` would have made for the rows (made once)."""
        for row in self.rows[self._made:]:
            self._samples.extend(_samples(self.name, self.labelnames, row))
        self._made = len(self.rows)
        return self._samples

    @samples.setter
    def samples(self, value: list[Sample]) -> None:
        # Metric.__init__ assigns []; anything assigned replaces what the rows would have made.
        self._samples = value
        self._made = len(self.rows)


def _samples(name: str, labelnames: tuple[str, ...], row: HistogramRow) -> list[Sample]:
    """As ``HistogramMetricFamily.add_metric``: cumulative ``_bucket`` samples, then ``_count`` and ``_sum``."""
    out = []
    total = 0
    base = list(zip(labelnames, row.labels))
    exemplars = row.exemplars
    for i, (le, n) in enumerate(zip(row.les, row.counts)):
        total += n
        out.append(Sample(name + "_bucket", dict([*base, ("le", le)]), float(total), None,
                          exemplars[i] if exemplars is not None else None))
    if row.les and float(row.les[0]) >= 0:  # as add_metric: no sum and count with negative buckets
        out.append(Sample(name + "_count", dict(base), float(total), None))
        out.append(Sample(name + "_sum", dict(base), row.sum, None))
    return out
