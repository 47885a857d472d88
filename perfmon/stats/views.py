"""What ``/stats``, ``/healthz`` and the status page's history read: one monitor's state as plain dicts.

Pure reads of the stages' own state (counters, windows, the detector, the capture slot, telemetry);
nothing here is on the request path. Times are seconds, sizes bytes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from time import perf_counter_ns
from typing import Any

from .._version import __version__
from ..agent.generation import GenerationTracker
from ..agent.models import Models
from ..agent.records import STEADY, series_key
from ..agent.requests import RequestTracker
from ..agent.resolver import Resolver
from ..agent.state import Hub, ModelState
from ..captures.controller import CaptureController
from ..captures.detector import Detector
from ..config import Config
from ..faults import count_value
from ..metrics.store import Metrics
from ..store.traces import TraceStore
from ..telemetry.memory import MemorySource, read_memory
from ..telemetry.nvml import NvmlPoller
from .efficiency import Efficiency
from .gc import GcView
from .history import History
from .windows import Windows

__all__ = ["ViewApi", "Views"]


class ViewApi:
    """The views part of ``Monitor``'s surface (kept here with the stage that builds them; monitor.py wires)."""

    _views: Views

    def stats(self) -> dict[str, Any]:
        """Per model: exact counts and the exact percentiles of recent samples, by phase (seconds)."""
        return self._views.stats()

    def health(self) -> tuple[bool, dict[str, Any]]:
        """(healthy, details): healthy while the resolver thread runs; ``http`` says whether the port is bound.

        An unbound port does not make the monitor unhealthy: the application and its mounted routes are fine.
        """
        return self._views.health()

    def devices(self) -> dict[str, Any]:
        """This moment's device telemetry: torch allocator per CUDA device and NVML per GPU (fail soft)."""
        return self._views.devices()


class Views:
    """Builds the ``/stats``, ``/healthz`` and device views and records the status page's history."""

    def __init__(self, *, config: Config, hub: Hub, models: Models, metrics: Metrics, windows: Windows,
                 history: History, generations: GenerationTracker, requests: RequestTracker,
                 captures: CaptureController, traces: TraceStore,
                 detector: Detector | None, resolver: Resolver,
                 http: Callable[[], dict[str, Any]], memory: MemorySource | None,
                 nvml: NvmlPoller | None, gc: GcView | None = None) -> None:
        self.config = config
        self._hub = hub
        self._models = models
        self._metrics = metrics
        self._windows = windows
        self.history = history
        self._generations = generations
        self._requests = requests
        self._captures = captures
        self._traces = traces
        self._detector = detector
        self._resolver = resolver
        self._http = http
        self._memory = memory
        self._nvml = nvml
        self._gc = gc
        #: More sections of each /stats model entry: (model, now ns) -> (key, value) (e.g. stats/occupancy.py's).
        self.model_sections: list[Callable[[str, int], tuple[str, Any]]] = []
        #: More top-level sections of /stats: () -> (key, value) (e.g. the trace uploader's state).
        self.sections: list[Callable[[], tuple[str, Any]]] = []
        #: Live FLOP/s, bytes/s, MFU and MBU per model and stage (None with count_flops=False).
        self.efficiency: Efficiency | None = None

    def stats(self) -> dict[str, Any]:
        """Per model: exact counts and the exact percentiles of recent samples, by phase (seconds)."""
        self._generations.settle_pending()  # returned generate() calls first: a quiet call's steps are counted there
        now = perf_counter_ns()
        self.history.touch(now)
        regression: dict[str, Any] = {}
        detector = self._detector
        if detector is not None:
            for model, last, base, active, n in detector.views():
                regression[model] = {"active": active, "regressions": n, "baseline_seconds": base,
                                     "last_window": None if last is None else
                                     {"samples": last.count, "seconds": last.seconds,
                                      "ratios": last.ratios, "size_classes": last.classes},
                                     "size_classes": detector.classes(model)}

        gc, efficiency = self._gc, self.efficiency

        def counts(st: ModelState) -> dict[str, Any]:
            return {
                "calls": count_value(st.calls),
                "errors": st.error_counts(),
                "sampled": count_value(st.sampled),
                "dropped": {r: n for r, c in st.drops.items() if (n := count_value(c))},
                "input_signatures": st.table.distinct,
                "signature_tracking": st.sigs is not None,
                "latency": self._windows.summary(st.name, now, stage=st.stage),
                "regression": regression.get(series_key(st.name, st.stage)),
                "gc": None if gc is None else gc.model(st.name, st.stage, now),
                "efficiency": None if efficiency is None else efficiency.view(st, now),
            }

        started_ns = self._hub.started_ns
        models: dict[str, Any] = {}
        for name, st in list(self._models.by_name.items()):
            first = self._metrics.first_call(name)
            entry = models[name] = {
                "device": st.device,
                **counts(st),
                "sample_rate": st.sampler.rate,
                **_items_stats(st.members(), (now - started_ns) / 1e9),
                "cold_start_seconds": first[0] if first else None,
                "time_to_first_forward_seconds": first[1] if first else None,
                "capturable": st.capturable,
            }
            if st.stages:  # a generative model: totals here, latency and regressions per stage
                stages = {label: counts(s) for label, s in sorted(st.stages.items())}
                entry.update(calls=sum(s["calls"] for s in stages.values()),
                             sampled=sum(s["sampled"] for s in stages.values()),
                             errors=_sum_dicts(s["errors"] for s in stages.values()),
                             dropped=_sum_dicts(s["dropped"] for s in stages.values()),
                             input_signatures=sum(s["input_signatures"] for s in stages.values()),
                             latency={}, regression=None, gc=None, efficiency=None, stages=stages)
            for section in self.model_sections:
                try:
                    key, val = section(name, now)
                    entry[key] = val
                except Exception as exc:  # /stats goes on without it
                    self._hub.internal.report("stats", exc)
        captures = self._captures
        generation = self._generations.stats(now, started_ns)
        if gc is not None:
            for name, g in generation.items():
                g["gc"] = gc.generation(name, now)
        extra: dict[str, Any] = {}
        for top in self.sections:
            try:
                key, val = top()
                extra[key] = val
            except Exception as exc:  # /stats goes on without it
                self._hub.internal.report("stats", exc)
        return {
            "version": __version__,
            "pid": os.getpid(),  # which worker of a multi-process server answered
            "uptime_seconds": (now - started_ns) / 1e9,
            "window_seconds": self.config.stats_window_seconds,
            "pending_samples": self._resolver.pending,
            "internal_errors": dict(self._hub.internal.counts()),
            "models": models,
            "generation": generation,
            "gc": None if gc is None else gc.stats(now),
            # Signature counts behind the efficiency figures (None with count_flops=False).
            "flop_counting": None if efficiency is None else efficiency.counting(),
            # Request spans: open now, and per model label counts and queue / model / rest over the window.
            "requests": self._requests.stats(now, started_ns),
            "capture": {"state": captures.state, "current": captures.current.id
                        if captures.current else None, "suppressed": dict(captures.counts.suppressed)},
            "devices": self.devices(),
            "series": self.history.series(),
            "control": {"token_required": self.config.token is not None},
            **extra,
        }

    def profiles(self) -> list[dict[str, Any]]:
        """Captures, newest first: the one in flight (if any) and the stored ones."""
        cur = self._captures.current
        out = [cur.public()] if cur is not None else []
        ids = {c["id"] for c in out}
        stored = [m for m in self._traces.list() if m.get("id") not in ids]
        # Those the store could not keep, by id (time-ordered), among the stored: a failed save stays visible.
        lost = [dict(m) for m in list(self._captures.exporter.unstored) if m.get("id") not in ids]
        return out + sorted(stored + lost, key=lambda m: str(m.get("id", "")), reverse=True)

    def profile(self, capture_id: str) -> dict[str, Any] | None:
        """One capture's metadata and op summary, or None."""
        return self._captures.view(capture_id) or self._traces.get(capture_id)

    def health(self) -> tuple[bool, dict[str, Any]]:
        """(healthy, details): healthy while the resolver thread runs (see ``Monitor.health``)."""
        alive = self._resolver.alive
        detail: dict[str, Any] = {"resolver": "running" if alive else "stopped", "models": len(self._models.by_name)}
        detail.update(self._http())
        return alive, detail

    def devices(self) -> dict[str, Any]:
        """This moment's device telemetry: torch allocator per CUDA device and NVML per GPU (fail soft)."""
        out: dict[str, Any] = {"torch": [], "gpus": [], "nvml_up": None}
        if self._memory is not None:
            try:
                out["torch"] = [{"device": f"cuda:{m.device}", "uuid": m.uuid, "allocated_bytes": m.allocated_bytes,
                                 "reserved_bytes": m.reserved_bytes, "peak_allocated_bytes": m.peak_allocated_bytes,
                                 "peak_reserved_bytes": m.peak_reserved_bytes,
                                 "fragmentation_ratio": m.fragmentation_ratio, "ooms": m.ooms}
                                for m in read_memory(self._memory)]
            except Exception as exc:
                self._hub.internal.report("memory", exc)
        if self._nvml is not None:
            snap = self._nvml.snapshot()
            out["nvml_up"] = snap.up
            out["gpus"] = [{"gpu": g.index, "uuid": g.uuid, **g.values,
                            "throttle_reasons": sorted(r for r, on in g.clock_event_reasons.items()
                                                       if on and r != "gpu_idle")} for g in snap.gpus]
        return out

    def record_history(self, now_ns: int) -> None:
        """The status page's sparkline points, when one is due (resolver thread)."""
        if not self.history.due(now_ns):
            return
        groups = {name: st.members() for name, st in list(self._models.by_name.items())}
        windows = self._windows
        self.history.record(
            now_ns,
            [(name, sum(count_value(s.calls) for s in g), sum(sum(s.error_counts().values()) for s in g),
              _items_of(g)[0]) for name, g in groups.items()],
            lambda model, since: [d for s in groups.get(model, ()) for d in
                                  windows.since(model, STEADY, since, stage=s.stage)],
            self.devices())


def _sum_dicts(dicts: Iterable[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


def _items_of(states: list[ModelState]) -> tuple[int | None, int | None]:
    counts = [s.items_counts() for s in states]
    items = None if counts[0][0] is None else sum(i or 0 for i, _ in counts)
    padded = None if counts[0][1] is None else sum(p or 0 for _, p in counts)
    return items, padded


def _items_stats(states: list[ModelState], uptime_seconds: float) -> dict[str, Any]:
    items, padded = _items_of(states)
    out: dict[str, Any] = {"items": items, "items_per_second_since_start":
                           items / uptime_seconds if items is not None and uptime_seconds > 0 else None}
    if padded is not None:
        out["padded_items"] = padded
        out["padding_ratio"] = (1 - items / padded) if padded else 0.0  # type: ignore[operator]
    return out
