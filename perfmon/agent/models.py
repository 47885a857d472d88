"""The monitor's models by name: wrapping, the ``model`` label registry, and the states they feed.

Every ``model`` label value is one ``ModelState`` (or one per stage of a generative model); the label
set is bounded by ``max_models``. ``Monitor.wrap``/``instrument``/``track`` land here.
"""

from __future__ import annotations

import inspect
import itertools
import threading
import weakref
from collections.abc import Callable
from time import perf_counter_ns
from typing import Any

import torch

from ..config import Config
from ..exceptions import ConfigError, WrapError
from .batching import BatchTokens, ContinuousBatching
from .decoding import GenerateCall, is_encoder_decoder
from .generation import GenerationTracker
from .latecall import LateCall
from .options import untimed_options
from .quiet import QuietDecode
from .sampling import EVERY_STEP, TIMELINE, CallSampler
from .span import UNTRACKED, Span, Untracked, monitored_coroutine
from .stages import ENCODE, PREFILL, Stages, generative_stage, is_generative
from .state import Hub, ModelState
from .wrap import MonitoredFunction, MonitoredModule, Probe, unwrap_module

__all__ = ["Models", "check_items"]


class Models:
    """The states of one monitor's models, by name (thread-safe registration, lock-free reads)."""

    def __init__(self, config: Config, hub: Hub, generations: GenerationTracker) -> None:
        self.config = config
        self._hub = hub
        self._generations = generations
        self.by_name: dict[str, ModelState] = {}
        self._lock = threading.Lock()
        self._anon = itertools.count(1)
        #: ``track`` names refused (invalid, or past max_models) -> why; bounded, so a request path that
        #: makes up names cannot grow it. A refused name is not retried: the limit does not shrink.
        self._refused: dict[str, ConfigError] = {}
        #: Tokens of continuous-batching steps, per model (batching.py; exported by BatchCollector).
        self.batch_tokens = BatchTokens()
        #: name -> the finalizer of the module wrapped under it (``_watch``).
        self._finalizers: dict[str, weakref.finalize[Any, Any]] = {}

    def reset_after_fork(self) -> None:
        """In a forked child: a lock a parent thread held at fork() is replaced, and each state's counters."""
        self._lock = threading.Lock()
        self.batch_tokens.reset_after_fork()
        for st in self._members():  # not states(): the parent's pending work is not the child's to run
            st.reset_after_fork()

    def get(self, name: str) -> ModelState | None:
        return self.by_name.get(name)

    def states(self) -> list[ModelState]:
        """Every state that is called: one per model, or one per stage of a model with stages. The returned
        ``generate()`` calls' settling runs first: a quiet call's decode steps are counted there (quiet.py)."""
        self._generations.settle_pending()
        return self._members()

    def _members(self) -> list[ModelState]:
        return [member for st in list(self.by_name.values()) for member in st.members()]

    def new_state(self, name: str, resolve: Callable[[], str], *, capturable: bool = True,
                  items: Any = None, stage: str = "") -> ModelState:
        if not isinstance(name, str) or not name or len(name) > 128:
            raise ConfigError(f"model name {name!r}: expected a non-empty string of at most 128 characters")
        if not _printable_utf8(name):
            # A lone surrogate cannot be encoded: every /metrics render would fail (500) from then on.
            raise ConfigError(f"model name {name!r}: expected printable characters that encode as UTF-8 "
                              "(no control characters, no lone surrogates)")
        with self._lock:
            old = self.by_name.get(name)
            if old is not None and not old.attached and capturable and old.capturable:
                old.attached = True  # wrapped again after unwrap(): its counters continue
                return old
            if old is not None:
                raise ConfigError(f"model name {name!r} is already monitored; pass a distinct name=")
            if len(self.by_name) >= self.config.max_models:
                raise ConfigError(f"at most max_models={self.config.max_models} models per monitor "
                                  "(each name is a label value on every forward metric)")
            state = ModelState(name, self._hub, resolve, capturable=capturable, items=items, stage=stage)
            self.by_name[name] = state
        return state

    def pick(self, model: str | None) -> ModelState:
        """The capturable model named ``model``, or the only one when None (``LookupError``/``ConfigError``)."""
        capturable = {n: s for n, s in self.by_name.items() if s.capturable}
        if model is None:
            if len(capturable) != 1:
                raise ConfigError(f"model: required when {len(capturable)} models can be captured; "
                                  f"one of {sorted(capturable)}")
            return next(iter(capturable.values()))
        st = self.by_name.get(model)
        if st is None:
            raise LookupError(f"unknown model {model!r}; known: {sorted(self.by_name)}")
        if not st.capturable:
            raise ConfigError(f"model {model!r} is a tracked block; captures need a wrapped model or function")
        return st

    def wrap(self, model: Any, *, name: str | None, device: str, items: Any, stage: Any) -> Any:
        """``Monitor.wrap``: a module monitored in place, or a plain callable through ``instrument``."""
        check_items(items)
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
            return self._watch(MonitoredModule.create(model, self.new_state(label, resolve, items=items)))
        first = PREFILL if stage is generative_stage else "other"
        state = self.new_state(label, resolve, items=items, stage=first)

        def make(label_: str) -> ModelState:
            st = ModelState(label, self._hub, resolve, items=items, stage=label_)
            st.target = state.target  # the model's module (an encoder's stage gets the encoder's: wrap.py)
            return st

        cfg = self.config
        # The first generate() call, then one in 1/sample_rate, has every step timed; its tokens are timed when sampled
        # (generation_sample_rate), and always when every forward of it is.
        calls = CallSampler(cfg.generation_sample_rate or cfg.sample_rate, cfg.sample_floor_seconds,
                            every=max(1, round(1 / cfg.sample_rate)))
        counted, every, floor_ns = calls.calls, calls.every, calls.floor_ns
        clock = perf_counter_ns
        generations = self._generations
        internal = self._hub.internal
        encoder_decoder = is_encoder_decoder(model)
        # Transformers' own generate() (GenerationMixin's, or a model class's in transformers) returns the sequences
        # (a tensor or an output with ``sequences``): an untimed call counts its tokens there. Another generate()
        # (remote code, a user's) may return anything: every call of it keeps the tap, which counts what it puts.
        own = getattr(type(model), "generate", None)
        returns_sequences = str(getattr(own, "__module__", "")).startswith("transformers.")

        hub = self._hub

        def requests(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], streamable: bool
                     ) -> GenerateCall | LateCall | None:
            if kwargs.get("cache_implementation") == "paged":  # generate() hands over to continuous batching:
                return None  # its requests are tracked there, by id (batching.py), not counted twice
            now = clock()
            index = next(counted)  # CallSampler.pick, inline: a frame less on the request thread (~2 µs in situ)
            picked = (0 if index % every and index < calls.next and now - calls.last_ns < floor_ns
                      else calls.due(index, now))
            if (not picked and returns_sequences and streamable and hub.timing
                    and kwargs.get("streamer") is None and len(generations.pending) < generations.queue_size):
                options = untimed_options(module, args, kwargs)
                if options is not None:  # not assisted
                    # Times nothing, needs nothing while it runs: opened and settled by the next read or drain.
                    return LateCall(module, args, kwargs, generations, label, internal, encoder_decoder,
                                    quiet[0] if quiet else None, options, now)
            return GenerateCall(module, args, kwargs, generations, label, picked == TIMELINE | EVERY_STEP, internal,
                                streamable=streamable, encoder_decoder=encoder_decoder,
                                timeline=picked != 0 or not returns_sequences, own=returns_sequences)

        built: list[Stages] = []

        def build(fn: Any) -> Stages:
            built.append(Stages(stage, make, fn, first=state, internal=internal))
            return built[-1]

        # Continuous batching (generate_batch, init_continuous_batching): a request per request id.
        batching = ContinuousBatching(label, start=lambda prompt: generations.start(label, prompt),
                                      tokens=self.batch_tokens, internal=internal)
        quiet: list[QuietDecode] = []  # the model's quiet decoding (quiet.py), made once its stages are
        can_quiet = returns_sequences and QuietDecode.supports(model, encoder_decoder=encoder_decoder)
        MonitoredModule.create(model, state, build, requests=requests, batching=batching)
        if built and can_quiet:
            quiet.append(QuietDecode(built[0], internal))
            built[0].quiet = quiet[0]
        encoder = _encoder_of(model)
        if encoder is not None and built:
            # generate() runs an encoder-decoder's encoder once, through the encoder module itself: its own hot
            # path, counted as the model's stage="encode" (the decoder's steps stay prefill/decode).
            MonitoredModule.create(encoder, built[0].state(ENCODE))
        return self._watch(model, quiet[0].views if quiet else None)

    def _watch(self, model: Any, views: list[Any] | None = None) -> Any:
        """A wrapped module the server drops counts as unwrapped once it is collected: its name may be wrapped
        again (the model's next version) and continue its series, as after ``unwrap``. ``views``: the quiet views
        kept for its calls (quiet.py), let go then: they hold what its ``__dict__`` held (its weights)."""
        st: ModelState = type(model)._perfmon_state
        finalizer = weakref.finalize(model, _detach, st, views)
        finalizer.atexit = False
        with self._lock:
            old = self._finalizers.pop(st.name, None)
            self._finalizers[st.name] = finalizer
        if old is not None:
            old.detach()  # the name's previous module was unwrapped: its end must not detach this one
        return model

    def unwrap(self, model: Any) -> Any:
        """``Monitor.unwrap``: the module's own class back; its series stay."""
        st: ModelState | None = getattr(type(model), "_perfmon_state", None)
        if st is None or not isinstance(model, MonitoredModule) or self.by_name.get(st.name) is not st:
            raise WrapError("this object is not a module monitored by this monitor")
        unwrap_module(model)
        encoder = _encoder_of(model, monitored=True)
        if encoder is not None and type(encoder)._perfmon_state.name == st.name:
            unwrap_module(encoder)
        st.attached = False
        with self._lock:
            finalizer = self._finalizers.pop(st.name, None)
        if finalizer is not None:
            detached = finalizer.detach()
            if detached is not None and detached[2][1]:
                detached[2][1].clear()  # the quiet views kept for its calls
        return model

    def instrument(self, fn: Callable[..., Any] | None, *, name: str | None, device: str, items: Any) -> Any:
        """``Monitor.instrument``: a monitored callable, or a decorator when ``fn`` is None."""
        check_items(items)

        def decorate(f: Callable[..., Any]) -> Any:
            if isinstance(f, Probe) or getattr(f, "perfmon_state", None) is not None:
                raise WrapError("this callable is already monitored")
            if not callable(f):
                raise WrapError(f"cannot monitor {type(f).__name__!r}: it is not callable")
            label = name if name is not None else getattr(f, "__qualname__", None) or f"callable{next(self._anon)}"
            if inspect.isgeneratorfunction(f) or inspect.isasyncgenfunction(f):
                # Its call returns a generator before any of its work runs: timed, it would read microseconds.
                raise WrapError(f"cannot monitor {label!r}: a generator function returns before its work runs; time "
                                "the loop that consumes it with monitor.track()")
            resolve = _fixed(device) if device != "auto" else _current_cuda_device
            if inspect.iscoroutinefunction(f) or inspect.iscoroutinefunction(type(f).__call__):  # an async __call__
                return monitored_coroutine(f, self.new_state(label, resolve, capturable=False, items=items))
            return MonitoredFunction.create(f, self.new_state(label, resolve, items=items))

        return decorate if fn is None else decorate(fn)

    def track(self, name: str, *, device: str) -> Span | Untracked:
        """``Monitor.track``: a block counted and sample-timed under ``model=name``.

        ``track`` runs in the request path, so a name perfmon cannot take (invalid, or a new one past
        ``max_models``) never raises there: the block runs untracked, and each such block counts in
        ``perfmon_internal_errors_total{stage="track"}`` (the first logged with the reason).
        """
        state = self.by_name.get(name) if isinstance(name, str) else None
        if state is not None:
            return Span(state)
        refused = self._refused.get(name) if isinstance(name, str) else None
        if refused is None:
            resolve = _fixed(device) if device != "auto" else _current_cuda_device
            try:
                return Span(self.new_state(name, resolve, capturable=False, items=False))
            except ConfigError as exc:
                with self._lock:
                    state = self.by_name.get(name) if isinstance(name, str) else None  # a racing thread made it
                    if state is not None:
                        return Span(state)
                    if isinstance(name, str) and len(self._refused) < 1024:
                        self._refused[name] = exc
                refused = exc
        self._hub.internal.report("track", refused)
        return UNTRACKED


def check_items(items: Any) -> None:
    if items is not None and items is not False and not callable(items):
        raise ConfigError(f"items={items!r}: expected None (batch dimension), a callable or False")


def _encoder_of(model: Any, *, monitored: bool = False) -> Any:
    """An encoder-decoder model's encoder module (Hugging Face ``get_encoder()``), or None."""
    if not getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return None
    get = getattr(model, "get_encoder", None)
    try:
        encoder = get() if callable(get) else None
    except Exception:
        return None
    if not isinstance(encoder, torch.nn.Module) or encoder is model:
        return None
    return encoder if isinstance(encoder, MonitoredModule) == monitored else None


def _printable_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return text.isprintable()


def _fixed(label: str) -> Callable[[], str]:
    label = str(label)
    if label.startswith("cuda") and ":" not in label and torch.cuda.is_available():
        label = f"cuda:{torch.cuda.current_device()}"
    return lambda: label


def _detach(state: ModelState, views: list[Any] | None = None) -> None:
    state.attached = False
    if views:
        views.clear()


def _module_device(module: torch.nn.Module) -> Callable[[], str]:
    # A weak reference: the state outlives the module (its series stay), and must not keep a model the server
    # dropped alive, weights and all (on a GPU, its memory). Gone, it keeps its last device.
    ref = weakref.ref(module)
    last = "cpu"

    def resolve() -> str:
        nonlocal last
        live = ref()
        if live is not None:
            last = next((str(t.device) for t in itertools.chain(live.parameters(), live.buffers())), "cpu")
        return last

    return resolve


def _current_cuda_device() -> str:
    # A plain callable has no parameters to look at: once the process uses CUDA, time on the current
    # device's stream with events (the work a callable enqueues is asynchronous).
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return f"cuda:{torch.cuda.current_device()}"
    return "cpu"
