"""A minimal protobuf wire decoder for the tests: reads perfmon's delimited MetricFamily exposition back.

Independent of perfmon's encoder (it knows only the wire format and metrics.proto's field numbers), so
a round trip checks the encoder rather than restating it.
"""

from __future__ import annotations

import struct
from typing import Any

# message -> field number -> (name, kind, repeated); kind is a scalar type or a message name.
SCHEMA: dict[str, dict[int, tuple[str, str, bool]]] = {
    "MetricFamily": {1: ("name", "string", False), 2: ("help", "string", False), 3: ("type", "uint", False),
                     4: ("metric", "Metric", True), 5: ("unit", "string", False)},
    "Metric": {1: ("label", "LabelPair", True), 2: ("gauge", "Value", False), 3: ("counter", "Counter", False),
               4: ("summary", "Summary", False), 5: ("untyped", "Value", False), 7: ("histogram", "Histogram", False),
               6: ("timestamp_ms", "uint", False)},
    "LabelPair": {1: ("name", "string", False), 2: ("value", "string", False)},
    "Value": {1: ("value", "double", False)},
    "Counter": {1: ("value", "double", False), 2: ("exemplar", "Exemplar", False),
                3: ("created_timestamp", "Timestamp", False)},
    "Summary": {1: ("sample_count", "uint", False), 2: ("sample_sum", "double", False),
                3: ("quantile", "Quantile", True), 4: ("created_timestamp", "Timestamp", False)},
    "Quantile": {1: ("quantile", "double", False), 2: ("value", "double", False)},
    "Histogram": {1: ("sample_count", "uint", False), 2: ("sample_sum", "double", False),
                  3: ("bucket", "Bucket", True), 5: ("schema", "sint", False), 6: ("zero_threshold", "double", False),
                  7: ("zero_count", "uint", False), 12: ("positive_span", "BucketSpan", True),
                  13: ("positive_delta", "sint", True), 15: ("created_timestamp", "Timestamp", False)},
    "Bucket": {1: ("cumulative_count", "uint", False), 2: ("upper_bound", "double", False),
               3: ("exemplar", "Exemplar", False)},
    "BucketSpan": {1: ("offset", "sint", False), 2: ("length", "uint", False)},
    "Exemplar": {1: ("label", "LabelPair", True), 2: ("value", "double", False), 3: ("timestamp", "Timestamp", False)},
    "Timestamp": {1: ("seconds", "uint", False), 2: ("nanos", "uint", False)},
}


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        b = data[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def decode(message: str, data: bytes) -> dict[str, Any]:
    """One message as a dict (repeated fields as lists); unknown fields fail the test."""
    out: dict[str, Any] = {}
    pos = 0
    fields = SCHEMA[message]
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        assert number in fields, f"{message}: unknown field {number}"
        name, kind, repeated = fields[number]
        value: Any
        if wire == 0:
            raw, pos = _varint(data, pos)
            value = (raw >> 1) ^ -(raw & 1) if kind == "sint" else raw
        elif wire == 1:
            value = struct.unpack_from("<d", data, pos)[0]
            pos += 8
        elif wire == 2:
            n, pos = _varint(data, pos)
            chunk = data[pos:pos + n]
            pos += n
            value = chunk.decode() if kind == "string" else decode(kind, chunk)
        else:
            raise AssertionError(f"{message}.{name}: wire type {wire}")
        if repeated:
            out.setdefault(name, []).append(value)
        else:
            assert name not in out, f"{message}.{name} twice"
            out[name] = value
    return out


def families(body: bytes) -> list[dict[str, Any]]:
    """Every length-delimited MetricFamily of a scrape."""
    out, pos = [], 0
    while pos < len(body):
        n, pos = _varint(body, pos)
        out.append(decode("MetricFamily", body[pos:pos + n]))
        pos += n
    return out


def labels(metric: dict[str, Any]) -> dict[str, str]:
    return {p.get("name", ""): p.get("value", "") for p in metric.get("label", [])}


def native_counts(h: dict[str, Any]) -> dict[int, int]:
    """Bucket index -> count, from a native histogram's spans and deltas."""
    counts: dict[int, int] = {}
    deltas = iter(h.get("positive_delta", []))
    index, count = 0, 0
    for span in h.get("positive_span", []):
        index += span.get("offset", 0)  # the first: absolute; the next: empty buckets skipped
        for _ in range(span.get("length", 0)):
            count += next(deltas)
            if count:
                counts[index] = count
            index += 1
    return counts
