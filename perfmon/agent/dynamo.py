"""torch.compile (Dynamo) and perfmon: mark perfmon's code so that Dynamo runs it eagerly.

The hot path's frames are skipped but what they call (the user's model) is compiled; every other
function of every ``perfmon`` module is skipped with everything it calls (see ``mark_for_dynamo``).

The marks need ``torch._dynamo`` imported, and the usual order imports it after a model is wrapped:
``torch.compile(monitor.wrap(model))`` imports it in ``torch.compile`` and traces on the first call, before
any housekeeping tick could mark. So when a wrap finds it not yet imported, an import hook (``_Watch``, one
entry on ``sys.meta_path`` until the import it waits for begins) marks as that import completes: the way APM
agents' post-import hooks instrument a library imported after them.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
import types
from collections.abc import Mapping, Sequence
from typing import Any

from .hotpath import due_step, hot_path, sampled_path
from .reruns import Reruns
from .stages import staged_path

__all__ = ["mark_for_dynamo"]


_DYNAMO_MARKED = False
_DYNAMO = "torch._dynamo"


class _Watch(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when ``torch._dynamo``'s import begins, it leaves ``sys.meta_path`` and has the
    finder that does find it mark perfmon's code the moment the module's own code has run (before any caller can
    use it to compile). Every other import pays one string compare while it is installed."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != _DYNAMO:
            return None
        _unwatch()
        try:
            spec: importlib.machinery.ModuleSpec | None = None
            for finder in list(sys.meta_path):
                find = getattr(finder, "find_spec", None)
                spec = find(fullname, path, target) if find is not None else None
                if spec is not None:
                    break
            if spec is None:
                return None
            run = getattr(spec.loader, "exec_module", None)
            if run is None:
                return spec

            def exec_module(module: types.ModuleType) -> None:
                run(module)
                # The module's code has run (its import finishes when this returns): mark now, not at the next
                # tick. A failure in here must not fail the user's import.
                try:
                    _mark()
                except Exception:
                    pass

            # On this spec's own loader instance (a new one per spec): the module keeps its real loader.
            spec.loader.exec_module = exec_module  # type: ignore[union-attr, method-assign]
            return spec
        except Exception:  # anything odd: the normal import goes on, and the tick marks later
            return None


_WATCH = _Watch()
_WATCH_LOCK = threading.Lock()


def _watch() -> None:
    with _WATCH_LOCK:
        if _WATCH not in sys.meta_path:
            sys.meta_path.insert(0, _WATCH)


def _unwatch() -> None:
    with _WATCH_LOCK:
        try:
            sys.meta_path.remove(_WATCH)
        except ValueError:
            pass


def mark_for_dynamo() -> bool:
    """Tell torch.compile (Dynamo) to run perfmon eagerly and compile only the model it calls.

    Traced, the hot path would graph-break (locks, deques) or, worse, specialise on the call counter
    and recompile on every call. So the hot path's frame is skipped (the frames it calls are still
    compiled: the model's own ``__call__`` frame is compiled whole, zero graph breaks from perfmon) and
    every other perfmon function is skipped with everything it calls (the slow paths, which hold
    locks). Every call is still counted and sampled. The marks are on code objects, free at run time;
    they need ``torch._dynamo`` (~1 s to import), so they are set once something else imported it:
    here when a model is wrapped, as that import completes (``_Watch``, installed here while it has not
    begun), and from the resolver's housekeeping tick (``Monitor`` calls it). True once marked.
    """
    if _DYNAMO_MARKED:
        return True
    dynamo = sys.modules.get(_DYNAMO)
    if dynamo is None:
        if _WATCH not in sys.meta_path:  # a tick's check while nothing imports it: a short list's scan
            _watch()
        return False
    if getattr(getattr(dynamo, "__spec__", None), "_initializing", False):
        # Being imported by another thread (the FLOP counter's fake tensors import it), and begun before a watch
        # could see it: importing from its half-made modules here would fail, in either thread. The next tick will.
        return False
    _unwatch()
    _mark()
    return True


def _mark() -> None:
    """Set the marks (``torch._dynamo`` imported, its own code run), once."""
    global _DYNAMO_MARKED
    if _DYNAMO_MARKED:
        return
    _DYNAMO_MARKED = True
    try:
        from torch._dynamo.eval_frame import set_code_exec_strategy  # type: ignore[attr-defined]
        from torch._dynamo.types import FrameAction, FrameExecStrategy  # type: ignore[attr-defined]

        for code in _HOT_CODES:
            set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, FrameAction.DEFAULT))
        everything = FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP)
        for code in _perfmon_code(sys.modules):
            if code not in _HOT_CODES:
                set_code_exec_strategy(code, everything)
    except Exception:  # an older or newer torch without these: compile still works, it just traces us
        pass


def _perfmon_code(modules: Mapping[str, Any]) -> list[types.CodeType]:
    """The code objects of perfmon's functions and methods (module level and in classes)."""
    out: list[types.CodeType] = []
    for name, module in list(modules.items()):
        if not (name == "perfmon" or name.startswith("perfmon.")) or module is None:
            continue
        for obj in list(vars(module).values()):
            if getattr(obj, "__module__", None) != name:
                continue
            members = vars(obj).values() if isinstance(obj, type) else (obj,)
            for member in members:
                fn = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
                fn = fn.fget if isinstance(fn, property) else fn
                code = getattr(fn, "__code__", None)
                if isinstance(code, types.CodeType):
                    out.append(code)
    return out


def _inner_code(fn: Any, name: str = "__call__") -> types.CodeType:
    """The code object of the function ``name`` (``__call__``) a closure factory builds."""
    return next(c for c in fn.__code__.co_consts if getattr(c, "co_name", None) == name)  # type: ignore[no-any-return]


#: Frames torch.compile skips but whose callees it compiles: the user's model runs inside them (a call the fast
#: path does not take inside ``general``, one in a request span inside ``in_request``, a timed or captured one
#: inside ``sampled``, one tensor's due call when the monitor is not timing inside ``due_one``, a forward of the
#: model's own generate() inside ``in_generate``, ``due_step`` or ``Reruns.step``).
_HOT_CODES = (_inner_code(hot_path), _inner_code(hot_path, "general"), _inner_code(hot_path, "in_request"),
              _inner_code(hot_path, "due_one"),
              _inner_code(sampled_path, "sampled"),
              _inner_code(staged_path), _inner_code(staged_path, "in_generate"), due_step.__code__,
              Reruns.step.__code__)
