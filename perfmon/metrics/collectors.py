"""Scrape-time collectors for all but forward calls: telemetry, captures, uploads, agent cost, generation requests.

Each reads its source when Prometheus scrapes (a source that fails is counted, not raised) and builds
its families from the declarations in ``catalog.py``.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import Metric, SummaryMetricFamily
from prometheus_client.registry import Collector

from ..agent.batching import BatchTokens
from ..agent.generation import DROP_REASONS as GENERATION_DROP_REASONS
from ..agent.generation import GenerationEvent, GenerationTracker, TokenRun, TokenTiming
from ..agent.records import Sample, split_key
from ..agent.streams import OUTCOMES
from ..captures.controller import CaptureController
from ..captures.detector import Detector
from ..faults import InternalErrors, count_value
from ..selfcost import AgentCpu, HttpShedding
from ..telemetry.gcpauses import GENERATIONS, Pause
from ..telemetry.memory import MemorySource, read_memory
from ..telemetry.nvml import NvmlPoller, normalize_uuid
from .catalog import GC_PAUSE_BUCKETS, GENERATION_HISTOGRAMS, METRICS, NATIVE_GENERATION, _family
from .family import HistogramRows
from .store import _Histogram, _le

__all__ = ["AgentCollector", "BatchCollector", "CaptureCollector", "GcCollector", "GenerationCollector",
           "TelemetryCollector", "UploadCollector"]


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


class TelemetryCollector(Collector):
    """Torch allocator and NVML figures at scrape time; a failing source is counted, not raised."""

    def __init__(self, *, memory: MemorySource | None, nvml: NvmlPoller | None, internal: InternalErrors,
                 oom_snapshots: Callable[[], int] | None = None) -> None:
        self._memory = memory
        self._nvml = nvml
        self._internal = internal
        self._oom_snapshots = oom_snapshots
        #: NVML's index of each GPU UUID seen (fixed for the process's life): the allocator series keep their gpu
        #: label when NVML fails later; it went "0" -> "", a new series, and an OOM counted at the flip was lost
        #: to increase() (PerfmonTorchOOMs) and the GPU dashboard's panels split in two.
        self._gpu_of: dict[str, int] = {}

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        snap = self._nvml.snapshot() if self._nvml is not None else None
        if snap is not None:
            self._gpu_of.update(snap.index_by_uuid())
        gpu_of = self._gpu_of
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
        for (model, trigger, outcome), n in sorted(c.counts.finished.items()):
            captures.add_metric([model, trigger, outcome], n)
        yield captures
        stamps = _family("perfmon_capture_timestamp_seconds")
        for (model, trigger, outcome), t in sorted(c.counts.last_finished.items()):
            stamps.add_metric([model, trigger, outcome], t)
        yield stamps
        # One series per (model, trigger): the top change of its latest compared capture (bounded labels;
        # the dashboard joins it onto the capture annotations).
        comparison = _family("perfmon_capture_comparison_seconds")
        for (model, trigger), (op, status, added) in sorted(c.counts.comparisons.items()):
            comparison.add_metric([model, trigger, op, status], added)
        yield comparison
        suppressed = _family("perfmon_captures_suppressed_total")
        for reason, n in c.counts.suppressed.items():
            suppressed.add_metric([reason], n)
        yield suppressed
        progress = _family("perfmon_capture_in_progress")
        progress.add_metric([], 0.0 if c.state == "idle" else 1.0)
        yield progress
        summary = SummaryMetricFamily("perfmon_capture_duration_seconds",
                                      METRICS["perfmon_capture_duration_seconds"][3],
                                      count_value=c.counts.duration_count, sum_value=c.counts.duration_sum)
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
        wakes = _family("perfmon_agent_wakeups_total")
        for thread, n in sorted(self._cpu.wakes().items()):
            wakes.add_metric([thread], n)
        lag = _family("perfmon_resolver_lag_seconds")
        lag.add_metric([], self._resolver.lag_seconds())
        pending = _family("perfmon_pending_records")
        pending.add_metric([], self._resolver.pending)
        refused = _family("perfmon_agent_http_refused_total")
        for reason, n in self._http.refused.items():
            refused.add_metric([reason], n)
        paused = _family("perfmon_agent_http_paused_seconds_total")
        paused.add_metric([], self._http.paused_seconds)
        yield from (cpu, wakes, lag, pending, refused, paused)
        listening = self._listening()
        if listening is not None:
            up = _family("perfmon_agent_http_listening")
            up.add_metric([], listening)
            yield up


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

    def _hist(self, name: str, model: str) -> _Histogram:
        """Lock held."""
        h = self._hists.get((name, model))
        if h is None:
            h = self._hists[(name, model)] = _Histogram(GENERATION_HISTOGRAMS[name], self._les[name],
                                                        native=name in NATIVE_GENERATION)
        return h

    def _add(self, name: str, model: str, value: float, weight: int = 1) -> None:
        """Lock held."""
        self._hist(name, model).observe(value, weight=weight)

    def observe(self, events: list[GenerationEvent]) -> None:
        """Sink: a batch of generation events into the histograms (resolver thread)."""
        with self._lock:
            for event in events:
                if isinstance(event, TokenRun):  # a request's inter-token gaps, folded in one loop
                    self._hist("perfmon_inter_token_latency_seconds", event.model).observe_many(event.seconds,
                                                                                                event.tokens)
                elif isinstance(event, TokenTiming):
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
        padding = _family("perfmon_prompt_padding_tokens_total")
        verify = _family("perfmon_generation_verify_tokens_total")
        generated = _family("perfmon_generated_tokens_total")
        dropped = _family("perfmon_generation_dropped_total")
        for c in self._tracker.names():
            m = c.name
            for outcome in OUTCOMES:
                requests.add_metric([m, outcome], count_value(c.requests[outcome]))
            prompt.add_metric([m], c.prompt)
            padding.add_metric([m], c.padding)
            verify.add_metric([m], count_value(c.verify))
            generated.add_metric([m], count_value(c.generated))
            for reason in GENERATION_DROP_REASONS:
                dropped.add_metric([m, reason], count_value(c.dropped[reason]))
        yield from (requests, prompt, padding, verify, generated, dropped)
        with self._lock:
            rows = [(name, h.row((model,))) for (name, model), h in sorted(self._hists.items())]
        for name in GENERATION_HISTOGRAMS:
            fam = HistogramRows(name, METRICS[name][3], labels=["model"])
            for row_name, row in rows:
                if row_name == name:
                    fam.add_row(row)
            yield fam


class BatchCollector(Collector):
    """Continuous-batching step tokens by model and kind (agent/batching.py), exact, read at scrape time."""

    def __init__(self, tokens: BatchTokens) -> None:
        self._tokens = tokens

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        fam = _family("perfmon_batch_tokens_total")
        for model, prefill, decode in self._tokens.rows():  # only models that ran a step: no zeros for the rest
            fam.add_metric([model, "prefill"], prefill)
            fam.add_metric([model, "decode"], decode)
        yield fam


class GcCollector(Collector):
    """GC pauses by generation (``observe``: GcPauses' sink) and timed calls that overlapped one (``sample``: a
    resolver sink), both fed on the resolver thread; every generation and every model exported, zeros included."""

    def __init__(self, models: Callable[[], Iterator[str] | list[str]]) -> None:
        self._models = models
        self._les = tuple(_le(b) for b in (*GC_PAUSE_BUCKETS, math.inf))
        self.reset_after_fork()

    def reset_after_fork(self) -> None:
        """Empty (also the initial state): the parent's pauses are the parent's."""
        self._pauses = {g: _Histogram(GC_PAUSE_BUCKETS, self._les) for g in GENERATIONS}
        self._collected = dict.fromkeys(GENERATIONS, 0)
        self._overlaps: dict[str, int] = {}
        self._lock = threading.Lock()

    def observe(self, pauses: list[Pause]) -> None:
        """Sink: a drained batch of pauses into the histogram and the collected-objects counts."""
        with self._lock:
            for start, end, gen, collected in pauses:
                g = min(max(gen, 0), 2)
                self._pauses[g].observe((end - start) / 1e9)
                self._collected[g] += collected

    def sample(self, samples: list[Sample]) -> None:
        """Resolver sink: count the timed calls of a pass that overlapped a pause."""
        overlaps = self._overlaps
        for sample in samples:
            if sample.gc_generation >= 0:
                overlaps[sample.model] = overlaps.get(sample.model, 0) + 1

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            rows = [h.row((str(g),)) for g, h in self._pauses.items()]
            collected = dict(self._collected)
        fam = HistogramRows("perfmon_gc_pause_seconds", METRICS["perfmon_gc_pause_seconds"][3], labels=["generation"])
        for row in rows:
            fam.add_row(row)
        yield fam
        objects = _family("perfmon_gc_collected_objects_total")
        for g, n in collected.items():
            objects.add_metric([str(g)], n)
        yield objects
        overlaps = _family("perfmon_samples_gc_overlap_total")
        for model in self._models():
            overlaps.add_metric([model], self._overlaps.get(model, 0))
        yield overlaps
