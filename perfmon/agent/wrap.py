"""Wrapping: put the hot path in front of a module's or a function's calls, and take it away.

``MonitoredModule.create`` swaps a module's class, in place, for a subclass made for that one model
whose ``__call__`` is the hot path (pickling, copying, ``.to()`` and ``module.compile()`` keep
working: the class-swap helpers below); ``unwrap_module`` gives the class back. ``Probe`` and
``MonitoredFunction`` are what ``Monitor.instrument`` returns for a plain callable.
"""

from __future__ import annotations

import functools
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .decoding import Call, tracked_generate
from .dynamo import mark_for_dynamo
from .hotpath import hot_path
from .stages import StageFn, Stages, staged_path
from .state import ModelState

__all__ = ["MonitoredFunction", "MonitoredModule", "Probe", "unwrap_module"]


class Probe:
    """Base of the objects ``Monitor.instrument`` returns (a monitored function).

    Each instance gets its own subclass whose ``__call__`` is ``hot_path(state, target)``
    (see ``Probe.create``); the bounded number of models keeps the number of classes bounded.
    """

    __slots__ = ("_pm", "_pm_fn")

    _pm: ModelState
    _pm_fn: Callable[..., Any]

    @classmethod
    def create(cls, target: Callable[..., Any], state: ModelState) -> Any:
        def call(_probe: Any, *args: Any, **kwargs: Any) -> Any:
            return target(*args, **kwargs)

        mark_for_dynamo()
        sub = type(cls.__name__, (cls,), {"__slots__": (), "__call__": hot_path(state, call),
                                          "__module__": cls.__module__, "__qualname__": cls.__qualname__})
        return sub(target, state)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # pragma: no cover - replaced per instance
        raise TypeError("use Probe.create()")


class MonitoredFunction(Probe):
    """A monitored plain callable (a ``generate()`` loop, a pipeline step); also works on methods."""

    __slots__ = ("__dict__", "__weakref__")

    def __init__(self, fn: Callable[..., Any], state: ModelState) -> None:
        self._pm_fn = fn
        self._pm = state
        functools.update_wrapper(self, fn)  # type: ignore[arg-type]

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self
        return types.MethodType(self, instance)

    def __repr__(self) -> str:
        return f"<perfmon monitored {self._pm_fn!r} as {self._pm.name!r}>"


class MonitoredModule:
    """The mark of a monitored ``nn.Module``: a base of the per-model class ``Monitor.wrap`` gives it.

    ``wrap`` does not return a proxy. It swaps the module's class for a subclass made for this one
    model, with the same name, module and qualified name, whose ``__call__`` is the hot path in front
    of the class's own ``__call__`` (hooks, then ``forward``). So every call is monitored, however it
    comes: through the object ``wrap`` returned, from the model's own methods (Hugging Face
    ``generate()`` calls ``self(...)``), from a parent module or a pipeline holding it. And it is the
    user's object: ``isinstance`` holds, ``.to()``/``.eval()`` return it, ``state_dict`` is unchanged.
    ``type(model) is Cls`` is the one check that no longer holds (``type(model).__name__`` still does).

    Pickling (``torch.save``), ``copy.copy`` and ``copy.deepcopy`` produce the bare class: a copy is a
    new model, not the monitored one. ``Monitor.unwrap`` restores the class.
    """

    __slots__ = ()

    _perfmon_state: ModelState
    _perfmon_base: type

    @classmethod
    def create(cls, module: torch.nn.Module, state: ModelState, stages: Callable[..., Stages] | None = None,
               requests: Callable[[Any, tuple[Any, ...], dict[str, Any], bool], Call | None] | None = None,
               batching: Callable[[type, Callable[..., None]], dict[str, Any]] | None = None) -> Any:
        """Swap ``module``'s class for a monitored subclass (in place); returns ``module``.

        ``stages``, for a model with stages, builds its ``Stages`` from the call target; ``state`` is
        then its first stage's. ``requests`` opens a ``generate()`` call's requests (models with stages
        only: see ``decoding.tracked_generate``). ``batching`` (a ``batching.ContinuousBatching``, models
        with stages only) gives the methods that track continuous batching.
        """
        base = type(module)
        mark_for_dynamo()
        staged = None
        # nn.Module.__call__ only checks for module.compile()'s _compiled_call_impl, then runs _call_impl: calling
        # _call_impl directly saves that frame (~190 ns a call; a forward of generate() a token). module.compile()
        # switches the model back to the full __call__ (_compile_then_call_fully); a module compiled before it was
        # wrapped keeps it from the start (its compiled call would otherwise never run).
        plain = base.__call__ is _MODULE_CALL and getattr(module, "_compiled_call_impl", None) is None
        if stages is not None:
            staged = stages(_CALL_IMPL if plain else base.__call__)
            call = staged_path(staged)
        elif plain:
            call = hot_path(state, _CALL_IMPL)
        else:
            call = hot_path(state, base.__call__)
        ns: dict[str, Any] = {
            "__slots__": (), "__module__": base.__module__, "__qualname__": base.__qualname__,
            "__doc__": base.__doc__, "_perfmon_state": state, "_perfmon_base": base, "__call__": call,
            # torch.jit.script compiles every property of a module's class: perfmon's is Python's only (scripted, the
            # module runs its forward without perfmon, as a scripted module runs no Python __call__).
            "__jit_unused_properties__": [*getattr(base, "__jit_unused_properties__", ()), "perfmon_name"],
        }
        if _is_torch_builtin(base.forward):
            ns["forward"] = _compilable_forward(base.forward)
        if stages is not None and requests is not None and callable(getattr(base, "generate", None)):
            ns["generate"] = tracked_generate(base.generate, requests, state.hub.internal)  # type: ignore[attr-defined]
        if staged is not None and batching is not None:  # continuous batching (batching.py)
            ns.update(batching(base, functools.partial(_restage, staged)))
        if plain:
            ns["compile"] = _compile_then_call_fully(base, state, staged)
        sub = type(base.__name__, (base, cls), ns)
        sub.__new__ = staticmethod(_construct_as(sub, base))  # type: ignore[method-assign,assignment]
        sub.__reduce_ex__ = _reduce_as(sub, base)  # type: ignore[method-assign]
        sub._apply = _apply_then_relabel(base, state)  # type: ignore[attr-defined]
        state.target = weakref.ref(module)  # FLOPs are counted on a fake copy of it (flopcount.py), never on it
        module.__class__ = sub
        return module

    @property
    def perfmon_name(self) -> str:
        """The ``model`` label of this module's metrics."""
        return type(self)._perfmon_state.name


def _restage(stages: Stages, cls: type, wrap_stage: Callable[[StageFn], StageFn]) -> None:
    """Give a model with stages the stage function ``wrap_stage(current)`` and a ``__call__`` that uses it.

    staged_path reads the stage function once, when it builds ``__call__``; batching.py calls this the
    first time the model runs continuous batching, so a model that never does pays nothing per forward.
    """
    stages.stage_fn = wrap_stage(stages.stage_fn)
    cls.__call__ = staged_path(stages)  # type: ignore[method-assign]


def unwrap_module(module: Any) -> Any:
    """Give a monitored module its own class back (exactly: the object is the same); returns it."""
    cls = type(module)
    if not isinstance(module, MonitoredModule):
        raise TypeError(f"{cls.__name__!r} object is not a module monitored by perfmon")
    module.__class__ = cls._perfmon_base
    return module


def _is_torch_builtin(forward: Any) -> bool:
    return str(getattr(forward, "__module__", "")).startswith("torch.")


_MODULE_CALL = torch.nn.Module.__call__
_CALL_IMPL = torch.nn.Module._call_impl


def _compile_then_call_fully(base: type, state: ModelState, staged: Stages | None) -> Callable[..., Any]:
    """``module.compile()``: compile as torch does, then run the full ``nn.Module.__call__`` (which calls
    the compiled ``_compiled_call_impl``) behind the hot path (each stage's, for a model with stages)."""
    compile_ = base.compile  # type: ignore[attr-defined]

    def compile(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = compile_(self, *args, **kwargs)
        if staged is not None:
            staged.call_with(base.__call__)
        else:
            type(self).__call__ = hot_path(state, base.__call__)
        return result

    return compile


def _compilable_forward(forward: Callable[..., Any]) -> Callable[..., Any]:
    """The builtin ``forward`` as a function torch.compile takes for user code, at no cost a call.

    ``torch.compile`` inlines the whole ``__call__`` of a module whose ``forward`` is torch's own
    (``nn.Sequential``, ``nn.Linear``...: ``OptimizedModule`` asks ``trace_rules.check(forward)``, which
    goes by the code's file) instead of compiling its frame; inlined, perfmon's hot path would stop
    the graph and leave the model uncompiled. With a ``forward`` that is not torch's, the module's
    ``__call__`` frame is compiled as for any user-defined model (tests/test_wrap.py).

    So the class gets a copy of the builtin: the same code (bytecode, line numbers, closure, defaults,
    globals) under a file name of perfmon's (``_COPY_PREFIX`` + torch's path). A call runs exactly
    torch's forward, with no frame in front of it (a trampoline of one Python call cost ~60-160 ns a
    call on Linear(64, 64)); a traceback through it shows torch's source lines (``linecache`` finds
    them from the function's module). A ``forward`` with no code object of its own gets a trampoline.
    """
    code = getattr(forward, "__code__", None)
    if isinstance(code, types.CodeType) and isinstance(getattr(forward, "__globals__", None), dict):
        copy = types.FunctionType(code.replace(co_filename=_COPY_PREFIX + code.co_filename), forward.__globals__,
                                  forward.__name__, forward.__defaults__, forward.__closure__)  # type: ignore[attr-defined]
        copy.__kwdefaults__ = getattr(forward, "__kwdefaults__", None)
        return functools.update_wrapper(copy, forward)

    @functools.wraps(forward)
    def forward_(self: Any, *args: Any, **kwargs: Any) -> Any:
        return forward(self, *args, **kwargs)

    return forward_


#: The file name of a builtin forward's copy starts with this (then torch's own path): not torch's, for Dynamo.
_COPY_PREFIX = "perfmon-copy:"


def _construct_as(sub: type, base: type) -> Callable[..., Any]:
    """``__new__`` that builds a new object of a monitored class as its bare class.

    Code that builds a model from one it has reaches for ``type(self)``: a slice of an ``nn.Sequential``
    (``self.__class__(...)``), transformers' ``from_pretrained`` called on a model or its class (``cls(config)``),
    ``type(model)(config)``. Built as ``sub`` they would share the wrapped model's state and count under its name; the
    user wrapped one object, so they are bare (wrap them to monitor them). Python runs no ``__init__`` on what
    ``__new__`` returns when it is not a ``sub``: ``base(...)`` runs its own. perfmon's own subclasses of ``sub``
    (the quiet path's views, made with ``cls.__new__(cls)``) are built as asked.
    """

    def __new__(kind: type, *args: Any, **kwargs: Any) -> Any:
        if kind is sub:
            return base(*args, **kwargs)
        nxt = super(sub, kind).__new__  # type: ignore[arg-type]
        return nxt(kind) if nxt is object.__new__ else nxt(kind, *args, **kwargs)

    return __new__


def _reduce_as(sub: type, base: type) -> Callable[..., Any]:
    """``__reduce_ex__`` that pickles and copies a monitored module as its bare class.

    The copy is then loadable where perfmon is not installed, and a deep copy is a new, unmonitored
    model rather than a second object counting under the first one's name.
    """
    import copyreg

    def __reduce_ex__(self: Any, protocol: Any) -> Any:
        rv = super(sub, self).__reduce_ex__(protocol)  # type: ignore[arg-type]
        if not isinstance(rv, tuple) or len(rv) < 2:
            return rv
        func, args = rv[0], rv[1]
        if func is copyreg.__newobj__ and tuple(args) == (sub,):  # type: ignore[attr-defined]
            # pickle insists that __newobj__'s class is type(obj); the reconstructor does the same job.
            return (copyreg._reconstructor, (base, object, None), *rv[2:])  # type: ignore[attr-defined]
        return (func, tuple(base if a is sub else a for a in args), *rv[2:])

    return __reduce_ex__


def _apply_then_relabel(base: type, state: ModelState) -> Callable[..., Any]:
    """``nn.Module._apply`` (behind ``.to()``, ``.cuda()``, ``.half()``...), then re-read the device label."""
    apply = base._apply  # type: ignore[attr-defined]

    def _apply(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = apply(self, *args, **kwargs)
        try:
            for st in list((state.stages or {state.stage: state}).values()):
                st.refresh_device()
        except Exception as exc:
            state.hub.internal.report("device", exc)
        return result

    return _apply
