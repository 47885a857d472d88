"""Every metric perfmon exports, declared once: name, type, unit, labels and help, and the fixed bucket bounds.

docs/metrics.md lists the same (a test keeps the two and the registry in step); the histogram store
(``store.py``) and the scrape-time collectors (``collectors.py``) build their families from here.
"""

from __future__ import annotations

from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..agent.generation import DURATION_BUCKETS, ITL_BUCKETS, TOKEN_BUCKETS, TTFT_BUCKETS
from ..agent.requests import REQUEST_BUCKETS

__all__ = ["BATCH_BUCKETS", "GC_PAUSE_BUCKETS", "GENERATION_HISTOGRAMS", "METRICS", "NATIVE_GENERATION",
           "REQUEST_HISTOGRAMS", "Declared"]

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
    "perfmon_forward_failed_calls_total": (
        "counter", "calls", ("model",),
        "Calls that raised, every exception class together; exported at 0 from the model's wrap, so rate() and "
        "increase() see a first error (a new exception label's series would miss what came before its first "
        "scrape)."),
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
        "gauge", "seconds", ("model",), "From monitor start (its own start-up apart; its construction for a model "
        "called before start()) to the end of the model's first call."),
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
        "counter", "tokens", ("model",),
        "Real prompt tokens of generation requests (padding apart), once per input row, exact."),
    "perfmon_prompt_padding_tokens_total": (
        "counter", "tokens", ("model",),
        "Padding positions of generate() prompts (the attention mask's zeros): work done, not tokens sent."),
    "perfmon_generation_verify_tokens_total": (
        "counter", "tokens", ("model",),
        "Tokens produced by speculative verify steps (accepted drafts + 1 each); steps: forward calls stage=verify."),
    "perfmon_generated_tokens_total": (
        "counter", "tokens", ("model",), "Tokens handed to callers by generation requests, counted as they go, exact."),
    "perfmon_generation_prompt_tokens": (
        "histogram", "tokens", ("model",), "Prompt tokens per generation request that ended ok (when given)."),
    "perfmon_generation_output_tokens": (
        "histogram", "tokens", ("model",), "Tokens generated per generation request that ended ok."),
    "perfmon_generation_dropped_total": (
        "counter", "records", ("model", "reason"),
        "Generation timings never recorded: queue_full, live_limit (request counted, not timed), after_finish."),
    # -- request spans (agent/requests.py): monitor.request, the middlewares, monitor.batch -----------
    "perfmon_request_seconds": (
        "histogram", "seconds", ("model", "part"),
        "A served request's latency by part: queue (enqueued to model start), model (first model work's start to "
        "the last one's end), rest (the remainder: pre/post-processing, sending); requests that ended ok after "
        "model work."),
    "perfmon_request_duration_seconds": (
        "histogram", "seconds", ("model",),
        "A served request's end-to-end latency, arrival to response sent (queue + model + rest); requests that "
        "ended ok after model work."),
    "perfmon_requests_total": (
        "counter", "requests", ("model", "outcome"),
        "Request spans that ended, by outcome (ok, error, cancelled); model is the span's name, else its first "
        "model work's model, else empty (no model work)."),
    # -- continuous batching (agent/batching.py): transformers' ContinuousBatchingManager steps --------
    "perfmon_batch_tokens_total": (
        "counter", "tokens", ("model", "kind"),
        "Tokens in the model's continuous-batching steps, by kind (prefill: prompt positions, decode: generated "
        "ones; padding excluded), counted as each step is scheduled, exact."),
    # -- garbage collection (telemetry/gcpauses.py): the serving process's collector pauses -----------
    "perfmon_gc_pause_seconds": (
        "histogram", "seconds", ("generation",),
        "Garbage-collection pauses of the process (gc.callbacks, start to stop, any thread), by generation "
        "(0, 1, 2): every thread waits for the GIL meanwhile."),
    "perfmon_gc_collected_objects_total": (
        "counter", "objects", ("generation",), "Unreachable objects the collector found, by generation."),
    "perfmon_samples_gc_overlap_total": (
        "counter", "samples", ("model",),
        "Timed calls (resolved samples, cold and steady) whose host interval overlapped a GC pause of any generation."),
    # -- live efficiency (stats/efficiency.py, agent/flopcount.py): counted FLOPs and bytes over sampled time --
    "perfmon_model_flops_per_second": (
        "gauge", "flops_per_second", ("model", "stage"),
        "Achieved FLOP/s while the model runs: the counted FLOPs of the window's steady samples over their measured "
        "time (device time on GPU, wall time on CPU); absent while no sample of the window is counted."),
    "perfmon_model_bytes_per_second": (
        "gauge", "bytes_per_second", ("model", "stage"),
        "Achieved memory traffic while the model runs (an estimate: each non-view op's tensor inputs and outputs), "
        "over the same samples and time as the FLOP/s."),
    "perfmon_model_mfu_ratio": (
        "gauge", "ratio", ("model", "stage"),
        "Model FLOPs utilization: achieved FLOP/s over the device's peak (16-bit or 32-bit by the ops' dtypes); "
        "absent where the device has no peak (CPUs, unknown GPUs without peak_flops)."),
    "perfmon_model_mbu_ratio": (
        "gauge", "ratio", ("model", "stage"),
        "Model bandwidth utilization: achieved bytes/s over the device's peak memory bandwidth; absent without "
        "a peak."),
    "perfmon_model_flops_unknown_ratio": (
        "gauge", "ratio", ("model", "stage"),
        "Share of the window's steady samples whose signature has no count (unknown, or not counted yet): left out "
        "of the rates, never guessed."),
    "perfmon_model_peak_info": (
        "info", "", ("model", "stage", "device", "source"),
        "The peak MFU and MBU are computed against: the device label and where the peak came from (settings or "
        "the GPU table)."),
    "perfmon_flop_counts_total": (
        "counter", "counts", ("outcome",),
        "Signature counts (a fake forward off the request thread), by outcome: ok, skipped (unsafe to run or no "
        "inputs to rebuild), failed, timeout, deferred (budget spent; retried at a later sample)."),
    "perfmon_flop_count_seconds_total": (
        "counter", "seconds", (),
        "Time spent counting signatures' FLOPs and bytes (fake copies, fake forwards), the count's pauses apart."),
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
        "Seconds since the last successful upload to trace_store (before any: since the uploader started, or the "
        "oldest waiting capture was saved if earlier)."),
    "perfmon_trace_spool_dropped_total": (
        "counter", "captures", ("reason",),
        "Captures never uploaded: removed by trace_dir retention first (retention) or unreadable (unreadable)."),
    # -- GPU occupancy and launch-bound detection (stats/occupancy.py), CUDA models only -------------
    "perfmon_model_occupancy_ratio": (
        "gauge", "ratio", ("model",),
        "Device busy time (the union of the call's kernel intervals) over the call's device span, from the model's "
        "newest CUDA capture (0-1; absent without one younger than occupancy_capture_max_age_seconds)."),
    "perfmon_model_host_bound": (
        "gauge", "boolean", ("model",),
        "1 when the host, not the device, sets the model's pace (launch-bound: a faster GPU buys nothing), else 0: "
        "the capture's occupancy under 0.5, or without a capture the live host/device ratio at 0.9 or more."),
    "perfmon_model_host_device_ratio": (
        "gauge", "ratio", ("model",),
        "Median over the /stats window of each steady CUDA call's host time over its device span (can pass 1): near "
        "1 the device finished right after the host's last launch; far below, the host only enqueues."),
    "perfmon_model_occupancy_timestamp_seconds": (
        "gauge", "seconds", ("model",),
        "Unix time the capture behind perfmon_model_occupancy_ratio and the host-bound verdict ended."),
    # -- the agent's own cost (selfcost.py) ----------------------------------------------------
    "perfmon_agent_cpu_seconds_total": (
        "counter", "seconds", ("thread",), "CPU time spent by perfmon's own threads, by kind."),
    "perfmon_agent_wakeups_total": (
        "counter", "wakeups", ("thread",),
        "Times each of perfmon's background threads woke up (resolver, http, nvml, upload, health). On a GIL-bound "
        "server each wake takes the GIL from the serving thread at least once: rate() is what to watch."),
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

#: GC pause buckets (s): 1-2.5-5 per decade from 10 µs to 1 s, then 2.5 s. A gen-0 pause is tens of µs, a
#: gen-2 one over a large heap tens to hundreds of ms. 17 bounds, 20 series per generation.
GC_PAUSE_BUCKETS: tuple[float, ...] = tuple(
    float(f"{m * 10.0**e:.3g}") for e in range(-5, 0) for m in (1, 2.5, 5)
) + (1.0, 2.5)

#: Generation histogram -> its bounds (fixed: dashboards and alert rules rely on them, docs/metrics.md).
GENERATION_HISTOGRAMS: dict[str, tuple[float, ...]] = {
    "perfmon_time_to_first_token_seconds": TTFT_BUCKETS,
    "perfmon_inter_token_latency_seconds": ITL_BUCKETS,
    "perfmon_generation_duration_seconds": DURATION_BUCKETS,
    "perfmon_generation_prompt_tokens": TOKEN_BUCKETS,
    "perfmon_generation_output_tokens": TOKEN_BUCKETS,
}
#: Request histograms -> their bounds (one grid for every part and the duration: parts add up to the total).
REQUEST_HISTOGRAMS: dict[str, tuple[float, ...]] = {
    "perfmon_request_seconds": REQUEST_BUCKETS,
    "perfmon_request_duration_seconds": REQUEST_BUCKETS,
}
#: Generation histograms that also carry native buckets in protobuf scrapes: the two latency signals.
#: (Duration and token counts stay classic: coarse on purpose, see generation.py.)
NATIVE_GENERATION = frozenset({"perfmon_time_to_first_token_seconds", "perfmon_inter_token_latency_seconds"})


class Declared:
    """A collector that exports nothing and describes every family perfmon exports (its Info apart, which describes
    itself): registered first, it makes a registry refuse a clash with these names, on either side. perfmon's
    scrape-time collectors describe nothing (their families depend on the models), so without it another
    collector's ``perfmon_forward_calls`` went on a shared ``/metrics`` twice, which Prometheus refuses to ingest."""

    def describe(self) -> list[Metric]:
        out = []
        for name, (typ, _, _, doc) in METRICS.items():
            if typ != "info":
                out.append(Metric(name.removesuffix("_total") if typ == "counter" else name, doc, typ))
        return out

    def collect(self) -> list[Metric]:
        return []


def _family(name: str) -> Any:
    """An empty family for a declared metric (counters take their name without ``_total``)."""
    typ, _, labels, doc = METRICS[name]
    if typ == "counter":
        return CounterMetricFamily(name[: -len("_total")], doc, labels=list(labels))
    return GaugeMetricFamily(name, doc, labels=list(labels))
