"""Every metric perfmon exports, declared in one place: the only prometheus_client importer.

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

from prometheus_client import CollectorRegistry, Info
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector
from prometheus_client.samples import Exemplar

from .._version import __version__
from ..agent.generation import DROP_REASONS as GENERATION_DROP_REASONS
from ..agent.generation import (
    DURATION_BUCKETS,
    ITL_BUCKETS,
    OUTCOMES,
    TOKEN_BUCKETS,
    TTFT_BUCKETS,
    GenerationEvent,
    GenerationTracker,
    TokenTiming,
)
from ..agent.instrument import ModelState
from ..agent.records import DROP_REASONS, Sample, split_key
from ..captures.controller import CaptureController
from ..captures.detector import Detector
from ..config import Config
from ..faults import InternalErrors, count_value
from ..selfcost import AgentCpu, HttpShedding
from ..telemetry.memory import MemorySource, read_memory
from ..telemetry.nvml import NvmlPoller, normalize_uuid
from .native import NativeBuckets
from .promproto import NativeHistogramFamily

__all__ = ["METRICS", "GenerationCollector", "Metrics"]

#: name (as exposed, without histogram suffixes) -> (type, unit, labels, help). docs/metrics.md
#: lists the same; a test keeps the two and the registry in step.
METRICS: dict[str, tuple[str, str, tuple[str, ...], str]] = {
    "perfmon_forward_calls_total": (
        "counter", "calls", ("model", "stage"),
        "Calls of the monitored model, every call, counted exactly; stage is prefill or decode for a generative "
        "model (or a stage= callable's label), empty otherwise."),
    "perfmon_forward_errors_total": (
        "counter", "calls", ("model", "exception"),
        "Calls that raised, by exception class name (capped; the rest are 'other')."),
    "perfmon_forward_duration_seconds": (
        "histogram", "seconds", ("model", "device", "phase", "stage"),
        "Sampled call duration: device time from CUDA events on GPU, wall time on CPU."),
    "perfmon_forward_host_duration_seconds": (
        "histogram", "seconds", ("model", "device", "phase", "stage"),
        "Sampled call duration as seen by the calling thread, on CUDA devices (on CPU it equals the duration)."),
    "perfmon_forward_items_total": (
        "counter", "items", ("model",),
        "Items processed (batch dimension by default, or the model's items callable), every call, exact."),
    "perfmon_forward_padded_items_total": (
        "counter", "items", ("model",), "Items including padding, when the items callable reports both."),
    "perfmon_forward_batch_size": (
        "histogram", "items", ("model",), "Items per call (batch size by default), sampled calls."),
    "perfmon_forward_sampled_total": (
        "counter", "calls", ("model",), "Calls chosen for timing (dropped samples included)."),
    "perfmon_samples_dropped_total": (
        "counter", "samples", ("model", "reason"), "Timed calls that never reached the histograms, by reason."),
    "perfmon_cold_start_seconds": (
        "gauge", "seconds", ("model",), "Duration of the model's first call (device time on GPU)."),
    "perfmon_time_to_first_forward_seconds": (
        "gauge", "seconds", ("model",), "From monitor start to the end of the model's first call."),
    "perfmon_sample_rate": (
        "gauge", "ratio", ("model",), "Configured fraction of steady-state calls that are timed."),
    "perfmon_input_signatures": (
        "gauge", "signatures", ("model",), "Distinct input signatures (shapes, dtypes) seen by the model."),
    "perfmon_internal_errors_total": (
        "counter", "errors", ("stage",), "Faults inside the agent, by stage; none ever reaches a request."),
    # -- generation requests (generation.py): monitor.generation / monitor.stream --------------
    "perfmon_time_to_first_token_seconds": (
        "histogram", "seconds", ("model",),
        "From a generation request's start to its first token handed to the caller (host time)."),
    "perfmon_inter_token_latency_seconds": (
        "histogram", "seconds", ("model",),
        "Gap between consecutive tokens handed to the caller (a chunk of n tokens: n gaps of gap/n)."),
    "perfmon_generation_duration_seconds": (
        "histogram", "seconds", ("model",), "From a generation request's start to its end, requests that ended ok."),
    "perfmon_generation_requests_total": (
        "counter", "requests", ("model", "outcome"),
        "Generation requests that ended, by outcome (ok, error, cancelled)."),
    "perfmon_prompt_tokens_total": (
        "counter", "tokens", ("model",), "Prompt tokens of generation requests, counted when they start, exact."),
    "perfmon_generated_tokens_total": (
        "counter", "tokens", ("model",), "Tokens handed to callers by generation requests, counted as they go, exact."),
    "perfmon_generation_prompt_tokens": (
        "histogram", "tokens", ("model",), "Prompt tokens per generation request that ended ok (when given)."),
    "perfmon_generation_output_tokens": (
        "histogram", "tokens", ("model",), "Tokens generated per generation request that ended ok."),
    "perfmon_generation_dropped_total": (
        "counter", "records", ("model", "reason"),
        "Generation timings never recorded: queue_full, live_limit (request counted, not timed), after_finish."),
    # -- torch allocator (memory.py), per CUDA device this process used ------------------------
    "perfmon_torch_memory_allocated_bytes": (
        "gauge", "bytes", ("device", "gpu", "UUID"), "Bytes in live tensors (torch caching allocator)."),
    "perfmon_torch_memory_reserved_bytes": (
        "gauge", "bytes", ("device", "gpu", "UUID"),
        "Bytes the allocator holds from the driver (allocated + cached; caching is not a leak)."),
    "perfmon_torch_memory_peak_allocated_bytes": (
        "gauge", "bytes", ("device", "gpu", "UUID"), "Peak allocated bytes since process start."),
    "perfmon_torch_memory_peak_reserved_bytes": (
        "gauge", "bytes", ("device", "gpu", "UUID"), "Peak reserved bytes since process start."),
    "perfmon_torch_memory_fragmentation_ratio": (
        "gauge", "ratio", ("device", "gpu", "UUID"), "Inactive split bytes over reserved bytes (0-1)."),
    "perfmon_torch_alloc_retries_total": (
        "counter", "retries", ("device", "gpu", "UUID"),
        "cudaMalloc retries after flushing the cache (a sign of memory pressure)."),
    "perfmon_torch_ooms_total": (
        "counter", "errors", ("device", "gpu", "UUID"), "Out-of-memory errors raised by the allocator."),
    "perfmon_oom_snapshots_total": (
        "counter", "files", (), "Allocator snapshots written to the trace directory after an OOM."),
    # -- NVML (nvml.py), per GPU; labels as dcgm-exporter's ------------------------------------
    "perfmon_gpu_utilization_ratio": (
        "gauge", "ratio", ("gpu", "UUID"), "Fraction of the last sample period a kernel ran (0-1)."),
    "perfmon_gpu_memory_utilization_ratio": (
        "gauge", "ratio", ("gpu", "UUID"), "Fraction of the last sample period memory was read or written."),
    "perfmon_gpu_memory_used_bytes": ("gauge", "bytes", ("gpu", "UUID"), "Device memory in use (all processes)."),
    "perfmon_gpu_memory_total_bytes": ("gauge", "bytes", ("gpu", "UUID"), "Device memory in total."),
    "perfmon_gpu_temperature_celsius": ("gauge", "celsius", ("gpu", "UUID"), "GPU die temperature."),
    "perfmon_gpu_power_watts": ("gauge", "watts", ("gpu", "UUID"), "Power draw."),
    "perfmon_gpu_power_limit_watts": ("gauge", "watts", ("gpu", "UUID"), "Enforced power limit."),
    "perfmon_gpu_energy_joules_total": (
        "counter", "joules", ("gpu", "UUID"), "Energy consumed since the driver loaded."),
    "perfmon_gpu_sm_clock_hertz": ("gauge", "hertz", ("gpu", "UUID"), "Current SM clock."),
    "perfmon_gpu_sm_clock_max_hertz": ("gauge", "hertz", ("gpu", "UUID"), "Maximum SM clock."),
    "perfmon_gpu_clocks_event_reasons": (
        "gauge", "boolean", ("gpu", "UUID", "reason"), "1 while the reason holds clocks down (throttling), else 0."),
    "perfmon_gpu_process_memory_used_bytes": (
        "gauge", "bytes", ("gpu", "UUID"), "Device memory used by this process (NVML's compute process list)."),
    "perfmon_gpu_process_utilization_ratio": (
        "gauge", "ratio", ("gpu", "UUID"), "SM utilization by this process in the latest NVML sample (0-1)."),
    "perfmon_nvml_up": ("gauge", "boolean", (), "1 when the last NVML poll succeeded, else 0."),
    "perfmon_nvml_errors_total": ("counter", "errors", ("call",), "Failed NVML calls, by function."),
    # -- regression detection (regression.py) and captures (capture.py) -----------------------
    "perfmon_latency_window_seconds": (
        "gauge", "seconds", ("model", "stage", "quantile"),
        "Steady-state latency percentile of the last closed window."),
    "perfmon_latency_baseline_seconds": (
        "gauge", "seconds", ("model", "stage", "quantile"),
        ("Learned baseline of that percentile for the last window's traffic mix (each size class's healthy "
         "reference x the baseline ratio).")),
    "perfmon_latency_threshold_seconds": (
        "gauge", "seconds", ("model", "stage", "quantile"),
        ("Baseline x ratio: above it (judged per size class, as a ratio to each class's reference) a window "
         "counts as regressed.")),
    "perfmon_regression_active": ("gauge", "boolean", ("model", "stage"), "1 while a latency regression is active."),
    "perfmon_regressions_total": ("counter", "regressions", ("model", "stage"), "Latency regressions detected."),
    "perfmon_regression_size_class_active": (
        "gauge", "boolean", ("model", "stage", "size_class"),
        "1 for each size class (log2 bucket of a call's work) an active latency regression names, else 0."),
    "perfmon_captures_total": (
        "counter", "captures", ("model", "trigger", "outcome"), "Profiler captures finished, by trigger and outcome."),
    "perfmon_captures_suppressed_total": (
        "counter", "captures", ("reason",),
        "Automatic (regression and baseline) captures not taken (cooldown, rate_limit, busy)."),
    "perfmon_capture_in_progress": ("gauge", "boolean", (), "1 while a capture is armed, recording or exporting."),
    "perfmon_capture_timestamp_seconds": (
        "gauge", "seconds", ("model", "trigger", "outcome"),
        "Unix time the last capture of this kind ended (for dashboard annotations)."),
    "perfmon_capture_comparison_seconds": (
        "gauge", "seconds", ("model", "trigger", "op", "status"),
        "Added seconds per model call of the op that changed most in the latest ok capture of this model and "
        "trigger against the model's baseline capture (op empty and status same when none changed)."),
    "perfmon_capture_duration_seconds": (
        "summary", "seconds", (), "Time capture profiler windows were open (sum and count)."),
    # -- captures uploaded to object storage (upload.py; only with trace_store set) -----------------
    "perfmon_trace_uploads_total": (
        "counter", "uploads", ("outcome",),
        "Capture uploads to trace_store: ok (trace and metadata written) or failed (an attempt; retried)."),
    "perfmon_trace_spool_files": (
        "gauge", "files", (), "Files (traces and metadata) in trace_dir waiting for upload to trace_store."),
    "perfmon_trace_spool_bytes": ("gauge", "bytes", (), "Bytes in trace_dir waiting for upload to trace_store."),
    "perfmon_trace_upload_age_seconds": (
        "gauge", "seconds", (),
        "Seconds since the last successful upload to trace_store (since the uploader started, before any)."),
    "perfmon_trace_spool_dropped_total": (
        "counter", "captures", ("reason",),
        "Captures never uploaded: removed by trace_dir retention first (retention) or unreadable (unreadable)."),
    # -- the agent's own cost (selfcost.py) ----------------------------------------------------
    "perfmon_agent_cpu_seconds_total": (
        "counter", "seconds", ("thread",), "CPU time spent by perfmon's own threads, by kind."),
    "perfmon_agent_http_refused_total": (
        "counter", "connections", ("reason",),
        "Connections the agent's HTTP server refused or cut (busy, evicted, timeout, throttled, too_large, "
        "bad_request)."),
    "perfmon_agent_http_paused_seconds_total": (
        "counter", "seconds", (),
        "Time the agent's HTTP server stopped reading because it had spent its CPU budget (http_cpu_budget)."),
    "perfmon_agent_http_listening": (
        "gauge", "boolean", (),
        "1 while the agent's HTTP port is bound; 0 while no port of its range was free (timing goes on, "
        "the bind is retried). Absent with port=None."),
    "perfmon_resolver_lag_seconds": (
        "gauge", "seconds", (), "Age of the oldest timed sample not yet resolved (0 when none)."),
    "perfmon_pending_records": ("gauge", "records", (), "Timed samples queued or waiting for their GPU events."),
    "perfmon_info": (
        "info", "", ("version", "torch_version", "cuda", "port"),
        "perfmon, torch and CUDA versions, and this process's agent port (empty when it serves none)."),
}


#: Batch-size buckets: powers of two up to 4096.
BATCH_BUCKETS: tuple[float, ...] = tuple(float(2**k) for k in range(13))


def _le(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(float(bound))


class _Histogram:
    """Bucket counts for one label set. Written by the resolver thread only; read under Metrics' lock.

    With ``native`` it also keeps exponential bucket counts (``native.py``, at most 160 ints) for the
    protobuf exposition. Each classic bucket keeps the latest exemplar that fell in it (one object per
    bucket at most, made on the first one): OpenMetrics scrapes show it, the text format does not.
    """

    __slots__ = ("bounds", "counts", "exemplars", "labels", "native", "sum")

    def __init__(self, bounds: tuple[float, ...], labels: tuple[str, ...], *, native: bool = False) -> None:
        self.bounds = bounds
        self.labels = labels  # the ``le`` strings, formatted once
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.native = NativeBuckets() if native else None
        self.exemplars: list[Exemplar | None] | None = None

    def observe(self, value: float, exemplar: Exemplar | None = None) -> None:
        # bisect_left: a value equal to a bound belongs to that bound's bucket (le = "less or equal").
        i = bisect_left(self.bounds, value)
        self.counts[i] += 1
        self.sum += value
        if self.native is not None:
            self.native.observe(value)
        if exemplar is not None:
            if self.exemplars is None:
                self.exemplars = [None] * len(self.counts)
            self.exemplars[i] = exemplar

    def cumulative(self) -> tuple[list[tuple[str, float] | tuple[str, float, Exemplar]], float]:
        out: list[tuple[str, float] | tuple[str, float, Exemplar]] = []
        total = 0
        exemplars = self.exemplars
        for i, (le, n) in enumerate(zip(self.labels, self.counts)):
            total += n
            ex = exemplars[i] if exemplars is not None else None
            out.append((le, float(total)) if ex is None else (le, float(total), ex))
        return out, self.sum


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
        registry: CollectorRegistry,
        config: Config,
        *,
        states: Callable[[], Iterable[ModelState]],
        internal: InternalErrors,
        started_ns: Callable[[], int],
        process_collectors: bool = True,
    ) -> None:
        self.registry = registry
        self._states = states
        self._started_ns = started_ns
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
        self._info = Info("perfmon", METRICS["perfmon_info"][3], registry=registry)
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

    def observe(self, sample: Sample) -> None:
        """Sink: put one resolved sample into the histograms (resolver thread)."""
        key = (sample.model, sample.device, sample.phase, sample.stage)
        with self._lock:
            hist = self._duration.get(key)
            if hist is None:
                hist = self._duration[key] = _Histogram(self._bounds, self._les, native=True)
            exemplar = None
            if sample.trace is not None:
                try:
                    exemplar = trace_exemplar(sample.trace, sample.duration_seconds, sample.end_ns)
                except (TypeError, ValueError, OverflowError):
                    exemplar = None  # ids a tracer made up: the exemplar goes, the sample stays
            hist.observe(sample.duration_seconds, exemplar)
            # On a wall clock, host time is the same measurement: exported only where they differ (CUDA).
            if sample.device.startswith("cuda"):
                host = self._host.get(key)
                if host is None:
                    host = self._host[key] = _Histogram(self._host_bounds, self._host_les, native=True)
                host.observe(sample.host_seconds)
            if sample.items is not None:
                batch = self._batch.get(sample.model)
                if batch is None:
                    batch = self._batch[sample.model] = _Histogram(BATCH_BUCKETS, self._batch_les)
                batch.observe(float(sample.items))
        if sample.seq == 0 and sample.model not in self._firsts:
            ttff = (sample.end_ns - self._started_ns()) / 1e9
            self._firsts[sample.model] = (sample.duration_seconds, max(ttff, 0.0))

    def first_call(self, model: str) -> tuple[float, float] | None:
        """(cold start seconds, time to first forward seconds) once the first call is resolved."""
        return self._firsts.get(model)

    def histograms(self) -> Iterator[Metric]:
        """The two latency histogram families (classic and native buckets), rendered from a consistent copy."""
        with self._lock:
            rows = [(name, key, h.cumulative(), h.native.snapshot() if h.native is not None else None)
                    for name, table in
                    (("perfmon_forward_duration_seconds", self._duration),
                     ("perfmon_forward_host_duration_seconds", self._host))
                    for key, h in sorted(table.items())]
            batches = [(model, h.cumulative()) for model, h in sorted(self._batch.items())]
        for name in ("perfmon_forward_duration_seconds", "perfmon_forward_host_duration_seconds"):
            fam = NativeHistogramFamily(name, METRICS[name][3], labels=["model", "device", "phase", "stage"])
            for row_name, key, (buckets, total), native in rows:
                if row_name == name:
                    fam.add_metric(list(key), buckets, total)
                    if native is not None:
                        fam.add_native(key, native)
            yield fam
        batch = HistogramMetricFamily("perfmon_forward_batch_size", METRICS["perfmon_forward_batch_size"][3],
                                      labels=["model"])
        for model, (buckets, total) in batches:
            batch.add_metric([model], buckets, total)
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
        yield from (calls, errors, sampled, dropped, cold, ttff, rate, sigs, items_fam, padded_fam, internal)
        yield from self._metrics.histograms()


def _by_model(states: Iterable[ModelState]) -> list[tuple[str, list[ModelState]]]:
    """States grouped by model name (one per stage for a generative model), in first-seen order."""
    groups: dict[str, list[ModelState]] = {}
    for st in list(states):
        groups.setdefault(st.name, []).append(st)
    return list(groups.items())


#: GpuReading.values key -> metric name.
_GPU_FIELDS = {
    "utilization_ratio": "perfmon_gpu_utilization_ratio",
    "memory_utilization_ratio": "perfmon_gpu_memory_utilization_ratio",
    "memory_used_bytes": "perfmon_gpu_memory_used_bytes",
    "memory_total_bytes": "perfmon_gpu_memory_total_bytes",
    "temperature_celsius": "perfmon_gpu_temperature_celsius",
    "power_watts": "perfmon_gpu_power_watts",
    "power_limit_watts": "perfmon_gpu_power_limit_watts",
    "energy_joules": "perfmon_gpu_energy_joules_total",
    "sm_clock_hertz": "perfmon_gpu_sm_clock_hertz",
    "sm_clock_max_hertz": "perfmon_gpu_sm_clock_max_hertz",
    "process_memory_used_bytes": "perfmon_gpu_process_memory_used_bytes",
    "process_utilization_ratio": "perfmon_gpu_process_utilization_ratio",
}

#: DeviceMemory attribute -> metric name.
_MEMORY_FIELDS = {
    "allocated_bytes": "perfmon_torch_memory_allocated_bytes",
    "reserved_bytes": "perfmon_torch_memory_reserved_bytes",
    "peak_allocated_bytes": "perfmon_torch_memory_peak_allocated_bytes",
    "peak_reserved_bytes": "perfmon_torch_memory_peak_reserved_bytes",
    "fragmentation_ratio": "perfmon_torch_memory_fragmentation_ratio",
    "alloc_retries": "perfmon_torch_alloc_retries_total",
    "ooms": "perfmon_torch_ooms_total",
}


def _family(name: str) -> Any:
    """An empty family for a declared metric (counters take their name without ``_total``)."""
    typ, _, labels, doc = METRICS[name]
    if typ == "counter":
        return CounterMetricFamily(name[: -len("_total")], doc, labels=list(labels))
    return GaugeMetricFamily(name, doc, labels=list(labels))


class TelemetryCollector(Collector):
    """Torch allocator and NVML figures at scrape time; a failing source is counted, not raised."""

    def __init__(self, *, memory: MemorySource | None, nvml: NvmlPoller | None, internal: InternalErrors,
                 oom_snapshots: Callable[[], int] | None = None) -> None:
        self._memory = memory
        self._nvml = nvml
        self._internal = internal
        self._oom_snapshots = oom_snapshots

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        snap = self._nvml.snapshot() if self._nvml is not None else None
        gpu_of = snap.index_by_uuid() if snap is not None else {}
        if self._memory is not None:
            try:
                rows = read_memory(self._memory)
            except Exception as exc:
                self._internal.report("memory", exc)
                rows = []
            if rows:
                fams = {attr: _family(name) for attr, name in _MEMORY_FIELDS.items()}
                for r in rows:
                    uuid = normalize_uuid(r.uuid)
                    gpu = gpu_of.get(uuid)
                    labels = [f"cuda:{r.device}", "" if gpu is None else str(gpu), uuid]
                    for attr, fam in fams.items():
                        fam.add_metric(labels, getattr(r, attr))
                yield from fams.values()
        if self._oom_snapshots is not None:
            fam = _family("perfmon_oom_snapshots_total")
            fam.add_metric([], self._oom_snapshots())
            yield fam
        if snap is None:
            return
        up = _family("perfmon_nvml_up")
        up.add_metric([], 1.0 if snap.up else 0.0)
        yield up
        errors = _family("perfmon_nvml_errors_total")
        for call, n in sorted(snap.errors.items()):
            errors.add_metric([call], n)
        yield errors
        if not snap.gpus:
            return
        fams = {key: _family(name) for key, name in _GPU_FIELDS.items()}
        reasons = _family("perfmon_gpu_clocks_event_reasons")
        for g in snap.gpus:
            labels = [str(g.index), g.uuid]
            for key, value in g.values.items():
                fam = fams.get(key)
                if fam is not None:
                    fam.add_metric(labels, value)
            for reason, on in g.clock_event_reasons.items():
                reasons.add_metric([*labels, reason], on)
        # A family with no sample (a field no GPU supports) is left out entirely.
        yield from (f for f in fams.values() if f.samples)
        if reasons.samples:
            yield reasons


class CaptureCollector(Collector):
    """Regression detector state and capture counts at scrape time."""

    def __init__(self, *, detector: Detector | None, controller: CaptureController) -> None:
        self._detector = detector
        self._controller = controller

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        if self._detector is not None:
            window = _family("perfmon_latency_window_seconds")
            baseline = _family("perfmon_latency_baseline_seconds")
            threshold = _family("perfmon_latency_threshold_seconds")
            ratio = self._detector.policy.ratio
            active = _family("perfmon_regression_active")
            total = _family("perfmon_regressions_total")
            classes = _family("perfmon_regression_size_class_active")
            for key, last, base, is_active, n in self._detector.views():
                model, stage = split_key(key)
                for label, named in self._detector.classes(key).items():  # at most MAX_CLASSES per series
                    classes.add_metric([model, stage, label], 1.0 if named else 0.0)
                for q, level in (("p50", "0.5"), ("p99", "0.99")):
                    if last is not None:
                        window.add_metric([model, stage, level], last.seconds[q])
                    if base is not None:
                        baseline.add_metric([model, stage, level], base[q])
                        threshold.add_metric([model, stage, level], base[q] * ratio)
                active.add_metric([model, stage], 1.0 if is_active else 0.0)
                total.add_metric([model, stage], n)
            yield from (window, baseline, threshold, active, total, classes)
        c = self._controller
        captures = _family("perfmon_captures_total")
        for (model, trigger, outcome), n in sorted(c.finished.items()):
            captures.add_metric([model, trigger, outcome], n)
        yield captures
        stamps = _family("perfmon_capture_timestamp_seconds")
        for (model, trigger, outcome), t in sorted(c.last_finished.items()):
            stamps.add_metric([model, trigger, outcome], t)
        yield stamps
        # One series per (model, trigger): the top change of its latest compared capture (bounded labels;
        # the dashboard joins it onto the capture annotations).
        comparison = _family("perfmon_capture_comparison_seconds")
        for (model, trigger), (op, status, added) in sorted(c.comparisons.items()):
            comparison.add_metric([model, trigger, op, status], added)
        yield comparison
        suppressed = _family("perfmon_captures_suppressed_total")
        for reason, n in c.suppressed.items():
            suppressed.add_metric([reason], n)
        yield suppressed
        progress = _family("perfmon_capture_in_progress")
        progress.add_metric([], 0.0 if c.state == "idle" else 1.0)
        yield progress
        summary = SummaryMetricFamily("perfmon_capture_duration_seconds",
                                      METRICS["perfmon_capture_duration_seconds"][3],
                                      count_value=c.duration_count, sum_value=c.duration_sum)
        yield summary


class UploadCollector(Collector):
    """The trace uploader's counters and spool at scrape time (``uploader`` has ``stats`` and ``clock``)."""

    def __init__(self, uploader: Any) -> None:
        self._uploader = uploader

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        stats = self._uploader.stats
        uploads = _family("perfmon_trace_uploads_total")
        for outcome, n in stats.uploads.items():  # every outcome, zeros included: rate() sees the first failure
            uploads.add_metric([outcome], n)
        dropped = _family("perfmon_trace_spool_dropped_total")
        for reason, n in stats.dropped.items():
            dropped.add_metric([reason], n)
        files = _family("perfmon_trace_spool_files")
        files.add_metric([], stats.spool_files)
        size = _family("perfmon_trace_spool_bytes")
        size.add_metric([], stats.spool_bytes)
        age = _family("perfmon_trace_upload_age_seconds")
        age.add_metric([], max(0.0, self._uploader.clock() - stats.last_ok))
        yield from (uploads, dropped, files, size, age)


class AgentCollector(Collector):
    """The agent's own cost at scrape time."""

    def __init__(self, *, cpu: AgentCpu, resolver: Any, http: HttpShedding,
                 listening: Callable[[], int | None] = lambda: None) -> None:
        self._cpu = cpu
        self._resolver = resolver
        self._http = http
        self._listening = listening

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        cpu = _family("perfmon_agent_cpu_seconds_total")
        for thread, seconds in sorted(self._cpu.totals().items()):
            cpu.add_metric([thread], seconds)
        lag = _family("perfmon_resolver_lag_seconds")
        lag.add_metric([], self._resolver.lag_seconds())
        pending = _family("perfmon_pending_records")
        pending.add_metric([], self._resolver.pending)
        refused = _family("perfmon_agent_http_refused_total")
        for reason, n in self._http.refused.items():
            refused.add_metric([reason], n)
        paused = _family("perfmon_agent_http_paused_seconds_total")
        paused.add_metric([], self._http.paused_seconds)
        yield from (cpu, lag, pending, refused, paused)
        listening = self._listening()
        if listening is not None:
            up = _family("perfmon_agent_http_listening")
            up.add_metric([], listening)
            yield up


def _versions() -> dict[str, str]:
    try:
        import torch

        torch_version = str(torch.__version__)
        cuda = str(torch.version.cuda or "none")
    except Exception:  # pragma: no cover - torch is a dependency
        torch_version, cuda = "unknown", "none"
    return {"version": __version__, "torch_version": torch_version, "cuda": cuda}


def _register_process_collectors(registry: CollectorRegistry) -> None:
    """Process RSS/CPU/fds and platform info, unless the registry already has them.

    Not the GC collector: its nine series per scrape tell little about inference latency and the
    scrape budget (~30 KB for one model and one GPU) is better spent on buckets.
    """
    from prometheus_client import REGISTRY

    if registry is REGISTRY:
        return  # prometheus_client registered its defaults there on import
    for make in (lambda: ProcessCollector(registry=registry),
                 lambda: PlatformCollector(registry=registry)):
        try:
            make()
        except ValueError:
            pass  # already registered by the caller


#: Generation histogram -> its bounds (fixed: dashboards and alert rules rely on them, docs/metrics.md).
#: Generation histograms that also carry native buckets in protobuf scrapes: the two latency signals.
#: (Duration and token counts stay classic: coarse on purpose, see generation.py.)
NATIVE_GENERATION = frozenset({"perfmon_time_to_first_token_seconds", "perfmon_inter_token_latency_seconds"})
GENERATION_HISTOGRAMS: dict[str, tuple[float, ...]] = {
    "perfmon_time_to_first_token_seconds": TTFT_BUCKETS,
    "perfmon_inter_token_latency_seconds": ITL_BUCKETS,
    "perfmon_generation_duration_seconds": DURATION_BUCKETS,
    "perfmon_generation_prompt_tokens": TOKEN_BUCKETS,
    "perfmon_generation_output_tokens": TOKEN_BUCKETS,
}


class GenerationCollector(Collector):
    """Generation requests: exact counts read from the tracker at scrape time, histograms fed by its drain.

    ``observe`` is the tracker's sink (resolver thread); the histograms are perfmon's own store, as
    for forwards. An ITL observation can stand for n tokens (a chunk): it adds n to its bucket.
    """

    def __init__(self, tracker: GenerationTracker) -> None:
        self._tracker = tracker
        self._les = {name: tuple(_le(b) for b in (*bounds, math.inf)) for name, bounds in GENERATION_HISTOGRAMS.items()}
        self._hists: dict[tuple[str, str], _Histogram] = {}  # (metric, model)
        self._lock = threading.Lock()

    def reset_after_fork(self) -> None:
        self._hists = {}
        self._lock = threading.Lock()

    def _add(self, name: str, model: str, value: float, weight: int = 1) -> None:
        """Lock held."""
        h = self._hists.get((name, model))
        if h is None:
            h = self._hists[(name, model)] = _Histogram(GENERATION_HISTOGRAMS[name], self._les[name],
                                                        native=name in NATIVE_GENERATION)
        h.counts[bisect_left(h.bounds, value)] += weight
        h.sum += value * weight
        if h.native is not None:
            h.native.observe(value, weight)

    def observe(self, events: list[GenerationEvent]) -> None:
        """Sink: a batch of generation events into the histograms (resolver thread)."""
        with self._lock:
            for event in events:
                if isinstance(event, TokenTiming):
                    if event.kind == "ttft":
                        self._add("perfmon_time_to_first_token_seconds", event.model, event.seconds)
                    else:
                        self._add("perfmon_inter_token_latency_seconds", event.model, event.seconds, event.tokens)
                elif event.outcome == "ok":  # as for forwards: a failed or cancelled request's length is not its speed
                    self._add("perfmon_generation_duration_seconds", event.model, event.duration_seconds)
                    self._add("perfmon_generation_output_tokens", event.model, float(event.output_tokens))
                    if event.prompt_tokens is not None:
                        self._add("perfmon_generation_prompt_tokens", event.model, float(event.prompt_tokens))

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        requests = _family("perfmon_generation_requests_total")
        prompt = _family("perfmon_prompt_tokens_total")
        generated = _family("perfmon_generated_tokens_total")
        dropped = _family("perfmon_generation_dropped_total")
        for c in self._tracker.names():
            m = c.name
            for outcome in OUTCOMES:
                requests.add_metric([m, outcome], count_value(c.requests[outcome]))
            prompt.add_metric([m], c.prompt)
            generated.add_metric([m], count_value(c.generated))
            for reason in GENERATION_DROP_REASONS:
                dropped.add_metric([m, reason], count_value(c.dropped[reason]))
        yield from (requests, prompt, generated, dropped)
        with self._lock:
            rows = [(name, model, h.cumulative(), h.native.snapshot() if h.native is not None else None)
                    for (name, model), h in sorted(self._hists.items())]
        for name in GENERATION_HISTOGRAMS:
            fam = NativeHistogramFamily(name, METRICS[name][3], labels=["model"])
            for row_name, model, (buckets, total), native in rows:
                if row_name == name:
                    fam.add_metric([model], buckets, total)
                    if native is not None:
                        fam.add_native((model,), native)
            yield fam
