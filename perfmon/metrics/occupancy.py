"""OccupancyCollector: each CUDA model's device occupancy, host-bound verdict and live host/device ratio, read
from ``stats/occupancy.py`` at scrape time (a series only where there is a number: none for a CPU model)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from ..faults import InternalErrors
from ..stats.occupancy import Row
from .catalog import _family

__all__ = ["OCCUPANCY_METRICS", "OccupancyCollector"]

OCCUPANCY_METRICS = ("perfmon_model_occupancy_ratio", "perfmon_model_host_bound", "perfmon_model_host_device_ratio",
                     "perfmon_model_occupancy_timestamp_seconds")


class OccupancyCollector(Collector):
    """The four occupancy gauges per model; a failing read is counted (``internal_errors{stage="occupancy"}``)."""

    def __init__(self, rows: Callable[[], list[Row]], internal: InternalErrors) -> None:
        self._rows = rows
        self._internal = internal

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        families = {name: _family(name) for name in OCCUPANCY_METRICS}
        try:
            rows = self._rows()
        except Exception as exc:  # the scrape goes on without these series
            self._internal.report("occupancy", exc)
            rows = []
        for r in rows:
            values = (r.occupancy, None if r.host_bound is None else float(r.host_bound), r.host_device_ratio,
                      r.capture_unix)
            for name, v in zip(OCCUPANCY_METRICS, values, strict=True):
                if v is not None:
                    families[name].add_metric([r.model], v)
        yield from families.values()
