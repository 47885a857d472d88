"""The composition root's parts: each stage a ``Monitor`` builds from its settings, wired to the others.

``monitor.py`` keeps the order (what exists, start, stop, fork); the functions here say how one stage is made and
whom it feeds: the scrape-time collectors, the occupancy and efficiency stages, GC pauses, telemetry, what a
regression's reason gets besides the detector's own, and the trace directory's sweep at start.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from .agent.flopcount import FlopCounter
from .agent.records import STEADY
from .agent.state import Hub
from .captures.moved import host_device, queue_moved
from .captures.roofline import device_peaks
from .config import Config
from .metrics.collectors import (
    AgentCollector,
    BatchCollector,
    CaptureCollector,
    GcCollector,
    TelemetryCollector,
    UploadCollector,
)
from .metrics.efficiency import EfficiencyCollector
from .metrics.occupancy import OccupancyCollector
from .metrics.requests import RequestCollector
from .stats.efficiency import Efficiency
from .stats.gc import GcView
from .stats.occupancy import Occupancy
from .store.uploader import upload_view
from .telemetry.gcpauses import GcPauses
from .telemetry.memory import MemorySource, OomSnapshotter, TorchMemory
from .telemetry.nvml import NvmlPoller

#: The ``Monitor`` being built (typed loosely: this module is monitor.py's, which imports it).
Monitor = Any

__all__ = ["explainers", "gc_stage", "peaks", "register_collectors", "sweep_trace_dir", "telemetry"]


def register_collectors(monitor: Monitor) -> None:
    """The collectors that read the stages at scrape time (the histograms register themselves), and the
    efficiency stage (``efficiency_stage``), which feeds one of them and /stats."""
    reg, oom = monitor._registrations, monitor.oom
    monitor._views.efficiency = _efficiency_stage(monitor)
    reg.register(monitor._generation_metrics)
    reg.register(BatchCollector(monitor.models.batch_tokens))
    requests = RequestCollector(monitor.requests)
    monitor.requests.sinks.append(requests.observe)
    monitor.requests.on_fork.append(requests.reset_after_fork)
    reg.register(requests)
    reg.register(CaptureCollector(detector=monitor.detector, controller=monitor.captures))
    if monitor.uploads is not None:
        reg.register(UploadCollector(monitor.uploads))
        uploads = monitor.uploads
        monitor._views.sections.append(lambda: upload_view(uploads))
    reg.register(AgentCollector(cpu=monitor.cpu, resolver=monitor.resolver, http=monitor._hub.http,
                                listening=lambda: monitor.ports.listening(monitor._running)))
    if monitor._gc:
        reg.register(monitor._gc[1])
    reg.register(TelemetryCollector(memory=monitor._memory, nvml=monitor.nvml_poller, internal=monitor.internal,
                                    oom_snapshots=(lambda: len(oom.written)) if oom is not None else None))
    _occupancy_stage(monitor)


def _occupancy_stage(monitor: Monitor) -> None:
    """GPU occupancy and the host-bound verdict (stats/occupancy.py): a resolver sink, a capture listener, a /stats
    section per model, four gauges. Its fork reset rides the request tracker's hook (Monitor is at its line limit)."""
    cfg = monitor.config
    occupancy = Occupancy(models=monitor.models, store=monitor.traces, window_seconds=cfg.stats_window_seconds,
                          max_age_seconds=cfg.occupancy_capture_max_age_seconds)
    monitor.resolver.sinks.append(occupancy.sample)
    monitor.captures.exporter.listeners.append(occupancy.capture_done)
    monitor.requests.on_fork.append(occupancy.reset_after_fork)
    monitor._views.model_sections.append(lambda name, now: ("occupancy", occupancy.model(name, now)))
    monitor._registrations.register(OccupancyCollector(occupancy.rows, monitor.internal))


def _efficiency_stage(monitor: Monitor) -> Efficiency | None:
    """Live FLOP/s, bytes/s, MFU and MBU (``count_flops``): a resolver sink that keeps steady samples and has each new
    signature counted once (agent/flopcount.py, its own thread), read by /stats and the collector; None when off."""
    cfg, models = monitor.config, monitor.models
    if not cfg.count_flops:
        return None

    def state_of(model: str, stage: str) -> Any:
        st = models.get(model)
        return st.stages.get(stage) if st is not None and st.stages else st

    # A CudaBackend written before own_stream existed still works: its counts run on the thread's current stream.
    counter = FlopCounter(per_minute=cfg.flop_counts_per_minute, timeout_seconds=cfg.flop_count_timeout_seconds,
                          share=cfg.flop_count_share, cpu=monitor.cpu,
                          streams=getattr(monitor._hub.backend, "own_stream", None))
    eff = Efficiency(counter, window_seconds=cfg.stats_window_seconds,
                     peaks=functools.partial(peaks, cfg), state_of=state_of)
    monitor.resolver.sinks.append(eff.observe)
    monitor.resolver.on_stop.append(eff.stop)  # once the resolver, which feeds the counter, has stopped
    monitor._registrations.register(EfficiencyCollector(eff, monitor.internal))
    return eff


def peaks(cfg: Config, device: str) -> Any:
    """The device peaks for a capture's roofline (the configured ones win)."""
    return device_peaks(device, peak_flops=cfg.peak_flops, peak_bandwidth=cfg.peak_bandwidth)


def explainers(monitor: Monitor) -> list[Callable[[str, str, int, int], tuple[str, Any]]]:
    """What a regression's reason gets besides the detector's own: host vs device and queue (captures/moved.py)."""
    return [functools.partial(_host_device, monitor), functools.partial(_queue, monitor)]


def _queue(monitor: Monitor, model: str, stage: str, since_ns: int, until_ns: int) -> tuple[str, Any]:
    """A regression's ``queue`` entry: its request spans during the regressed windows vs as long before them."""
    during = monitor.requests.recent(model, since_ns, until_ns)
    before = monitor.requests.recent(model, 2 * since_ns - until_ns, since_ns)
    return "queue", queue_moved(before, during)


def _host_device(monitor: Monitor, model: str, stage: str, since_ns: int, until_ns: int) -> tuple[str, Any]:
    """A regression's ``host_device`` entry: host and device time before vs during its windows (/stats windows)."""
    st = monitor.models.get(model)
    before, during = monitor.windows.split(model, STEADY, since_ns, until_ns, stage)
    return "host_device", host_device(before, during, device_clock=st is not None and st.cuda_index >= 0)


def gc_stage(monitor: Monitor) -> tuple[GcPauses | None, tuple[GcView, GcCollector] | tuple[()]]:
    """GC pauses (``gc_pauses``): the resolver marks samples, the generation tick marks requests, a regression's
    reason gets a ``gc`` entry, the collector exports pauses and overlaps. Installed by start(), removed by stop()."""
    cfg = monitor.config
    if not cfg.gc_pauses:
        return None, ()
    keep = max(cfg.stats_window_seconds, 120.0)  # the /stats window, and a regression's windows (2 x 10 s, or longer)
    pauses = GcPauses(internal=monitor.internal, keep_seconds=keep)
    view = GcView(pauses, monitor.windows, window_seconds=cfg.stats_window_seconds, max_samples=cfg.stats_max_samples)
    collector = GcCollector(lambda: list(monitor.models.by_name))
    pauses.sinks.append(collector.observe)
    monitor.resolver.annotate = pauses.mark
    monitor.resolver.sinks.append(collector.sample)
    monitor.generations.sinks.append(view.generation_sink)
    monitor.policy.explainers.append(lambda model, stage, since, until: ("gc",
                                                                         view.regression(model, stage, since, until)))
    return pauses, (view, collector)


def telemetry(cfg: Config, hub: Hub, memory: MemorySource | None, nvml: Any,
               logger: Callable[..., Any]) -> tuple[MemorySource | None, NvmlPoller | None, OomSnapshotter | None]:
    """The telemetry stage: torch's allocator (with CUDA, unless given), the NVML poller, the OOM snapshotter."""
    if memory is None and torch.cuda.is_available():
        memory = TorchMemory()
    poller = None if not cfg.nvml else NvmlPoller(nvml, interval_seconds=cfg.nvml_interval_seconds, cpu=hub.cpu,
                                                  log=logger(component="nvml"))
    oom = None
    if cfg.oom_snapshot and memory is not None:
        log = logger(component="monitor")
        oom = hub.on_oom = OomSnapshotter(
            memory, cfg.trace_dir, cfg.oom_snapshot_cooldown_seconds,
            on_written=lambda path: log.warning("oom_snapshot_written", path=str(path)),
            on_error=lambda exc: hub.internal.report("oom_snapshot", exc))
    return memory, poller, oom


def sweep_trace_dir(monitor: Monitor) -> None:
    """At start: clear stale temp files; an unusable trace_dir is logged and fails captures, never the start."""
    try:
        unusable = monitor.traces.sweep_temp()
    except Exception as exc:
        monitor.internal.report("trace_store", exc)
        unusable = str(exc)
    if unusable is not None:
        monitor.log.error("trace_dir_refused", trace_dir=monitor.config.trace_dir, reason=unusable,
                          note="captures are refused until it is fixed; monitoring goes on")
