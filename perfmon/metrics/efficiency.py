"""EfficiencyCollector: live FLOP/s, bytes/s, MFU and MBU per model and stage (stats/efficiency.py), read at scrape.

Each gauge is exported only while its series has a value over the window: a model with no steady sample in
the window, or whose samples are all uncounted, has no FLOP/s series (not a zero); MFU and MBU only where the
device has a peak. So a replica that stops, or a model that goes idle, leaves no stale efficiency behind.
"""

from __future__ import annotations

from collections.abc import Iterator
from time import perf_counter_ns

from prometheus_client.core import InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from ..faults import InternalErrors, count_value
from ..stats.efficiency import Efficiency
from .catalog import METRICS, _family

__all__ = ["EfficiencyCollector"]

#: figures() key -> gauge.
_GAUGES = {
    "flops_per_second": "perfmon_model_flops_per_second",
    "bytes_per_second": "perfmon_model_bytes_per_second",
    "mfu_ratio": "perfmon_model_mfu_ratio",
    "mbu_ratio": "perfmon_model_mbu_ratio",
    "unknown_ratio": "perfmon_model_flops_unknown_ratio",
}


class EfficiencyCollector(Collector):
    """The efficiency gauges, the peak's source, and what counting did; a series whose figures fail to read is
    left out of the scrape and counted (``internal_errors{stage="efficiency"}``)."""

    def __init__(self, efficiency: Efficiency, internal: InternalErrors) -> None:
        self._efficiency = efficiency
        self._internal = internal

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        eff = self._efficiency
        now = perf_counter_ns()
        families = {key: _family(name) for key, name in _GAUGES.items()}
        info = InfoMetricFamily("perfmon_model_peak", METRICS["perfmon_model_peak_info"][3], labels=["model", "stage"])
        for model, stage in eff.series():
            try:
                figures = eff.figures(model, stage, now)
            except Exception as exc:  # the scrape goes on without this series
                self._internal.report("efficiency", exc)
                continue
            if figures is None:
                continue
            for key, fam in families.items():
                if figures.get(key) is not None:
                    fam.add_metric([model, stage], figures[key])
            if figures.get("peak_source"):
                info.add_metric([model, stage], {"device": figures["device"], "source": figures["peak_source"]})
        yield from families.values()
        yield info
        counts = _family("perfmon_flop_counts_total")
        for outcome, c in eff.counter.counts.items():
            counts.add_metric([outcome], count_value(c))
        yield counts
        seconds = _family("perfmon_flop_count_seconds_total")
        seconds.add_metric([], eff.counter.seconds)
        yield seconds
