"""Forward-call metrics: latency and batch-size histograms fed by the resolver, exact counts read at scrape.

Histograms are fed by the resolver (a sink); per-call counts are read at scrape time straight from
the hot path's ``itertools.count`` counters by a custom collector, so a scrape always shows the
exact number of calls and errors without the request thread ever touching prometheus_client.
Labelled children are bound once per (model, device, phase) and cached.
"""

from __future__ import annotations

import math
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import Info
from prometheus_client.core import Metric
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector
from prometheus_client.samples import Exemplar

from .._version import __version__
from ..agent.records import DROP_REASONS, Sample
from ..agent.state import ModelState
from ..config import Config
from ..faults import InternalErrors, count_value
from .catalog import BATCH_BUCKETS, METRICS, Declared, _family
from .family import HistogramRow, HistogramRows
from .native import NativeBuckets
from .registrations import Registrations

__all__ = ["Metrics", "trace_exemplar"]


def _le(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(float(bound))


class _Histogram:
    """Bucket counts for one label set. Written by the resolver thread only; read under Metrics' lock.

    With ``native`` it also keeps exponential bucket counts (``native.py``, at most 160 ints) for the
    protobuf exposition. Each classic bucket keeps the latest exemplar that fell in it (one object per
    bucket at most, made on the first one): OpenMetrics scrapes show it, the text format does not.
    """

    __slots__ = ("bounds", "cache", "counts", "exemplars", "labels", "native", "sum")

    def __init__(self, bounds: tuple[float, ...], labels: tuple[str, ...], *, native: bool = False) -> None:
        self.bounds = bounds
        self.labels = labels  # the ``le`` strings, formatted once
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.native = NativeBuckets() if native else None
        self.exemplars: list[Exemplar | None] | None = None
        #: What the encoders derive from the series' labels (``family.HistogramRow.cache``), kept across scrapes.
        self.cache: dict[str, Any] = {}

    def observe(self, value: float, exemplar: Exemplar | None = None, weight: int = 1) -> None:
        """Count ``value`` ``weight`` times (an inter-token gap can stand for a chunk of tokens)."""
        # bisect_left: a value equal to a bound belongs to that bound's bucket (le = "less or equal").
        i = bisect_left(self.bounds, value)
        self.counts[i] += weight
        self.sum += value * weight
        if self.native is not None:
            self.native.observe(value, weight)
        if exemplar is not None:
            if self.exemplars is None:
                self.exemplars = [None] * len(self.counts)
            self.exemplars[i] = exemplar

    def observe_many(self, values: list[float], weights: list[int] | None = None) -> None:
        """``observe`` each of ``values`` (``weights[i]`` times each; None: once), in one loop: a request's
        inter-token gaps (~0.2 µs a value here against ~1 µs through ``observe``)."""
        bounds, counts = self.bounds, self.counts
        total = 0.0
        if weights is None:
            for value in values:
                counts[bisect_left(bounds, value)] += 1
                total += value
        else:
            for value, weight in zip(values, weights, strict=True):
                counts[bisect_left(bounds, value)] += weight
                total += value * weight
        self.sum += total
        if self.native is not None:
            self.native.observe_many(values, weights)

    def row(self, labels: tuple[str, ...]) -> HistogramRow:
        """A copy of the counts for a scrape (the caller holds the lock that guards ``observe``)."""
        return HistogramRow(labels, self.bounds, self.labels, list(self.counts), self.sum,
                            None if self.exemplars is None else list(self.exemplars),
                            None if self.native is None else self.native.snapshot(), self.cache)


def trace_exemplar(trace: tuple[int, int], value: float, end_ns: int) -> Exemplar:
    """An OpenMetrics exemplar for one timed call: its OpenTelemetry trace and span ids (lowercase hex,
    as W3C traceparent writes them), its duration in seconds, and the Unix time it ended (its
    ``perf_counter_ns`` end mapped onto the wall clock now, off the request thread)."""
    trace_id, span_id = trace
    ended = time.time() - max(time.perf_counter_ns() - end_ns, 0) / 1e9
    return Exemplar({"trace_id": f"{trace_id:032x}", "span_id": f"{span_id:016x}"}, value, ended)


class Metrics:
    """Declares the metrics on ``registry`` and keeps the latency histograms.

    The histograms are perfmon's own (bucket counts in plain lists, rendered by a collector) rather
    than prometheus_client ``Histogram`` children: one lock per scrape instead of one per bucket, and
    no ``_created`` series, which matters with ~100 buckets per series (see docs/design.md).
    """

    def __init__(
        self,
        registry: Registrations,
        config: Config,
        *,
        states: Callable[[], Iterable[ModelState]],
        internal: InternalErrors,
        first_forward_origin: Callable[[int], int],
        process_collectors: bool = True,
    ) -> None:
        self.registry = registry
        self._states = states
        self._first_forward_origin = first_forward_origin
        self._bounds = config.buckets
        self._host_bounds = config.host_buckets
        self._les = tuple(_le(b) for b in (*config.buckets, math.inf))
        self._host_les = tuple(_le(b) for b in (*config.host_buckets, math.inf))
        self._duration: dict[tuple[str, str, str, str], _Histogram] = {}
        self._host: dict[tuple[str, str, str, str], _Histogram] = {}
        self._batch: dict[str, _Histogram] = {}
        self._batch_les = tuple(_le(b) for b in (*BATCH_BUCKETS, math.inf))
        self._firsts: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()
        registry.register(Declared())  # first: a registry holding any of perfmon's names refuses it here
        self._info = Info("perfmon", METRICS["perfmon_info"][3], registry=None)
        registry.register(self._info)
        self.set_port(None)
        registry.register(_CountsCollector(self, states, internal))
        if process_collectors:
            _register_process_collectors(registry)

    def reset_after_fork(self) -> None:
        self._lock = threading.Lock()
        self._duration, self._host, self._batch, self._firsts = {}, {}, {}, {}

    def set_port(self, port: int | None) -> None:
        """The agent's HTTP port in perfmon_info (each worker of a multi-process server has its own)."""
        self._info.info({**_versions(), "port": "" if port is None else str(port)})

    def observe(self, samples: list[Sample]) -> None:
        """Sink: put a pass's resolved samples into the histograms (resolver thread). One lock a pass, and each
        series' values counted in one loop (``observe_many``: ~0.2 against ~1 µs a value through ``observe``); a
        sample with a trace goes alone, with its exemplar."""
        durations: dict[tuple[str, str, str, str], list[float]] = {}
        hosts: dict[tuple[str, str, str, str], list[float]] = {}
        items: dict[str, list[float]] = {}
        traced: list[tuple[tuple[str, str, str, str], Sample]] = []
        for sample in samples:
            key = (sample.model, sample.device, sample.phase, sample.stage)
            if sample.trace is not None:
                traced.append((key, sample))
            else:
                durations.setdefault(key, []).append(sample.duration_seconds)
            # On a wall clock, host time is the same measurement: exported only where they differ (CUDA).
            if sample.device.startswith("cuda"):
                hosts.setdefault(key, []).append(sample.host_seconds)
            if sample.items is not None:
                items.setdefault(sample.model, []).append(float(sample.items))
        with self._lock:
            for key, values in durations.items():
                self._series(self._duration, key, self._bounds, self._les).observe_many(values)
            for key, sample in traced:
                try:
                    exemplar: Exemplar | None = trace_exemplar(sample.trace, sample.duration_seconds,  # type: ignore[arg-type]
                                                               sample.end_ns)
                except (TypeError, ValueError, OverflowError):
                    exemplar = None  # ids a tracer made up: the exemplar goes, the sample stays
                self._series(self._duration, key, self._bounds, self._les).observe(sample.duration_seconds, exemplar)
            for key, values in hosts.items():
                self._series(self._host, key, self._host_bounds, self._host_les).observe_many(values)
            for model, values in items.items():
                batch = self._batch.get(model)
                if batch is None:
                    batch = self._batch[model] = _Histogram(BATCH_BUCKETS, self._batch_les)
                batch.observe_many(values)
        for sample in samples:
            if sample.seq == 0 and sample.model not in self._firsts:
                ttff = (sample.end_ns - self._first_forward_origin(sample.end_ns)) / 1e9
                self._firsts[sample.model] = (sample.duration_seconds, max(ttff, 0.0))

    @staticmethod
    def _series(table: dict[tuple[str, str, str, str], _Histogram], key: tuple[str, str, str, str],
                bounds: tuple[float, ...], les: tuple[str, ...]) -> _Histogram:
        """``table``'s histogram of series ``key`` (a native one), made on its first value."""
        hist = table.get(key)
        if hist is None:
            hist = table[key] = _Histogram(bounds, les, native=True)
        return hist

    def first_call(self, model: str) -> tuple[float, float] | None:
        """(cold start seconds, time to first forward seconds) once the first call is resolved."""
        return self._firsts.get(model)

    def histograms(self) -> Iterator[Metric]:
        """The latency and batch-size histogram families, rendered from a consistent copy."""
        with self._lock:
            rows = [(name, [h.row(key) for key, h in sorted(table.items())])
                    for name, table in (("perfmon_forward_duration_seconds", self._duration),
                                        ("perfmon_forward_host_duration_seconds", self._host))]
            batches = [h.row((model,)) for model, h in sorted(self._batch.items())]
        for name, series in rows:
            fam = HistogramRows(name, METRICS[name][3], labels=["model", "device", "phase", "stage"])
            for row in series:
                fam.add_row(row)
            yield fam
        batch = HistogramRows("perfmon_forward_batch_size", METRICS["perfmon_forward_batch_size"][3], labels=["model"])
        for row in batches:
            batch.add_row(row)
        yield batch


class _CountsCollector(Collector):
    """Exact counts read at scrape time from the hot path's counters."""

    def __init__(self, metrics: Metrics, states: Callable[[], Iterable[ModelState]],
                 internal: InternalErrors) -> None:
        self._metrics = metrics
        self._states = states
        self._internal = internal

    def describe(self) -> Iterator[Metric]:
        return iter(())  # names are fixed, but collect() is cheap enough to run at registration

    def collect(self) -> Iterator[Metric]:
        calls = _family("perfmon_forward_calls_total")
        errors = _family("perfmon_forward_errors_total")
        failed = _family("perfmon_forward_failed_calls_total")
        sampled = _family("perfmon_forward_sampled_total")
        dropped = _family("perfmon_samples_dropped_total")
        cold = _family("perfmon_cold_start_seconds")
        ttff = _family("perfmon_time_to_first_forward_seconds")
        rate = _family("perfmon_sample_rate")
        sigs = _family("perfmon_input_signatures")
        items_fam = _family("perfmon_forward_items_total")
        padded_fam = _family("perfmon_forward_padded_items_total")
        for m, group in _by_model(self._states()):
            # A generative model has one state per stage: calls (and latency) by stage, the rest summed.
            item_counts = [st.items_counts() for st in group]
            if item_counts[0][0] is not None:
                items_fam.add_metric([m], sum(i or 0 for i, _ in item_counts))
            if item_counts[0][1] is not None:
                padded_fam.add_metric([m], sum(p or 0 for _, p in item_counts))
            for st in group:
                calls.add_metric([m, st.stage], count_value(st.calls))
            sampled.add_metric([m], sum(count_value(st.sampled) for st in group))
            error_totals: dict[str, int] = {}
            for st in group:
                for exc, n in st.error_counts().items():
                    error_totals[exc] = error_totals.get(exc, 0) + n
            for exc, n in sorted(error_totals.items()):
                errors.add_metric([m, exc], n)
            failed.add_metric([m], sum(error_totals.values()))
            for reason in DROP_REASONS:
                dropped.add_metric([m, reason], sum(count_value(st.drops[reason]) for st in group))
            rate.add_metric([m], group[0].sampler.rate)
            sigs.add_metric([m], sum(st.table.distinct for st in group))
            first = self._metrics.first_call(m)
            if first is not None:
                cold.add_metric([m], first[0])
                ttff.add_metric([m], first[1])
        internal = _family("perfmon_internal_errors_total")
        for stage, n in sorted(self._internal.counts()):
            internal.add_metric([stage], n)
        yield from (calls, errors, failed, sampled, dropped, cold, ttff, rate, sigs, items_fam, padded_fam, internal)
        yield from self._metrics.histograms()


def _by_model(states: Iterable[ModelState]) -> list[tuple[str, list[ModelState]]]:
    """States grouped by model name (one per stage for a generative model), in first-seen order."""
    groups: dict[str, list[ModelState]] = {}
    for st in list(states):
        groups.setdefault(st.name, []).append(st)
    return list(groups.items())


def _versions() -> dict[str, str]:
    try:
        import torch

        torch_version = str(torch.__version__)
        cuda = str(torch.version.cuda or "none")
    except Exception:  # pragma: no cover - torch is a dependency
        torch_version, cuda = "unknown", "none"
    return {"version": __version__, "torch_version": torch_version, "cuda": cuda}


def _register_process_collectors(registry: Registrations) -> None:
    """Process RSS/CPU/fds and platform info, unless the registry already has them.

    Not the GC collector: its nine series per scrape tell little about inference latency and the
    scrape budget (~30 KB for one model and one GPU) is better spent on buckets.
    """
    from prometheus_client import REGISTRY

    if registry.registry is REGISTRY:
        return  # prometheus_client registered its defaults there on import
    for make in (lambda: ProcessCollector(registry=None), lambda: PlatformCollector(registry=None)):
        try:
            registry.register(make())
        except ValueError:
            pass  # already registered by the caller
