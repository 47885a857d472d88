"""Exponential (native histogram) bucket counts, kept beside the classic buckets for protobuf scrapes.

Prometheus native histograms have one series per histogram whatever its resolution: bucket ``i`` of
schema ``s`` holds the values in ``(base**(i-1), base**i]``, ``base = 2**(2**-s)``. perfmon keeps the
counts of the populated buckets in a dict per histogram (written by the resolver thread, read under
``Metrics``' lock, as the classic counts are) and renders them only when a scraper asks for protobuf
(``promproto.py``). Memory is bounded: at most ``MAX_BUCKETS`` populated buckets per histogram; one
more halves the resolution (schema - 1, neighbouring buckets merged), as client_golang does, so a
histogram never holds more than ~160 small ints whatever its values.
"""

from __future__ import annotations

import math
import sys
from bisect import bisect_left
from typing import NamedTuple

__all__ = ["MAX_BUCKETS", "SCHEMA", "ZERO_THRESHOLD", "NativeBuckets", "NativeSnapshot", "bucket_index", "spans"]

#: Starting schema: 8 buckets per power of two, adjacent bounds 9.05% apart (the ratio client_golang
#: picks for Prometheus' recommended bucket factor 1.1). A narrow distribution's quantile is then off
#: by at most ~4.5% (half a bucket), against ~10% for the default classic grid.
SCHEMA = 3
#: Populated buckets per histogram before the resolution is halved (client_golang's usual setting):
#: ~160 buckets at schema 3 span 2**20 (1 µs .. 1 s); latencies of one series rarely span 2**4.
MAX_BUCKETS = 160
#: Values at or below it count in the zero bucket (a 0 s block timed by ``track``): client_golang's
#: default, 2**-128, far below any clock's resolution.
ZERO_THRESHOLD = 2.0**-128

# Per schema > 0, the lower bounds of its buckets in one power of two, as frexp() mantissas in [0.5, 1).
_MANTISSA_BOUNDS = {s: [2.0 ** (j / 2**s - 1) for j in range(2**s)] for s in range(1, 9)}


def bucket_index(value: float, schema: int) -> int:
    """The index of the bucket of ``schema`` that holds ``value`` (> 0, finite), as Prometheus counts."""
    frac, exp = math.frexp(value)  # value = frac * 2**exp, 0.5 <= frac < 1
    if schema > 0:
        bounds = _MANTISSA_BOUNDS[schema]
        return bisect_left(bounds, frac) + (exp - 1) * len(bounds)
    key = exp - 1 if frac == 0.5 else exp  # an exact power of two is its bucket's upper bound
    offset = (1 << -schema) - 1
    return (key + offset) >> -schema


class NativeSnapshot(NamedTuple):
    """A consistent copy of one histogram's native buckets, for the encoder."""

    schema: int
    zero_threshold: float
    zero_count: int
    counts: dict[int, int]  # bucket index -> observations


class NativeBuckets:
    """Exponential bucket counts of one histogram (positive values; the rest go to the zero bucket)."""

    __slots__ = ("counts", "schema", "zero_count")

    def __init__(self, schema: int = SCHEMA) -> None:
        self.schema = schema
        self.zero_count = 0
        self.counts: dict[int, int] = {}

    def observe(self, value: float, weight: int = 1) -> None:
        """Count ``value`` (seconds, or any positive unit) ``weight`` times."""
        if not value > ZERO_THRESHOLD:  # 0 (and NaN, or a negative a broken clock could give)
            self.zero_count += weight
            return
        if math.isinf(value):
            value = sys.float_info.max  # the highest bucket: a duration is never infinite, but never raise
        key = bucket_index(value, self.schema)
        counts = self.counts
        counts[key] = counts.get(key, 0) + weight
        if len(counts) > MAX_BUCKETS:
            self._halve()

    def observe_many(self, values: list[float], weights: list[int] | None = None) -> None:
        """``observe`` each of ``values`` (``weights[i]`` times each; None: once), in one loop."""
        schema = self.schema
        if schema <= 0:
            for i, value in enumerate(values):
                self.observe(value, 1 if weights is None else weights[i])
            return
        bounds = _MANTISSA_BOUNDS[schema]
        per_power = len(bounds)
        counts = self.counts
        frexp = math.frexp
        for i, value in enumerate(values):
            weight = 1 if weights is None else weights[i]
            if not value > ZERO_THRESHOLD:
                self.zero_count += weight
                continue
            if value == math.inf:
                value = sys.float_info.max
            frac, exp = frexp(value)
            key = bisect_left(bounds, frac) + (exp - 1) * per_power  # bucket_index, inlined
            counts[key] = counts.get(key, 0) + weight
        if len(counts) > MAX_BUCKETS:
            self._halve()

    def _halve(self) -> None:
        """Schema - 1: bucket i of the finer schema lies in bucket ceil(i / 2) of the coarser one."""
        while len(self.counts) > MAX_BUCKETS and self.schema > -4:
            merged: dict[int, int] = {}
            for key, n in self.counts.items():
                k = (key + 1) >> 1
                merged[k] = merged.get(k, 0) + n
            self.counts = merged
            self.schema -= 1

    def snapshot(self) -> NativeSnapshot:
        return NativeSnapshot(self.schema, ZERO_THRESHOLD, self.zero_count, dict(self.counts))


def spans(counts: dict[int, int]) -> tuple[list[tuple[int, int]], list[int]]:
    """(spans, deltas) of populated buckets, as the protobuf exposition wants them.

    A span is (offset, length): the first offset is the first bucket's index, the next ones the
    number of empty buckets skipped. Gaps of one or two empty buckets are filled with zeros instead
    (a span costs more bytes than two zero deltas, client_golang's rule). Deltas are each bucket's
    count minus the previous one's (the first against 0).
    """
    out_spans: list[tuple[int, int]] = []
    deltas: list[int] = []
    prev_key: int | None = None
    prev_count = 0
    for key in sorted(counts):
        n = counts[key]
        if prev_key is None:
            out_spans.append((key, 1))
        else:
            gap = key - prev_key - 1
            if gap <= 2:
                for _ in range(gap):
                    deltas.append(-prev_count)
                    prev_count = 0
                offset, length = out_spans[-1]
                out_spans[-1] = (offset, length + gap + 1)
            else:
                out_spans.append((gap, 1))
        deltas.append(n - prev_count)
        prev_key, prev_count = key, n
    return out_spans, deltas
