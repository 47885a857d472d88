"""The text (0.0.4) and OpenMetrics (1.0.0) expositions, byte for byte as prometheus_client writes them, cheaper.

Every family but perfmon's own histograms (``HistogramRows``) goes through prometheus_client's encoder
unchanged. A ``HistogramRows`` series is written from a template made at its first scrape and kept with it
(``HistogramRow.cache``): its sample lines with each value a ``str.format`` field. A scrape then costs, per
series, a cumulative sum and one ``format`` call instead of a ``Sample`` and a label dict per line, and
the labels escaped, sorted and joined again line by line: at the documented limits (~18,700 lines) a
text render went from ~120 ms to ~17 ms on this project's machine, OpenMetrics from 180-310 ms to ~24 ms
(docs/reliability.md, "Scrapes at the documented limits"). The templates cost about the text they write:
~1.6 MB at the limits (tracemalloc).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import utils
from prometheus_client.core import Metric
from prometheus_client.exposition import generate_latest as _client_text
from prometheus_client.openmetrics import exposition as _openmetrics
from prometheus_client.samples import Exemplar

from .family import HistogramRow, HistogramRows

__all__ = ["generate_openmetrics", "generate_text"]

_EOF = b"# EOF\n"
#: The client's value formatting (Go's float format) and OpenMetrics encoder, typed (the client's are not).
_go_float: Callable[[float], str] = utils.floatToGoString
_client_openmetrics: Callable[[Any], bytes] = _openmetrics.generate_latest
#: A count below this is written as prometheus_client writes float(count): "12.0" (from 1e6 on, Go's
#: exponent form, e.g. "1.234567e+06": floatToGoString itself).
_PLAIN_COUNTS = 1_000_000


def generate_text(registry: Any) -> bytes:
    """The registry (anything with ``collect()``) in the Prometheus text format 0.0.4."""
    return b"".join(_families(registry.collect(), False, _client_text))


def generate_openmetrics(registry: Any) -> bytes:
    """The registry in OpenMetrics 1.0.0 text (with exemplars)."""
    return b"".join(_families(registry.collect(), True, _openmetrics_body)) + _EOF


def _openmetrics_body(registry: Any) -> bytes:
    """prometheus_client's OpenMetrics output without its ``# EOF`` (written once, at the end)."""
    return _client_openmetrics(registry).removesuffix(_EOF)


class _One:
    """A registry of given families, for prometheus_client's encoders."""

    def __init__(self, *families: Metric) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


def _families(families: Iterable[Metric], om: bool, encode: Callable[[Any], bytes]) -> Iterator[bytes]:
    for family in families:
        if not isinstance(family, HistogramRows):
            yield encode(_One(family))
            continue
        # The header (HELP, TYPE, UNIT) as the client writes it for the family with no sample.
        yield encode(_One(Metric(family.name, family.documentation, "histogram", family.unit)))
        yield "".join([_series(family, row, om) for row in family.rows]).encode()


def _series(family: HistogramRows, row: HistogramRow, om: bool) -> str:
    template = row.cache.get("lines")
    if template is None:
        template = row.cache["lines"] = _template(family, row)
    values = []
    total = 0
    exemplars = row.exemplars if om else None
    for i, n in enumerate(row.counts):
        total += n
        text = f"{total}.0" if 0 <= total < _PLAIN_COUNTS else _go_float(total)
        ex = exemplars[i] if exemplars is not None else None
        values.append(text if ex is None else text + _exemplar(ex))
    # _count and _sum: a template without them (negative buckets) leaves these two unused.
    values.append(f"{total}.0" if 0 <= total < _PLAIN_COUNTS else _go_float(total))
    values.append(_go_float(row.sum))
    return template.format(*values)


def _template(family: HistogramRows, row: HistogramRow) -> str:
    """The series' sample lines with every value a ``{}`` field (literal braces doubled).

    Written as both client encoders write a histogram's samples, which for legacy names (``HistogramRows``
    takes no other) are the same lines in the text format and in OpenMetrics: the labels sorted by name, ``le``
    among them, each value with backslash, newline and double quote escaped; ``_count`` and ``_sum`` after the
    buckets unless a bound is negative. tests/test_scrape_limits.py holds the two to the client's bytes.
    """
    pairs = sorted(zip(family.labelnames, row.labels))
    before = "".join(f'{k}="{_escape(v)}",' for k, v in pairs if k < "le")
    after = "".join(f',{k}="{_escape(v)}"' for k, v in pairs if k > "le")
    name = family.name
    lines = [f'{name}_bucket{{{before}le="{_escape(le)}"{after}}} ' for le in row.les]
    if row.les and float(row.les[0]) >= 0:  # as HistogramMetricFamily.add_metric
        labels = ",".join(f'{k}="{_escape(v)}"' for k, v in pairs)
        braced = f"{{{labels}}}" if labels else ""
        lines += [f"{name}_count{braced} ", f"{name}_sum{braced} "]
    return "".join(line.replace("{", "{{").replace("}", "}}") + "{}\n" for line in lines)


def _escape(value: str) -> str:
    """A label value as the client writes it (both formats)."""
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')


def _exemplar(ex: Exemplar) -> str:
    """An exemplar as prometheus_client's OpenMetrics encoder appends it to a bucket line."""
    labels = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(ex.labels.items()))
    if ex.timestamp is not None:
        return f" # {{{labels}}} {_go_float(ex.value)} {ex.timestamp}"
    return f" # {{{labels}}} {_go_float(ex.value)}"
