"""The composition root: builds the stages, wires them, owns start/stop.

    request thread   Probe.__call__ (instrument.py) ──► Hub.queue
    resolver thread  Resolver (resolver.py) ──► Metrics.observe (metrics.py), Windows.add (windows.py)
    HTTP thread      AgentServer (httpd.py)  ──► /metrics /healthz /stats
"""

from __future__ import annotations

import atexit
import itertools
import os
import sys
import threading
import weakref
from collections.abc import AsyncGenerator, AsyncIterable, Callable, Generator, Iterable
from time import perf_counter_ns
from typing import Any, TypeVar, overload

import torch
from prometheus_client import CollectorRegistry

from ._version import __version__
from .agent.clocks import CudaBackend, NoCuda, TorchCuda
from .agent.generation import Generation, GenerationTracker
from .agent.instrument import (
    Hub,
    ModelState,
    MonitoredFunction,
    MonitoredModule,
    Probe,
    Span,
    Stages,
    mark_for_dynamo,
    unwrap_module,
)
from .agent.records import STEADY, Sample, series_key, split_key
from .agent.resolver import Resolver
from .agent.stages import PREFILL, generative_stage, is_generative
from .captures.controller import (
    MAX_SECONDS,
    MAX_STEPS,
    CaptureController,
    CaptureOptions,
    ProfilerFactory,
    torch_profiler,
    warm_up_profiler,
)
from .captures.detector import Detector, Regression, RegressionPolicy
from .captures.roofline import Peaks, peaks_for
from .config import Config
from .exceptions import ConfigError, PortUnavailable, WrapError
from .faults import count_value
from .http.agent_server import AgentServer
from .http.health_port import HealthServer
from .http.routes import Router, make_asgi_app, make_wsgi_app
from .logs import make_logger
from .metrics.store import (
    AgentCollector,
    CaptureCollector,
    GenerationCollector,
    Metrics,
    TelemetryCollector,
    UploadCollector,
)
from .stats.history import History
from .stats.windows import Windows
from .store.traces import TraceStore
from .store.uploader import TraceUploader
from .telemetry.memory import MemorySource, OomSnapshotter, TorchMemory, read_memory
from .telemetry.nvml import NvmlPoller

__all__ = ["Monitor"]

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")
_DEFAULT = object()


class Monitor:
    """An in-process performance monitor for PyTorch inference.

    ``Monitor(**settings)`` takes every ``Config`` setting as a keyword argument (keywords win over
    ``PERFMON_*`` variables). Data sources are injectable: ``registry`` (a prometheus_client
    ``CollectorRegistry``; a private one by default), ``cuda`` (a ``CudaBackend``; real CUDA when
    available), ``nvml`` (anything with pynvml's API; pynvml by default) and ``memory`` (a
    ``MemorySource``; torch's allocator when CUDA is available).
    """

    def __init__(self, *, registry: CollectorRegistry | None = None, cuda: CudaBackend | None = None,
                 nvml: Any = None, memory: MemorySource | None = None,
                 regression: RegressionPolicy | object | None = _DEFAULT,
                 profiler_factory: ProfilerFactory | None = None, **settings: Any) -> None:
        if isinstance(nvml, bool):  # Monitor(nvml=False) is the documented setting, not a data source
            settings["nvml"] = nvml
            nvml = None
        self.config = Config.from_env(**settings)
        cfg = self.config
        if regression is _DEFAULT:
            off = os.environ.get("PERFMON_REGRESSION", "").strip().lower() in ("0", "off", "false", "no", "none")
            regression = None if off else RegressionPolicy()
        if regression is not None and not isinstance(regression, RegressionPolicy):
            raise ConfigError(f"regression={regression!r}: expected a perfmon.RegressionPolicy or None")
        self.regression: RegressionPolicy | None = regression
        self._log = make_logger(cfg.log_format, cfg.log_level, component="monitor")
        if cuda is None:
            cuda = TorchCuda() if torch.cuda.is_available() else NoCuda()
        self._hub = Hub(cfg, cuda)
        self._states: dict[str, ModelState] = {}
        self._names_lock = threading.Lock()
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = Metrics(self.registry, cfg, states=self._state_list, internal=self._hub.internal,
                               started_ns=lambda: self._hub.started_ns)
        self.windows = Windows(cfg.stats_window_seconds, cfg.stats_max_samples)
        self.generations = GenerationTracker(
            internal=self._hub.internal, timing=lambda: self._hub.timing, max_names=cfg.max_models,
            max_live=cfg.max_live_generations, queue_size=cfg.generation_queue_size,
            window_seconds=cfg.stats_window_seconds, max_samples=cfg.stats_max_samples)
        self._generation_metrics = GenerationCollector(self.generations)
        self.generations.sinks.append(self._generation_metrics.observe)
        self.registry.register(self._generation_metrics)
        self.history = History()
        self.traces = TraceStore(cfg.trace_dir, max_files=cfg.trace_max_files, max_bytes=cfg.trace_max_bytes)
        policy = regression or RegressionPolicy()
        self.captures = CaptureController(
            self.traces, internal=self._hub.internal,
            log=make_logger(cfg.log_format, cfg.log_level, component="capture"),
            cooldown_seconds=policy.cooldown_seconds, max_auto_per_hour=policy.max_captures_per_hour,
            max_manual_per_hour=cfg.manual_captures_per_hour, arm_timeout_seconds=cfg.capture_arm_timeout_seconds,
            profiler_factory=profiler_factory or torch_profiler, cpu=self._hub.cpu, peaks=self._peaks,
            max_bytes=cfg.capture_max_bytes, export_timeout_seconds=cfg.capture_export_timeout_seconds,
            max_baseline_per_hour=policy.baseline_captures_per_hour)
        #: model -> perf_counter_ns of the last look for its baseline capture (the store is read at most
        #: every BASELINE_CHECK_SECONDS per model).
        self._baseline_checked: dict[str, int] = {}
        #: series key -> (state, options, reason, expiry ns): a regression capture that found the slot busy.
        self._deferred: dict[str, tuple[Any, CaptureOptions, dict[str, Any], int]] = {}
        self.detector = Detector(regression) if regression is not None else None
        sinks: list[Any] = [self.metrics.observe, self.windows.add]
        if self.detector is not None:
            sinks.append(self._detect)
        self._resolver = Resolver(self._hub, sinks, states=self._state_list, on_tick=self._tick,
                                  log=make_logger(cfg.log_format, cfg.log_level, component="resolver"))
        self.registry.register(CaptureCollector(detector=self.detector, controller=self.captures))
        #: Captures copied to object storage (trace_store), or None: they stay in trace_dir only.
        self.uploads: TraceUploader | None = None if cfg.trace_store is None else TraceUploader(
            self.traces, cfg.trace_store, internal=self._hub.internal, timeout_seconds=cfg.trace_upload_timeout_seconds,
            backoff_max_seconds=cfg.trace_upload_max_backoff_seconds, cpu=self._hub.cpu,
            log=make_logger(cfg.log_format, cfg.log_level, component="upload"))
        if self.uploads is not None:
            self.registry.register(UploadCollector(self.uploads))
        self.registry.register(AgentCollector(cpu=self._hub.cpu, resolver=self._resolver, http=self._hub.http,
                                              listening=self._listening))
        if memory is None and torch.cuda.is_available():
            memory = TorchMemory()
        self._memory = memory
        self._nvml = (NvmlPoller(nvml, interval_seconds=cfg.nvml_interval_seconds, cpu=self._hub.cpu,
                                 log=make_logger(cfg.log_format, cfg.log_level, component="nvml"))
                      if cfg.nvml else None)
        self._oom: OomSnapshotter | None = None
        if cfg.oom_snapshot and memory is not None:
            self._oom = OomSnapshotter(memory, cfg.trace_dir, cfg.oom_snapshot_cooldown_seconds,
                                       on_written=lambda path: self._log.warning("oom_snapshot_written",
                                                                                 path=str(path)),
                                       on_error=lambda exc: self._hub.internal.report("oom_snapshot", exc))
            self._hub.on_oom = self._oom
        oom = self._oom
        self.registry.register(TelemetryCollector(
            memory=memory, nvml=self._nvml, internal=self._hub.internal,
            oom_snapshots=(lambda: len(oom.written)) if oom is not None else None))
        self._server: AgentServer | None = None
        #: /healthz on a port of its own (health_port), and why it is not bound / when to retry.
        self._health_server: HealthServer | None = None
        self._health_error: str | None = None
        self._health_retry_ns: int | None = None
        #: Why the last bind failed (None once bound), and when to try again (perf_counter_ns).
        self._bind_error: str | None = None
        self._bind_retry_ns: int | None = None
        self._bind_failures = 0
        self._lifecycle = threading.Lock()
        self._running = False
        self._anon = itertools.count(1)
        _LIVE.add(self)

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> Monitor:
        """Start the resolver thread and the HTTP server (unless ``port=None``). Idempotent.

        Never fails the application's start over the port: when no port of the range is free it logs
        an error naming the range, keeps counting and timing, reports it in ``/healthz`` and
        ``perfmon_agent_http_listening``, and retries the bind in the background (``require_port=True``
        raises ``PortUnavailable`` instead).
        """
        with self._lifecycle:
            if self._running:
                return self
            cfg = self.config
            self._hub.started_ns = perf_counter_ns()
            self._hub.timing = True
            try:
                unusable = self.traces.sweep_temp()
            except Exception as exc:  # an unusable trace_dir fails captures, never the start
                self._hub.internal.report("trace_store", exc)
                unusable = str(exc)
            if unusable is not None:
                self._log.error("trace_dir_refused", trace_dir=cfg.trace_dir, reason=unusable,
                                note="captures are refused until it is fixed; monitoring goes on")
            self._prepare_profiler()
            # Timing first, the port second: a worker that cannot bind still counts and times its calls.
            self._resolver.start(cfg.resolve_interval_seconds)
            if self.uploads is not None:
                self.uploads.start()
            if self._nvml is not None:
                self._nvml.start()
            self._running = True
            if cfg.port is not None and not self._bind() and cfg.require_port:
                error = self._bind_error
                self._stop_locked()
                raise PortUnavailable(f"perfmon: {error} (require_port=True)")
            if cfg.health_port is not None:
                self._bind_health()
        if cfg.port is not None and cfg.token is None and not _is_loopback(cfg.host):
            self._log.warning("control_api_disabled", host=cfg.host,
                              note="no token set on a non-loopback address: /profile and /profiles answer 403; "
                                   "/metrics, /healthz and /stats are served")
        self._log.info("started", url=self.url, sample_rate=cfg.sample_rate, version=__version__,
                       cuda=self._hub.backend.available())
        return self

    def _prepare_profiler(self) -> None:
        """Take Kineto's ~1 s first start off the first capture, where that is safe (see Config)."""
        global _PROFILER_PREPARED
        if not self.config.prepare_profiler or _PROFILER_PREPARED:
            return
        server = _prefork_server(sys.modules, forked=_FORKED)
        if server is not None:
            self._log.info("profiler_prepare_deferred", server=server,
                           note="this process may fork workers: each worker prepares its own profiler "
                                "when its monitor restarts after the fork")
            return
        try:
            took = warm_up_profiler()
            _PROFILER_PREPARED = True
            self._log.info("profiler_ready", seconds=round(took, 3))
        except Exception as exc:
            self._hub.internal.report("capture", exc)

    def _bind(self) -> bool:
        """Bind and start the agent's server (lifecycle lock held); False, logged and retried, if no port is free."""
        cfg = self.config
        assert cfg.port is not None
        try:
            server = AgentServer(
                Router(self, mounted=False), cfg.host, cfg.port, port_range=cfg.port_range,
                connection_timeout=cfg.http_connection_timeout_seconds, cpu_budget=cfg.http_cpu_budget,
                cpu=self._hub.cpu, shedding=self._hub.http, internal=self._hub.internal)
        except OSError as exc:
            first = self._bind_error is None
            self._bind_error = str(exc)
            self._bind_failures += 1
            # 1 s, 2 s, 4 s ... 30 s: a worker waiting for a port held in TIME_WAIT or by a dying
            # sibling gets it soon; a range that is simply too narrow costs a bind() every 30 s.
            delay = min(30.0, 2.0 ** min(self._bind_failures - 1, 5))
            self._bind_retry_ns = perf_counter_ns() + int(delay * 1e9)
            if first:
                last = cfg.port + cfg.port_range - 1
                self._log.error("port_unavailable", host=cfg.host, port_range=f"{cfg.port}..{last}",
                                error=str(exc), pid=os.getpid(),
                                note="timing and counting go on; the bind is retried in the background. "
                                     "Widen PERFMON_PORT_RANGE to cover every process that starts a "
                                     "monitor (workers, and the master if it starts one)")
            return False
        self._server = server
        self.metrics.set_port(server.port)
        server.start()
        if self._bind_error is not None:
            self._log.info("port_bound", url=server.url, attempts=self._bind_failures + 1)
        self._bind_error = None
        self._bind_retry_ns = None
        self._bind_failures = 0
        return True

    def _bind_health(self) -> bool:
        """Bind and start the health port's server (lifecycle lock held); logged and retried if taken."""
        cfg = self.config
        assert cfg.health_port is not None
        router = Router(self, mounted=False)
        try:
            server = HealthServer(lambda method: router.handle(method, "/healthz", {}), cfg.host, cfg.health_port,
                                  port_range=cfg.port_range, cpu=self._hub.cpu)
        except OSError as exc:
            if self._health_error is None:
                self._log.error("health_port_unavailable", host=cfg.host, error=str(exc),
                                port_range=f"{cfg.health_port}..{cfg.health_port + cfg.port_range - 1}",
                                note="/healthz is still served on the agent's port; retried every 5 s")
            self._health_error = str(exc)
            self._health_retry_ns = perf_counter_ns() + 5_000_000_000
            return False
        server.start()
        self._health_server, self._health_error, self._health_retry_ns = server, None, None
        return True

    def _retry_bind(self, now_ns: int) -> None:
        """Housekeeping (resolver thread): try the ports again once their back-off has passed."""
        due = [t for t in (self._bind_retry_ns, self._health_retry_ns) if t is not None]
        if not due or now_ns < min(due):
            return
        # Never wait for the lifecycle lock here: stop() holds it while it joins this thread.
        if not self._lifecycle.acquire(blocking=False):
            return
        try:
            if not self._running:
                return
            if self._server is None and self.config.port is not None and self._bind_retry_ns is not None \
                    and now_ns >= self._bind_retry_ns:
                self._bind()
            if self._health_server is None and self.config.health_port is not None \
                    and self._health_retry_ns is not None and now_ns >= self._health_retry_ns:
                self._bind_health()
        finally:
            self._lifecycle.release()

    def _listening(self) -> int | None:
        """1 while the agent's port is bound, 0 while it is not (retrying); None when it serves none."""
        if self.config.port is None or not self._running:
            return None
        return 1 if self._server is not None else 0

    def stop(self) -> None:
        """Stop timing, resolve in-flight samples (bounded), join threads, close the port. Idempotent."""
        with self._lifecycle:
            if not self._running:
                return
            self._stop_locked()
        self._log.info("stopped", calls=sum(count_value(s.calls) for s in self._state_list()))

    def _stop_locked(self) -> None:
        self._running = False
        timeout = self.config.stop_timeout_seconds
        self._hub.timing = False
        self._bind_retry_ns = None
        self._bind_error = None
        self._bind_failures = 0
        if self._health_server is not None:
            self._health_server.stop(timeout)
            self._health_server = None
        self._health_error = self._health_retry_ns = None
        if self._server is not None:
            self._server.stop(timeout)
            self._server = None
            self.metrics.set_port(None)
        self.captures.stop(timeout)
        if self.uploads is not None:  # after the captures: a last export is spooled (uploaded by the next start)
            self.uploads.stop(timeout)
        self._resolver.stop(timeout)
        if self._nvml is not None:
            self._nvml.stop(timeout)
        if self._oom is not None:
            self._oom.join(timeout)

    def _after_fork_in_child(self) -> None:
        """A fresh agent in a forked child (gunicorn --preload, multiprocessing 'fork').

        The parent's threads do not exist here and any lock one of them held is held forever, so
        every lock, queue, pool and counter is replaced; the parent's calls are the parent's to report.
        The inherited listening socket is closed (the parent keeps serving on it) and, if the parent
        was running, the child starts its own threads and binds its own port (see ``port_range``).
        """
        was_running = self._running
        self._bind_error, self._bind_retry_ns, self._bind_failures = None, None, 0
        self._lifecycle = threading.Lock()
        self._names_lock = threading.Lock()
        self._running = False
        if self._server is not None:
            self._server.abandon()
            self._server = None
        if self._health_server is not None:
            self._health_server.abandon()
            self._health_server = None
        self._health_error = self._health_retry_ns = None
        self._deferred, self._baseline_checked = {}, {}  # the parent's regressions are the parent's
        self._hub.reset_after_fork()
        for st in self._state_list():
            st.reset_after_fork()
        for part in (self.metrics, self.windows, self.history, self.captures, self._resolver, self.generations,
                     self._generation_metrics):
            part.reset_after_fork()
        if self.detector is not None:
            self.detector.reset_after_fork()
        if self.uploads is not None:
            self.uploads.reset_after_fork()
        if self._nvml is not None:
            self._nvml.reset_after_fork()
        self.metrics.set_port(None)
        if was_running:
            try:
                self.start()
            except Exception as exc:  # e.g. no free port in the range: count it, keep counting calls
                self._hub.internal.report("fork", exc)

    def __enter__(self) -> Monitor:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._running

    @property
    def health_url(self) -> str | None:
        """``http://host:port/healthz`` of the health port (``health_port``), or None."""
        health = self._health_server
        if health is None:
            return None
        host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
        return f"http://{host}:{health.port}/healthz"

    @property
    def url(self) -> str | None:
        """The agent's base URL, e.g. ``http://127.0.0.1:40123``; None when it serves no HTTP."""
        server = self._server
        return server.url if server is not None else None

    # -- instrumenting ------------------------------------------------------------------------

    def wrap(self, model: Any, *, name: str | None = None, device: str = "auto", items: Any = None,
             stage: Any = None) -> Any:
        """Monitor ``model``'s calls; returns ``model`` itself (a module) or a monitored callable.

        A module is monitored in place (its class becomes a per-model subclass, see
        ``MonitoredModule``): every call counts, whichever way it comes — the returned object, the
        model's own ``generate()``, a parent module, a pipeline holding it, ``torch.compile``.

        ``name`` is the ``model`` label (default: the class name). ``device`` is "auto" (follow the
        model's parameters) or a fixed label such as "cuda:0" or "cpu". ``items`` says what a call
        processes: None (default) counts the first dimension of the first tensor argument (through the
        signature table, at no extra cost; needs ``track_signatures``), a callable
        ``(args, kwargs) -> int | (effective, padded)`` counts in your units (e.g. tokens from an
        attention mask, padding excluded), False counts nothing.

        ``stage`` splits a generative model's calls into stages, each with its own series
        (``stage="prefill"``/``"decode"``): None (default) does so for a module whose ``forward`` takes
        ``past_key_values`` (Hugging Face-style decoders; see ``perfmon.agent.stages``), a callable
        ``(args, kwargs) -> str`` labels a custom loop's calls (at most 8 labels), False keeps one stage.
        """
        _check_items(items)
        if stage is not None and stage is not False and not callable(stage):
            raise ConfigError(f"stage={stage!r}: expected None (automatic), a callable or False")
        if isinstance(model, (Probe, MonitoredModule)):
            raise WrapError("this object is already monitored")
        if not callable(model):
            raise WrapError(f"cannot monitor {type(model).__name__!r}: it is not callable")
        if not isinstance(model, torch.nn.Module):
            if callable(stage):
                raise ConfigError("stage=: stages split the forward calls of an nn.Module; a plain callable has one "
                                  "stage (use monitor.generation/monitor.stream for its requests)")
            return self.instrument(model, name=name, device=device, items=items)
        label = name if name is not None else type(model).__name__
        resolve = _fixed(device) if device != "auto" else _module_device(model)
        if stage is None:
            stage = generative_stage if is_generative(model) else False
        if stage is False:
            return MonitoredModule.create(model, self._new_state(label, resolve, items=items))
        first = PREFILL if stage is generative_stage else "other"
        state = self._new_state(label, resolve, items=items, stage=first)

        def make(label_: str) -> ModelState:
            return ModelState(label, self._hub, resolve, items=items, stage=label_)

        every = max(1, round(1 / self.config.sample_rate))
        calls_of_generate = itertools.count()

        def requests(args: tuple[Any, ...], kwargs: Any) -> tuple[list[Any], bool]:
            batch, prompt = _prompt_shape(args, kwargs)
            # The first generate() call, then one in 1/sample_rate, has every step timed.
            timed = next(calls_of_generate) % every == 0
            return [self.generations.start(label, prompt) for _ in range(batch)], timed

        return MonitoredModule.create(model, state, lambda fn: Stages(stage, make, fn, first=state,
                                                                     internal=self._hub.internal),
                                      requests=requests)

    def unwrap(self, model: Any) -> Any:
        """Stop monitoring a module wrapped by this monitor: its own class back, exactly; returns it.

        Its metrics so far stay exported (counters never go backwards); wrapping it again under the
        same name continues them.
        """
        st: ModelState | None = getattr(type(model), "_perfmon_state", None)
        if st is None or not isinstance(model, MonitoredModule) or self._states.get(st.name) is not st:
            raise WrapError("this object is not a module monitored by this monitor")
        unwrap_module(model)
        st.attached = False
        return model

    @overload
    def instrument(self, fn: F, *, name: str | None = None, device: str = "auto", items: Any = None) -> F: ...

    @overload
    def instrument(self, fn: None = None, *, name: str | None = None, device: str = "auto",
                   items: Any = None) -> Callable[[F], F]: ...

    def instrument(self, fn: Callable[..., Any] | None = None, *, name: str | None = None,
                   device: str = "auto", items: Any = None) -> Any:
        """Monitor a plain callable; use as ``monitor.instrument(fn)`` or ``@monitor.instrument(name=...)``.

        ``items`` as for ``wrap``.
        """
        _check_items(items)

        def decorate(f: Callable[..., Any]) -> Any:
            if isinstance(f, Probe):
                raise WrapError("this callable is already monitored")
            if not callable(f):
                raise WrapError(f"cannot monitor {type(f).__name__!r}: it is not callable")
            label = name if name is not None else getattr(f, "__qualname__", None) or f"callable{next(self._anon)}"
            resolve = _fixed(device) if device != "auto" else _current_cuda_device
            return MonitoredFunction.create(f, self._new_state(label, resolve, items=items))

        return decorate if fn is None else decorate(fn)

    def track(self, name: str, *, device: str = "auto") -> Span:
        """``with monitor.track("generate"): ...`` counts and sample-times the block under ``model=name``."""
        state = self._states.get(name)
        if state is None:
            with self._names_lock:
                state = self._states.get(name)
            if state is None:
                resolve = _fixed(device) if device != "auto" else _current_cuda_device
                try:
                    state = self._new_state(name, resolve, capturable=False, items=False)
                except ConfigError:
                    state = self._states[name]  # created by a racing thread
        return Span(state)

    def generation(self, name: str, *, prompt_tokens: int | None = None) -> Generation:
        """One generation request under ``model=name``: call ``g.token(n=1)`` as tokens reach the caller.

        ``with monitor.generation("chat", prompt_tokens=12) as g:`` ends it as ``ok`` (an Exception in the
        block: ``error``, re-raised unchanged; another BaseException: ``cancelled``); without ``with``,
        end it with ``g.finish(outcome)``. The first ``token()`` gives the time to first token (seconds,
        host ``perf_counter``, from this call), the later ones the inter-token latency. ``name`` is
        registered on first use (the same name as a wrapped model shares its label; at most
        ``max_models`` names); a bad ``name`` or ``prompt_tokens`` raises ``ConfigError``. Costs one lock
        and a few counters here and in ``finish()``; ``token()`` one clock read and one deque append.
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
        """Yield ``iterable``'s items unchanged, timing them as one generation request under ``model=name``.

        The request starts now; each item is one token, or ``tokens(item)`` tokens (text chunks; 0
        records nothing; a failing callable is an internal error and counts 1). Exhaustion ends it
        ``ok``, an exception from the iterable ``error`` (re-raised unchanged), ``close()``, a consumer
        that breaks out, or garbage collection before the end ``cancelled``. An async iterable gives an
        async generator (``async for``; task cancellation counts as ``cancelled``). Times are seconds of
        host time at which each item is handed to the consumer.
        """
        return self.generations.stream(iterable, name=name, prompt_tokens=prompt_tokens, tokens=tokens)

    # -- regressions and captures ---------------------------------------------------------------

    def _detect(self, sample: Sample) -> None:
        """Sink: steady-state samples feed the regression detector (resolver thread)."""
        if sample.phase == STEADY and self.detector is not None:
            # Each stage of a generative model has its own baseline: prefill and decode never mix.
            # Like with like: each sample is judged against its own size class (its work, Sample.size).
            self._fire(self.detector.add(series_key(sample.model, sample.stage), sample.duration_seconds,
                                         sample.end_ns, sample.size))

    def _tick(self, now_ns: int) -> None:
        """Housekeeping (resolver thread): close due windows, expire stale armed captures, status history."""
        if self.detector is not None:
            self._fire(self.detector.tick(now_ns))
            self._retry_deferred(now_ns)
            self._baseline_captures(now_ns)
        self.captures.tick()
        self.generations.drain(now_ns)
        self._retry_bind(now_ns)
        mark_for_dynamo()  # torch.compile may have been imported since the models were wrapped
        if self.history.due(now_ns):
            groups = {name: _group(st) for name, st in list(self._states.items())}
            self.history.record(
                now_ns,
                [(name, sum(count_value(s.calls) for s in group), sum(sum(s.error_counts().values()) for s in group),
                  _items_of(group)[0]) for name, group in groups.items()],
                lambda model, since: [d for s in groups.get(model, ()) for d in
                                      self.windows.since(model, STEADY, since, stage=s.stage)],
                self.devices())

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

    def _fire(self, regressions: list[Regression]) -> None:
        policy = self.regression
        for r in regressions:
            model, stage = split_key(r.model)
            details = {**r.as_dict(), "model": model, **({"stage": stage} if stage else {})}
            self._log.warning("latency_regression", **details)
            st = self._states.get(model)
            if st is None or policy is None or not st.capturable:
                continue
            options = CaptureOptions(steps=policy.capture_steps, max_seconds=policy.capture_max_seconds,
                                     record_shapes=policy.capture_record_shapes,
                                     with_stack=policy.capture_with_stack,
                                     profile_memory=policy.capture_profile_memory)
            busy = self.captures.state != "idle"
            if self.captures.auto(st, options, details) is None and busy:
                # Another capture (a baseline, a manual one) holds the profiler: the detector fires once per
                # regression, so keep this one and arm it when the slot frees, while the regression lasts.
                self._deferred[r.model] = (st, options, details, perf_counter_ns() + int(DEFERRED_SECONDS * 1e9))

    def _retry_deferred(self, now_ns: int) -> None:
        """Arm a regression capture that found the slot busy, once it is free (resolver thread)."""
        if not self._deferred or self.captures.state != "idle" or self.detector is None:
            return
        active = {key for key, _, _, is_active, _ in self.detector.views() if is_active}
        for key, (st, options, details, expires_ns) in list(self._deferred.items()):
            del self._deferred[key]
            if key in active and now_ns < expires_ns:
                self.captures.auto(st, options, details)
                return  # one capture at a time

    def _baseline_captures(self, now_ns: int) -> None:
        """Arm a ``baseline`` capture of a model whose baseline is learned, no regression active, when it
        has none younger than ``baseline_capture_max_age_seconds`` (resolver thread; fail soft)."""
        policy, det = self.regression, self.detector
        if policy is None or det is None or not policy.baseline_capture or self.captures.state != "idle":
            return
        learned: dict[str, bool] = {}  # model -> every learned series healthy
        baselines: dict[str, dict[str, Any]] = {}
        for key, _, base, active, _ in det.views():
            model, stage = split_key(key)
            if base is not None or active:
                learned[model] = learned.get(model, True) and not active
                baselines.setdefault(model, {})[stage or "all"] = base
        for model, healthy in learned.items():
            last = self._baseline_checked.get(model)
            if not healthy or (last is not None and now_ns - last < BASELINE_CHECK_SECONDS * 1e9):
                continue
            self._baseline_checked[model] = now_ns
            st = self._states.get(model)
            if st is None or not st.capturable:
                continue
            try:
                meta = self.captures.latest_baseline(model)
                age = _age_seconds(meta.get("ended_at")) if meta is not None else None
                if age is not None and age < policy.baseline_capture_max_age_seconds:
                    continue
                options = CaptureOptions(steps=policy.capture_steps, max_seconds=policy.capture_max_seconds,
                                         record_shapes=policy.capture_record_shapes)
                reason = {"baseline_seconds": baselines.get(model),
                          "previous": None if meta is None else meta.get("id")}
                self.captures.baseline(st, options, reason)
            except Exception as exc:
                self._hub.internal.report("baseline_capture", exc)
            return  # one at a time: the controller holds one capture

    def capture(self, model: str | None = None, *, steps: int = 5, max_seconds: float = 10.0,
                record_shapes: bool = True, with_stack: bool = False, profile_memory: bool = False,
                requested_by: str = "api") -> dict[str, Any]:
        """Arm a manual capture of ``model`` (the only model when None); returns its metadata.

        Raises ``LookupError`` for an unknown model, ``ConfigError`` for bad options, ``capture.Busy``
        while a capture runs and ``capture.RateLimited`` past ``manual_captures_per_hour``.
        """
        st = self._pick_model(model)
        if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS:
            raise ConfigError(f"steps={steps!r}: expected an integer 1..{MAX_STEPS}")
        if isinstance(max_seconds, bool) or not isinstance(max_seconds, (int, float)) \
                or not 0 < max_seconds <= MAX_SECONDS:
            raise ConfigError(f"max_seconds={max_seconds!r}: expected a number in (0, {MAX_SECONDS:g}]")
        for flag, v in (("record_shapes", record_shapes), ("with_stack", with_stack),
                        ("profile_memory", profile_memory)):
            if not isinstance(v, bool):
                raise ConfigError(f"{flag}={v!r}: expected true or false")
        options = CaptureOptions(steps=steps, max_seconds=float(max_seconds), record_shapes=record_shapes,
                                 with_stack=with_stack, profile_memory=profile_memory)
        cap = self.captures.arm(st, options, trigger="manual", reason={"requested_by": requested_by[:200]})
        return cap.public()

    def _peaks(self, device: str) -> Peaks | None:
        """Peaks for a capture's roofline: the settings', else the GPU table's by device name."""
        cfg = self.config
        name = None
        if device.startswith("cuda") and torch.cuda.is_available():
            try:
                name = torch.cuda.get_device_name(int(device.partition(":")[2] or 0))
            except Exception:
                name = None
        return peaks_for(name, peak_flops=cfg.peak_flops, peak_bandwidth=cfg.peak_bandwidth)

    def _pick_model(self, model: str | None) -> ModelState:
        capturable = {n: s for n, s in self._states.items() if s.capturable}
        if model is None:
            if len(capturable) != 1:
                raise ConfigError(f"model: required when {len(capturable)} models can be captured; "
                                  f"one of {sorted(capturable)}")
            return next(iter(capturable.values()))
        st = self._states.get(model)
        if st is None:
            raise LookupError(f"unknown model {model!r}; known: {sorted(self._states)}")
        if not st.capturable:
            raise ConfigError(f"model {model!r} is a tracked block; captures need a wrapped model or function")
        return st

    def profiles(self) -> list[dict[str, Any]]:
        """Captures, newest first: the one in flight (if any) and the stored ones."""
        out = []
        cur = self.captures.current
        if cur is not None:
            out.append(cur.public())
        ids = {c["id"] for c in out}
        out += [m for m in self.traces.list() if m.get("id") not in ids]
        return out

    def profile(self, capture_id: str) -> dict[str, Any] | None:
        """One capture's metadata and op summary, or None."""
        return self.captures.view(capture_id) or self.traces.get(capture_id)

    def _new_state(self, name: str, resolve: Callable[[], str], *, capturable: bool = True,
                   items: Any = None, stage: str = "") -> ModelState:
        if not isinstance(name, str) or not name or len(name) > 128:
            raise ConfigError(f"model name {name!r}: expected a non-empty string of at most 128 characters")
        if not _printable_utf8(name):
            # A lone surrogate cannot be encoded: every /metrics render would fail (500) from then on.
            raise ConfigError(f"model name {name!r}: expected printable characters that encode as UTF-8 "
                              "(no control characters, no lone surrogates)")
        with self._names_lock:
            old = self._states.get(name)
            if old is not None and not old.attached and capturable and old.capturable:
                old.attached = True  # wrapped again after unwrap(): its counters continue
                return old
            if old is not None:
                raise ConfigError(f"model name {name!r} is already monitored; pass a distinct name=")
            if len(self._states) >= self.config.max_models:
                raise ConfigError(f"at most max_models={self.config.max_models} models per monitor "
                                  "(each name is a label value on every forward metric)")
            state = ModelState(name, self._hub, resolve, capturable=capturable, items=items, stage=stage)
            self._states[name] = state
        return state

    def _state_list(self) -> list[ModelState]:
        """Every state that is called: one per model, or one per stage of a model with stages."""
        out: list[ModelState] = []
        for st in list(self._states.values()):
            out.extend(list(st.stages.values()) if st.stages else (st,))
        return out

    # -- reading ------------------------------------------------------------------------------

    def flush(self, timeout: float = 2.0) -> bool:
        """Resolve every sample taken so far (waiting up to ``timeout`` seconds for the device).

        For tests, benchmarks and shutdown paths; never needed on the request path.
        """
        return self._resolver.drain(deadline_ns=perf_counter_ns() + int(timeout * 1e9))

    def stats(self) -> dict[str, Any]:
        """Per model: exact counts and the exact percentiles of recent samples, by phase (seconds)."""
        now = perf_counter_ns()
        self.history.touch(now)
        regression: dict[str, Any] = {}
        if self.detector is not None:
            for model, last, base, active, n in self.detector.views():
                regression[model] = {"active": active, "regressions": n, "baseline_seconds": base,
                                     "last_window": None if last is None else
                                     {"samples": last.count, "seconds": last.seconds,
                                      "ratios": last.ratios, "size_classes": last.classes},
                                     "size_classes": self.detector.classes(model)}
        def counts(st: ModelState) -> dict[str, Any]:
            return {
                "calls": count_value(st.calls),
                "errors": st.error_counts(),
                "sampled": count_value(st.sampled),
                "dropped": {r: n for r, c in st.drops.items() if (n := count_value(c))},
                "input_signatures": st.table.distinct,
                "signature_tracking": st.sigs is not None,
                "latency": self.windows.summary(st.name, now, stage=st.stage),
                "regression": regression.get(series_key(st.name, st.stage)),
            }

        models: dict[str, Any] = {}
        for name, st in list(self._states.items()):
            first = self.metrics.first_call(name)
            entry = models[name] = {
                "device": st.device,
                **counts(st),
                "sample_rate": st.sampler.rate,
                **_items_stats(_group(st), (now - self._hub.started_ns) / 1e9),
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
                             latency={}, regression=None, stages=stages)
        return {
            "version": __version__,
            "pid": os.getpid(),  # which worker of a multi-process server answered
            "uptime_seconds": (now - self._hub.started_ns) / 1e9,
            "window_seconds": self.config.stats_window_seconds,
            "pending_samples": self._resolver.pending,
            "internal_errors": dict(self._hub.internal.counts()),
            "models": models,
            "generation": self.generations.stats(now, self._hub.started_ns),
            "capture": {"state": self.captures.state, "current": self.captures.current.id
                        if self.captures.current else None, "suppressed": dict(self.captures.suppressed)},
            "devices": self.devices(),
            "series": self.history.series(),
            "control": {"token_required": self.config.token is not None},
        }

    def health(self) -> tuple[bool, dict[str, Any]]:
        """(healthy, details): healthy while the resolver thread runs.

        ``http`` says whether the agent's own port is bound: "listening", "unbound" (no free port in
        the range; timing goes on and the bind is retried, ``error`` says why) or "off" (``port=None``).
        An unbound port does not make the monitor unhealthy: the application and its mounted routes
        are fine.
        """
        alive = self._resolver.alive
        detail: dict[str, Any] = {"resolver": "running" if alive else "stopped", "models": len(self._states)}
        server, error = self._server, self._bind_error
        if self.config.port is None:
            detail["http"] = "off"
        elif server is not None:
            detail["http"], detail["port"] = "listening", server.port
        elif error is not None:
            detail["http"], detail["error"] = "unbound", error
        else:
            detail["http"] = "stopped"
        if self.config.health_port is not None:
            health = self._health_server
            detail["health_port"] = health.port if health is not None else None
        return alive, detail

    @property
    def wsgi_app(self) -> Callable[..., Any]:
        """/metrics, /healthz and /stats as a WSGI app, to mount in your own server."""
        return make_wsgi_app(self)

    @property
    def asgi_app(self) -> Callable[..., Any]:
        """/metrics, /healthz and /stats as an ASGI app, to mount in your own server."""
        return make_asgi_app(self)


_LIVE: weakref.WeakSet[Monitor] = weakref.WeakSet()
#: Set in a child forked after perfmon was imported: it is a worker, safe to prepare a profiler in.
_FORKED = False
#: This process initialised the profiler (Kineto) ahead of captures; a fork from now on is unsafe.
_PROFILER_PREPARED = False
_WARNED_FORK = False

#: Modules whose presence means this process may be a pre-fork server's master: it imports the
#: application (and so starts the monitor), then forks the workers.
PREFORK_SERVERS = ("gunicorn.arbiter", "uwsgi", "uwsgidecorators", "billiard")


def _prefork_server(modules: Any, *, forked: bool) -> str | None:
    """The pre-fork server this process may be the master of, or None (safe to prepare a profiler).

    A forked child (a worker) is safe: it forks no further workers. In a process that loads a
    pre-fork server and was not forked since perfmon was imported, it may be the master.
    """
    if forked:
        return None
    return next((m for m in PREFORK_SERVERS if m in modules), None)


def _before_fork() -> None:
    """Parent, just before fork(): say so once if the profiler ran here (the child may hang at exit)."""
    global _WARNED_FORK
    if _PROFILER_PREPARED and not _WARNED_FORK and _LIVE:
        _WARNED_FORK = True
        for monitor in list(_LIVE)[:1]:
            try:
                monitor._log.error("fork_after_profiler", pid=os.getpid(),
                                   note="torch.profiler ran in this process before fork(): a child that exits "
                                        "through sys.exit may hang or abort; start the monitor after the fork "
                                        "or pass prepare_profiler=False")
            except Exception:  # pragma: no cover - never break a fork
                pass


def _reinit_after_fork() -> None:
    global _FORKED, _PROFILER_PREPARED
    _FORKED = True
    _PROFILER_PREPARED = False  # the child's own Kineto state is not initialised by the parent's run
    for monitor in list(_LIVE):
        try:
            monitor._after_fork_in_child()
        except Exception:  # pragma: no cover - never break the child process
            pass


def _stop_at_exit() -> None:
    """Interpreter exit: stop running monitors (bounded joins, no capture left on, ports closed)."""
    for monitor in list(_LIVE):
        try:
            monitor.stop()
        except Exception:  # pragma: no cover
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_child=_reinit_after_fork)
atexit.register(_stop_at_exit)


def _sum_dicts(dicts: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


def _prompt_shape(args: tuple[Any, ...], kwargs: Any) -> tuple[int, int | None]:
    """(sequences, prompt tokens per sequence) of a generate() call, from the inputs' shape (no sync).

    Padding is counted: the attention mask's sum would be a device read.
    """
    inputs = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
    if inputs is None:
        inputs = kwargs.get("inputs_embeds")
    shape = getattr(inputs, "shape", None)
    if shape is None or len(shape) == 0:
        return 1, None
    if len(shape) == 1:
        return 1, int(shape[0])
    return int(shape[0]), int(shape[1])


#: How often (seconds) a model's baseline capture is looked up in the trace store (a directory read).
BASELINE_CHECK_SECONDS = 30.0
#: How long (seconds) a regression capture that found the capture slot busy waits for it to free.
DEFERRED_SECONDS = 120.0


def _age_seconds(iso: Any) -> float | None:
    """Seconds since an ISO 8601 UTC time stamp (a capture's ``ended_at``), or None when unreadable."""
    from datetime import datetime, timezone

    try:
        then = datetime.fromisoformat(str(iso))
    except ValueError:
        return None
    if then.tzinfo is None:
        then = then.replace(tzinfo=timezone.utc)
    return (datetime.now(timezone.utc) - then).total_seconds()


def _group(st: ModelState) -> list[ModelState]:
    """A model's states: its stages', or its own."""
    return list(st.stages.values()) if st.stages else [st]


def _items_of(group: list[ModelState]) -> tuple[int | None, int | None]:
    counts = [s.items_counts() for s in group]
    items = None if counts[0][0] is None else sum(i or 0 for i, _ in counts)
    padded = None if counts[0][1] is None else sum(p or 0 for _, p in counts)
    return items, padded


def _items_stats(group: list[ModelState], uptime_seconds: float) -> dict[str, Any]:
    items, padded = _items_of(group)
    out: dict[str, Any] = {"items": items, "items_per_second_since_start":
                           items / uptime_seconds if items is not None and uptime_seconds > 0 else None}
    if padded is not None:
        out["padded_items"] = padded
        out["padding_ratio"] = (1 - items / padded) if padded else 0.0  # type: ignore[operator]
    return out


def _is_loopback(host: str) -> bool:
    """True for a loopback address or ``localhost`` itself (not any name that merely starts with it)."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _printable_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return text.isprintable()


def _check_items(items: Any) -> None:
    if items is not None and items is not False and not callable(items):
        raise ConfigError(f"items={items!r}: expected None (batch dimension), a callable or False")


def _fixed(label: str) -> Callable[[], str]:
    label = str(label)
    if label.startswith("cuda") and ":" not in label and torch.cuda.is_available():
        label = f"cuda:{torch.cuda.current_device()}"
    return lambda: label


def _module_device(module: torch.nn.Module) -> Callable[[], str]:
    def resolve() -> str:
        for t in itertools.chain(module.parameters(), module.buffers()):
            return str(t.device)
        return "cpu"

    return resolve


def _current_cuda_device() -> str:
    # A plain callable has no parameters to look at: once the process uses CUDA, time on the current
    # device's stream with events (the work a callable enqueues is asynchronous).
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return f"cuda:{torch.cuda.current_device()}"
    return "cpu"
