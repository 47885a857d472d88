"""The Prometheus protobuf exposition, written by hand: length-delimited ``io.prometheus.client.MetricFamily``.

Served when a scraper's ``Accept`` asks for it first (Prometheus with ``--enable-feature=native-histograms``
does), because it is the only format Prometheus 2.x reads native histograms from; prometheus_client
cannot write it. A protobuf scrape replaces the text one, so every family of the registry is encoded:
counters, gauges, summaries, histograms, info and stateset (as gauges) and unknown (untyped).
Histograms of a ``NativeHistogramFamily`` also carry their exponential buckets (``native.py``) next
to the classic ones. No protobuf dependency: the messages are a handful of fields, written with the
varint/zigzag/length-delimited rules of the wire format (field numbers from the client model's
``metrics.proto``). Fields left at their default are omitted, as protobuf does.
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Iterable
from typing import Any

from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.samples import Exemplar

from .family import HistogramRows
from .native import NativeSnapshot, spans

__all__ = ["CONTENT_TYPE", "NativeHistogramFamily", "encode_families", "generate"]

CONTENT_TYPE = "application/vnd.google.protobuf; proto=io.prometheus.client.MetricFamily; encoding=delimited"

# MetricType enum values.
_COUNTER, _GAUGE, _SUMMARY, _UNTYPED, _HISTOGRAM, _GAUGE_HISTOGRAM = 0, 1, 2, 3, 4, 5

_double = struct.Struct("<d").pack


class NativeHistogramFamily(HistogramMetricFamily):
    """A histogram family whose label sets may also have exponential buckets.

    Text and OpenMetrics encoders see an ordinary histogram; the protobuf encoder adds the native
    buckets of each label set that has them (labels in the family's order -> snapshot).
    """

    def __init__(self, name: str, documentation: str, labels: list[str]) -> None:
        super().__init__(name, documentation, labels=labels)
        self.native: dict[tuple[str, ...], NativeSnapshot] = {}

    def add_native(self, labels: Iterable[str], snapshot: NativeSnapshot) -> None:
        self.native[tuple(labels)] = snapshot


# -- wire format --------------------------------------------------------------------------------

def _varint(n: int) -> bytes:
    if 0 <= n < 0x80:
        return _ONE_BYTE[n]  # most keys, lengths and counts: no loop, no new object
    if n < 0:
        n += 1 << 64  # int64 as two's complement (10 bytes), as protobuf does
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_ONE_BYTE = [bytes((i,)) for i in range(0x80)]


def _zigzag(n: int) -> int:
    return (n << 1) ^ (n >> 63)


def _key(field: int, wire: int) -> bytes:
    return _varint(field << 3 | wire)


def _bytes(field: int, data: bytes) -> bytes:
    return _key(field, 2) + _varint(len(data)) + data


def _string(field: int, text: str) -> bytes:
    return _bytes(field, text.encode()) if text else b""


def _uint(field: int, n: int) -> bytes:
    return _key(field, 0) + _varint(n) if n else b""


def _sint(field: int, n: int) -> bytes:
    return _key(field, 0) + _varint(_zigzag(n)) if n else b""


def _dbl(field: int, x: float, *, always: bool = False) -> bytes:
    # A double's default is 0; "always" for values whose presence matters (a bucket's upper bound 0).
    return _key(field, 1) + _double(x) if (x or always or math.copysign(1.0, x) < 0) else b""


# -- messages -----------------------------------------------------------------------------------

def _label_pair(name: str, value: str) -> bytes:
    return _string(1, name) + _string(2, value)


def _timestamp(seconds: float) -> bytes:
    whole = math.floor(seconds)
    return _uint(1, whole) + _uint(2, round((seconds - whole) * 1e9) % 1_000_000_000)


def _exemplar(ex: Exemplar) -> bytes:
    body = b"".join(_bytes(1, _label_pair(k, v)) for k, v in sorted(ex.labels.items()))
    body += _dbl(2, float(ex.value), always=True)
    if ex.timestamp is not None:
        body += _bytes(3, _timestamp(float(ex.timestamp)))
    return body


def _metric(labels: dict[str, str], field: int, body: bytes, timestamp: Any = None) -> bytes:
    """A Metric message; ``timestamp`` (Unix seconds, a float or prometheus_client's Timestamp) is rare."""
    out = b"".join(_bytes(1, _label_pair(k, v)) for k, v in labels.items())
    out += _bytes(field, body)
    if timestamp is not None:
        out += _key(6, 0) + _varint(int(float(timestamp) * 1000))
    return out


def _count(x: float) -> int:
    return max(0, round(x))


def _family(name: str, help_text: str, typ: int, metrics: list[bytes]) -> bytes:
    body = _string(1, name) + _string(2, help_text) + _uint(3, typ)
    body += b"".join(_bytes(4, m) for m in metrics)
    return _varint(len(body)) + body


def _histogram(group: dict[str, Any], native: NativeSnapshot | None) -> bytes:
    body = _uint(1, _count(group.get("count", 0.0))) + _dbl(2, group.get("sum", 0.0))
    for upper, cumulative, exemplar in group.get("buckets", []):
        if math.isinf(upper):
            continue  # +Inf is sample_count; Prometheus adds that bucket itself
        bucket = _uint(1, _count(cumulative)) + _dbl(2, upper, always=True)
        if exemplar is not None:
            bucket += _bytes(3, _exemplar(exemplar))
        body += _bytes(3, bucket)
    if "created" in group:
        body += _bytes(15, _timestamp(group["created"]))
    return body + _native(native)


def _native(native: NativeSnapshot | None) -> bytes:
    """A histogram's exponential-bucket fields (b"" for none)."""
    if native is None:
        return b""
    span_list, deltas = spans(native.counts)
    body = _sint(5, native.schema) + _dbl(6, native.zero_threshold) + _uint(7, native.zero_count)
    for offset, length in span_list:
        body += _bytes(12, _sint(1, offset) + _uint(2, length))
    return body + b"".join(_key(13, 0) + _varint(_zigzag(d)) for d in deltas)  # unpacked, as proto2 writes it


def _summary(group: dict[str, Any]) -> bytes:
    body = _uint(1, _count(group.get("count", 0.0))) + _dbl(2, group.get("sum", 0.0))
    for q, v in group.get("quantiles", []):
        body += _bytes(3, _dbl(1, q, always=True) + _dbl(2, v, always=True))
    if "created" in group:
        body += _bytes(4, _timestamp(group["created"]))
    return body


def _grouped(metric: Metric, bound: str) -> dict[tuple[tuple[str, str], ...], dict[str, Any]]:
    """Samples of a summary or histogram grouped by label set (without ``bound``: le or quantile)."""
    groups: dict[tuple[tuple[str, str], ...], dict[str, Any]] = {}
    base = metric.name
    for s in metric.samples:
        key = tuple((k, v) for k, v in s.labels.items() if k != bound)
        g = groups.setdefault(key, {})
        suffix = s.name[len(base):]
        if suffix in ("_bucket",):
            g.setdefault("buckets", []).append((float(s.labels[bound]), s.value, s.exemplar))
        elif suffix in ("_count", "_gcount"):
            g["count"] = s.value
        elif suffix in ("_sum", "_gsum"):
            g["sum"] = s.value
        elif suffix == "_created":
            g["created"] = s.value
        elif suffix == "" and bound in s.labels:
            g.setdefault("quantiles", []).append((float(s.labels[bound]), s.value))
    return groups


def _rows(metric: HistogramRows) -> bytes:
    """A ``HistogramRows`` family straight from its rows: the bytes ``encode_family`` writes from its samples,
    without making a ``Sample`` and a label dict per bucket (~17,000 at the documented limits)."""
    out = []
    for row in metric.rows:
        total = 0
        body = []
        exemplars = row.exemplars
        # Each bucket as _histogram writes it (+Inf left out: it is the sample count), its bound's bytes made once.
        for i, (bound, n) in enumerate(zip(_bounds(row.bounds), row.counts)):
            total += n
            # As _count(float(total)) in _histogram: beyond 2**53 a float's rounding, kept for the same bytes.
            count = total if total <= 1 << 53 else _count(float(total))
            bucket = _COUNT_KEY + _varint(count) + bound if count else bound
            ex = exemplars[i] if exemplars is not None else None
            if ex is not None:
                bucket += _bytes(3, _exemplar(ex))
            body.append(_BUCKET_KEY + _varint(len(bucket)) + bucket)
        total += row.counts[-1]
        head = b""
        if row.les and float(row.les[0]) >= 0:  # as HistogramMetricFamily: no sum and count with negative buckets
            head = _uint(1, _count(float(total))) + _dbl(2, row.sum)
        hist = head + b"".join(body) + _native(row.native)
        labels = row.cache.get("label_pairs")  # as _metric writes them, made once per series
        if labels is None:
            labels = row.cache["label_pairs"] = b"".join(_bytes(1, _label_pair(k, v))
                                                         for k, v in zip(metric.labelnames, row.labels))
        out.append(labels + _bytes(7, hist))
    return _family(metric.name, metric.documentation, _HISTOGRAM, out) if out else b""


_COUNT_KEY = bytes((1 << 3 | 0,))  # Bucket.cumulative_count, varint
_BUCKET_KEY = bytes((3 << 3 | 2,))  # Histogram.bucket, length-delimited


@functools.lru_cache(maxsize=64)  # one entry per distinct bucket grid: a handful per process
def _bounds(bounds: tuple[float, ...]) -> tuple[bytes, ...]:
    """Each finite bound as a Bucket.upper_bound field."""
    return tuple(_dbl(2, b, always=True) for b in bounds)


def encode_family(metric: Metric) -> bytes:
    """One family as a length-delimited MetricFamily message (b"" when it has no samples)."""
    if isinstance(metric, HistogramRows):
        return _rows(metric)
    if not metric.samples:
        return b""
    typ = metric.type
    if typ in ("histogram", "gaugehistogram"):
        native = metric.native if isinstance(metric, NativeHistogramFamily) else {}
        names = [k for k in (metric.samples[0].labels) if k != "le"]
        rows = []
        for key, group in _grouped(metric, "le").items():
            labels = dict(key)
            snap = native.get(tuple(labels.get(n, "") for n in names)) if native else None
            rows.append(_metric(labels, 7, _histogram(group, snap)))
        return _family(metric.name, metric.documentation, _HISTOGRAM if typ == "histogram" else _GAUGE_HISTOGRAM, rows)
    if typ == "summary":
        rows = [_metric(dict(key), 4, _summary(group)) for key, group in _grouped(metric, "quantile").items()]
        return _family(metric.name, metric.documentation, _SUMMARY, rows)
    if typ == "counter":
        # The family is named as its series (with _total); _created goes into the counter itself.
        created = {tuple(s.labels.items()): s.value for s in metric.samples if s.name.endswith("_created")}
        rows = []
        name = metric.name + "_total"
        for s in metric.samples:
            if s.name != name:
                continue
            body = _dbl(1, s.value)
            if s.exemplar is not None:
                body += _bytes(2, _exemplar(s.exemplar))
            c = created.get(tuple(s.labels.items()))
            if c is not None:
                body += _bytes(3, _timestamp(c))
            rows.append(_metric(s.labels, 3, body, s.timestamp))
        return _family(name, metric.documentation, _COUNTER, rows)
    # gauge, info (name_info = 1), stateset (one 0/1 gauge per state), unknown: one value per sample.
    by_name: dict[str, list[bytes]] = {}
    field, kind = (5, _UNTYPED) if typ in ("unknown", "untyped") else (2, _GAUGE)
    for s in metric.samples:
        by_name.setdefault(s.name, []).append(_metric(s.labels, field, _dbl(1, s.value), s.timestamp))
    return b"".join(_family(n, metric.documentation, kind, rows) for n, rows in by_name.items())


def encode_families(families: Iterable[Metric]) -> bytes:
    """Every family, each a varint length then a MetricFamily message."""
    return b"".join(encode_family(m) for m in families)


def generate(registry: Any) -> bytes:
    """The registry in the protobuf exposition (the ``encoder`` the router calls)."""
    return encode_families(registry.collect())
