"""The composition root: builds the stages, wires them, owns start/stop and fork.

    request thread   hot path (agent/) ──► Hub.queue
    resolver thread  Resolver (agent/resolver.py) ──► Metrics (metrics/), Windows (stats/), CapturePolicy (captures/)
    HTTP thread      AgentServer (http/) ──► /metrics /healthz /stats /profile /profiles, through the Agent protocol
"""

from __future__ import annotations

import functools
import threading
from collections.abc import AsyncGenerator, AsyncIterable, Callable, Generator, Iterable
from time import perf_counter_ns
from typing import Any, TypeVar, overload

import torch
from prometheus_client import CollectorRegistry

from . import assembly, process
from ._version import __version__
from .agent import streams
from .agent.clocks import CudaBackend, NoCuda, TorchCuda
from .agent.dynamo import mark_for_dynamo
from .agent.exemplars import OTEL, TraceReader
from .agent.generation import Generation, GenerationTracker
from .agent.models import Models
from .agent.requests import RequestApi, RequestTracker
from .agent.resolver import Resolver
from .agent.span import Span, Untracked
from .agent.state import Hub
from .captures.api import CaptureApi
from .captures.controller import CaptureController
from .captures.detector import RegressionPolicy
from .captures.policy import FROM_ENV, CapturePolicy, resolve_policy
from .captures.profiler import ProfilerFactory, torch_profiler
from .config import Config
from .exceptions import ConfigError, PortUnavailable
from .faults import count_value
from .http.apps import AppsApi
from .http.ports import Ports
from .logs import make_logger
from .metrics.collectors import (
    GenerationCollector,
)
from .metrics.registrations import Registrations
from .metrics.store import Metrics
from .stats.history import History
from .stats.views import ViewApi, Views
from .stats.windows import Windows
from .store.traces import TraceStore
from .store.uploader import TraceUploader
from .telemetry.memory import MemorySource

__all__ = ["Monitor"]

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")


class Monitor(RequestApi, CaptureApi, ViewApi, AppsApi):
    """An in-process performance monitor for PyTorch inference.

    ``Monitor(**settings)`` takes every ``Config`` setting as a keyword argument (keywords win over
    ``PERFMON_*`` variables). Data sources are injectable: ``registry`` (a prometheus_client
    ``CollectorRegistry``; a private one by default), ``cuda`` (a ``CudaBackend``; real CUDA when
    available), ``nvml`` (anything with pynvml's API; pynvml by default), ``memory`` (a
    ``MemorySource``; torch's allocator when CUDA is available) and ``trace_reader`` (a ``TraceReader``
    giving the caller's OpenTelemetry span for exemplars, called on the request thread; an ``exemplars.Deferred``,
    taken there and read on the resolver thread; or None; OpenTelemetry's, deferred, when installed).
    """

    def __init__(self, *, registry: CollectorRegistry | None = None, cuda: CudaBackend | None = None,
                 nvml: Any = None, memory: MemorySource | None = None,
                 regression: RegressionPolicy | object | None = FROM_ENV,
                 profiler_factory: ProfilerFactory | None = None, trace_reader: TraceReader | object | None = OTEL,
                 **settings: Any) -> None:
        if isinstance(nvml, bool):  # Monitor(nvml=False) is the documented setting, not a data source
            settings["nvml"] = nvml
            nvml = None
        self.config = cfg = Config.from_env(**settings)
        self.regression = regression = resolve_policy(regression)  # a RegressionPolicy, or None: detection off
        logger = functools.partial(make_logger, cfg.log_format, cfg.log_level)
        self.log = logger(component="monitor")  # the process hooks log through it (perfmon.process)
        hub = self._hub = Hub(cfg, cuda if cuda is not None else TorchCuda() if torch.cuda.is_available() else NoCuda())
        if trace_reader is not OTEL:
            hub.set_trace_reader(trace_reader)  # type: ignore[arg-type]
        #: Faults inside the agent, counted (perfmon_internal_errors_total), and its threads' CPU time.
        self.internal, self.cpu = hub.internal, hub.cpu
        self.registry = registry if registry is not None else CollectorRegistry()
        self._registrations = Registrations(self.registry)  # what close() takes off it again
        self.generations = GenerationTracker(
            internal=hub.internal, timing=lambda: hub.timing, max_names=cfg.max_models,
            max_live=cfg.max_live_generations, queue_size=cfg.generation_queue_size,
            window_seconds=cfg.stats_window_seconds, max_samples=cfg.stats_max_samples, wake=lambda: hub.wake.set())
        self.models = Models(cfg, hub, self.generations)
        self.requests = RequestTracker(hub)  # request spans (monitor.request, middlewares, batch): queue/model/rest
        self.metrics = Metrics(self._registrations, cfg, states=self.models.states, internal=hub.internal,
                               first_forward_origin=lambda end_ns: hub.first_forward_origin(end_ns))
        self.windows = Windows(cfg.stats_window_seconds, cfg.stats_max_samples)
        self._generation_metrics = GenerationCollector(self.generations)
        self.generations.sinks.append(self._generation_metrics.observe)
        self.traces = TraceStore(cfg.trace_dir, max_files=cfg.trace_max_files, max_bytes=cfg.trace_max_bytes)
        limits = regression or RegressionPolicy()
        self.captures = CaptureController(
            self.traces, internal=hub.internal, log=logger(component="capture"),
            cooldown_seconds=limits.cooldown_seconds, max_auto_per_hour=limits.max_captures_per_hour,
            max_manual_per_hour=cfg.manual_captures_per_hour, arm_timeout_seconds=cfg.capture_arm_timeout_seconds,
            profiler_factory=profiler_factory or torch_profiler, cpu=hub.cpu,
            peaks=functools.partial(assembly.peaks, cfg), max_bytes=cfg.capture_max_bytes,
            export_timeout_seconds=cfg.capture_export_timeout_seconds,
            max_baseline_per_hour=limits.baseline_captures_per_hour)
        self.policy = CapturePolicy(regression, models=self.models, captures=self.captures, internal=hub.internal,
                                    log=self.log, explainers=assembly.explainers(self))
        self.detector = self.policy.detector
        self.resolver = Resolver(hub, [self.metrics.observe, self.windows.add, self.policy.sink],
                                  states=self.models.states, on_tick=self._tick, log=logger(component="resolver"))
        self.resolver.doze.dozers += [self.generations.doze, self.requests.doze]
        self.gc_pauses, self._gc = assembly.gc_stage(self)
        #: Captures copied to object storage (trace_store), or None: they stay in trace_dir only.
        self.uploads: TraceUploader | None = None if cfg.trace_store is None else TraceUploader(
            self.traces, cfg.trace_store, internal=hub.internal, timeout_seconds=cfg.trace_upload_timeout_seconds,
            backoff_max_seconds=cfg.trace_upload_max_backoff_seconds, cpu=hub.cpu, log=logger(component="upload"))
        #: The NVML poller (nvml=True) and the allocator snapshot written on a CUDA OOM (oom_snapshot), or None.
        memory, self.nvml_poller, self.oom = assembly.telemetry(cfg, hub, memory, nvml, logger)
        self._memory = memory
        self.ports = Ports(self, shedding=hub.http, set_port=self.metrics.set_port, log=self.log)
        self.history = History(wake=lambda: hub.wake.set())  # read at each call: a forked child has its own event
        self._views = Views(config=cfg, hub=hub, models=self.models, metrics=self.metrics, windows=self.windows,
                            history=self.history, generations=self.generations, requests=self.requests,
                            captures=self.captures, traces=self.traces, detector=self.detector, resolver=self.resolver,
                            http=self.ports.detail, memory=memory, nvml=self.nvml_poller, gc=(*self._gc, None)[0])
        try:
            assembly.register_collectors(self)
        except BaseException:
            self._registrations.close()  # a registry taken by another Monitor: leave it as it was
            raise
        self._lifecycle, self._running = threading.Lock(), False  # start/stop/fork; whether started
        process.live.add(self)

    def start(self) -> Monitor:
        """Start the resolver thread and the HTTP server (unless ``port=None``). Idempotent. Never fails the
        application's start over the port: with no free port in the range it logs the range, counts and times on,
        reports it (``/healthz``, ``perfmon_agent_http_listening``) and retries the bind in the background
        (``require_port=True`` raises ``PortUnavailable`` instead)."""
        with self._lifecycle:
            if self._running:
                return self
            if self._registrations.closed:
                raise ConfigError("perfmon: this Monitor was closed; make a new one")
            cfg = self.config
            self.captures.accept()
            self._hub.timing = True
            assembly.sweep_trace_dir(self)
            if cfg.prepare_profiler:
                process.prepare_profiler(self.log, self.internal)
            # Timing first, the port second: a worker that cannot bind still counts and times its calls.
            self.resolver.start(cfg.resolve_interval_seconds)
            for part in (self.uploads, self.nvml_poller, self.gc_pauses, self._views.efficiency):
                if part is not None:
                    part.start()
            self._hub.started_ns, self._running = perf_counter_ns(), True  # (perfmon's start-up not in it: TTFF)
            if not self.ports.open():
                error = self.ports.error
                self._stop_locked()
                raise PortUnavailable(f"perfmon: {error} (require_port=True)")
        self.log.info("started", url=self.url, sample_rate=cfg.sample_rate, version=__version__,
                       cuda=self._hub.backend.available())
        return self

    def _tick(self, now_ns: int) -> int | None:
        """Housekeeping (resolver thread): close due windows, expire stale armed captures, status history.

        Returns when it next has work (perf_counter_ns; ``now_ns`` when this pass had some: records drained, a
        capture in flight), or None: the resolver may doze (agent/doze.py)."""
        due = self.policy.tick(now_ns)
        self.captures.tick()
        drained = self.generations.drain(now_ns) + self.requests.drain(now_ns)
        drained += self.gc_pauses.take_drained() if self.gc_pauses is not None else 0  # this pass's GC marking
        # Never wait for the lifecycle lock here: stop() holds it while it joins this thread.
        if self.ports.due(now_ns) and self._lifecycle.acquire(blocking=False):
            try:
                if self._running:
                    self.ports.retry(now_ns)
            finally:
                self._lifecycle.release()
        mark_for_dynamo()  # torch.compile may have been imported since the models were wrapped
        self._views.record_history(now_ns)
        if drained or self.captures.state != "idle":
            return now_ns
        for later in (self.ports.due_ns(), self.history.due_ns(now_ns)):
            if later is not None and (due is None or later < due):
                due = later
        return due

    def stop(self) -> None:
        """Stop timing, resolve in-flight samples (bounded), join threads, close the port. Idempotent."""
        with self._lifecycle:
            if not self._running:
                # A monitor never started can still have a thread: flush() submits signatures for counting.
                efficiency = self._views.efficiency
                if efficiency is not None:
                    efficiency.stop(self.config.stop_timeout_seconds)
                return
            self._stop_locked()
        self.log.info("stopped", calls=sum(count_value(s.calls) for s in self.models.states()))

    def _stop_locked(self) -> None:
        self._running = False
        timeout = self.config.stop_timeout_seconds
        self._hub.timing = False
        # In order: the uploads and GC pauses after the captures (a last export spools), before the resolver. Each
        # part stops whatever the one before did: a fault there is counted, never leaves the next one running.
        for part in (self.ports, self.captures, self.uploads, self.gc_pauses, self.resolver, self.nvml_poller):
            if part is not None:
                try:
                    part.stop(timeout)
                except Exception as exc:
                    self.internal.report("stop", exc)
        if self.oom is not None:
            self.oom.join(timeout)

    def close(self) -> None:
        """Stop, then take perfmon's metrics off the registry, so that another Monitor can use it (a shared one:
        ``prometheus_client.REGISTRY``, served by the application). Idempotent; a closed monitor cannot start again.
        Leaving a ``with Monitor(...)`` block closes it."""
        with self._lifecycle:
            self._registrations.refuse()  # a start() racing this one is refused from here (or stopped below)
        try:
            self.stop()
        finally:
            self._registrations.close()

    def after_fork_in_child(self, *, restart: bool = True) -> None:
        """A fresh agent in a forked child (gunicorn --preload, multiprocessing 'fork'; see ``perfmon.process``).

        The parent's threads do not exist here and a lock one of them held is held forever: every lock, queue,
        pool and counter is replaced (the parent's calls are the parent's to report), the inherited sockets
        are left to the parent, and a running agent starts its own threads and port (see ``port_range``), unless
        ``restart`` is False (a torch DataLoader's worker: it serves no model; ``start()`` there still works).
        """
        was_running = self._running
        self._lifecycle = threading.Lock()
        self._running = False
        self.ports.abandon()
        self._hub.reset_after_fork()
        for part in (self.models, self.metrics, self.windows, self.history, self.captures, self.resolver, self.policy,
                     self.generations, self._generation_metrics, self.requests, self.uploads, self.nvml_poller,
                     self.gc_pauses, *self._gc, self._views.efficiency):
            if part is not None:
                part.reset_after_fork()
        self.metrics.set_port(None)
        if was_running and restart:
            try:
                self.start()
            except Exception as exc:  # e.g. no free port in the range: count it, keep counting calls
                self.internal.report("fork", exc)

    def __enter__(self) -> Monitor:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()  # the block is the monitor's life: stopped, its registry left to the next one

    @property
    def running(self) -> bool:
        return self._running

    @property
    def health_url(self) -> str | None:
        """``http://host:port/healthz`` of the health port (``health_port``), or None."""
        return self.ports.health_url

    @property
    def url(self) -> str | None:
        """The agent's base URL, e.g. ``http://127.0.0.1:40123``; None when it serves no HTTP."""
        return self.ports.url

    def wrap(self, model: Any, *, name: str | None = None, device: str = "auto", items: Any = None,
             stage: Any = None) -> Any:
        """Monitor ``model``'s calls; returns ``model`` itself (a module) or a monitored callable.

        A module is monitored in place (its class becomes a per-model subclass, ``MonitoredModule``): every
        call counts, whichever way it comes — the returned object, its own ``generate()``, a parent module,
        a pipeline holding it, ``torch.compile``. ``name`` is the ``model`` label (default: the class name);
        ``device`` "auto" (follow the parameters) or a fixed label ("cuda:0", "cpu"). ``items`` is what a call
        processes: None (default) the first dimension of the first tensor argument (needs
        ``track_signatures``), a callable ``(args, kwargs) -> int | (effective, padded)`` in your units (e.g.
        tokens, padding excluded), False nothing. ``stage`` splits a generative model's calls into series
        (``prefill``/``decode``): None (default) for a ``forward`` taking a KV cache (``past_key_values``; see
        ``perfmon.agent.stages``), a callable ``(args, kwargs) -> str`` (at most 8 labels), False one stage.

        Raises ``WrapError`` for an object that is not callable or is already monitored (by this monitor or another:
        its calls count once, under its first wrap; ``unwrap`` it there first to move it), ``ConfigError`` for a
        ``name`` another live model holds or a bad ``items``/``stage``.
        """
        return self.models.wrap(model, name=name, device=device, items=items, stage=stage)

    def unwrap(self, model: Any) -> Any:
        """Stop monitoring a module wrapped by this monitor: its own class back, exactly; returns it. Its series
        stay exported (counters never go backwards); wrapping it, or its next version, under the same name
        continues them. A wrapped module that is garbage-collected counts as unwrapped."""
        return self.models.unwrap(model)

    @overload
    def instrument(self, fn: F, *, name: str | None = None, device: str = "auto", items: Any = None) -> F: ...

    @overload
    def instrument(self, fn: None = None, *, name: str | None = None, device: str = "auto",
                   items: Any = None) -> Callable[[F], F]: ...

    def instrument(self, fn: Callable[..., Any] | None = None, *, name: str | None = None,
                   device: str = "auto", items: Any = None) -> Any:
        """Monitor a plain callable; use as ``monitor.instrument(fn)`` or ``@monitor.instrument(name=...)``.

        ``items`` as for ``wrap``. An ``async def`` (or an object with an async ``__call__``) is timed over its await,
        its items counted only by an ``items`` callable, and never captured; a generator function is refused
        (``WrapError``: its call returns before its work runs).
        """
        return self.models.instrument(fn, name=name, device=device, items=items)

    def track(self, name: str, *, device: str = "auto") -> Span | Untracked:
        """``with monitor.track("generate"): ...`` counts and sample-times the block (``Models.track``)."""
        return self.models.track(name, device=device)

    def generation(self, name: str, *, prompt_tokens: int | None = None) -> Generation:
        """One generation request under ``model=name``: call ``g.token(n=1)`` as tokens reach the caller.

        ``with monitor.generation("chat", prompt_tokens=12) as g: ...`` (outcomes, timing and cost:
        ``GenerationTracker.start``).
        """
        return self.generations.start(name, prompt_tokens)

    @overload
    def stream(self, iterable: Iterable[T], *, name: str, prompt_tokens: int | None = None,
               tokens: Callable[[T], int] | None = None) -> Generator[T, None, None]: ...

    @overload
    def stream(self, iterable: AsyncIterable[T], *, name: str, prompt_tokens: int | None = None,
               tokens: Callable[[T], int] | None = None) -> AsyncGenerator[T, None]: ...

    def stream(self, iterable: Any, *, name: str, prompt_tokens: int | None = None,
               tokens: Callable[[Any], int] | None = None) -> Any:
        """Yield ``iterable``'s items unchanged (sync or async), timing them as one generation request under
        ``model=name``; each item is one token, or ``tokens(item)`` (outcomes: ``perfmon.agent.streams.stream``).
        """
        return streams.stream(self.generations.start, self.internal, iterable, name=name, prompt_tokens=prompt_tokens,
                              tokens=tokens)

    def flush(self, timeout: float = 2.0) -> bool:
        """Resolve every sample taken so far, waiting up to ``timeout`` seconds for the device (for tests,
        benchmarks and shutdown paths; never needed on the request path)."""
        return self.resolver.drain(deadline_ns=perf_counter_ns() + int(timeout * 1e9))

