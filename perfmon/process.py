"""Process-wide hooks: fork, interpreter exit, and the profiler's one-time preparation.

A process has one Kineto and one fork history, whatever number of monitors it runs: this module keeps
that state and calls each live agent's ``after_fork_in_child()``/``stop()``/``log`` (any object with
them; it imports no monitor).
"""

from __future__ import annotations

import atexit
import os
import sys
import weakref
from typing import Any

from .captures.profiler import warm_up_profiler

__all__ = ["PREFORK_SERVERS", "live", "prefork_server", "prepare_profiler"]

#: Agents to reset in a forked child and to stop at exit.
live: weakref.WeakSet[Any] = weakref.WeakSet()
#: Set in a child forked after perfmon was imported: it is a worker, safe to prepare a profiler in.
_FORKED = False
#: This process initialised the profiler (Kineto) ahead of captures; a fork from now on is unsafe.
_PROFILER_PREPARED = False
_WARNED_FORK = False

#: Modules whose presence means this process may be a pre-fork server's master: it imports the
#: application (and so starts the monitor), then forks the workers.
PREFORK_SERVERS = ("gunicorn.arbiter", "uwsgi", "uwsgidecorators", "billiard")


def prefork_server(modules: Any, *, forked: bool) -> str | None:
    """The pre-fork server this process may be the master of, or None (safe to prepare a profiler).

    A forked child (a worker) is safe: it forks no further workers. In a process that loads a
    pre-fork server and was not forked since perfmon was imported, it may be the master.
    """
    if forked:
        return None
    return next((m for m in PREFORK_SERVERS if m in modules), None)


def prepare_profiler(log: Any, internal: Any) -> None:
    """Take Kineto's ~1 s first start off the first capture, where that is safe (see ``Config.prepare_profiler``)."""
    global _PROFILER_PREPARED
    if _PROFILER_PREPARED:
        return
    server = prefork_server(sys.modules, forked=_FORKED)
    if server is not None:
        log.info("profiler_prepare_deferred", server=server,
                 note="this process may fork workers: each worker prepares its own profiler "
                      "when its monitor restarts after the fork")
        return
    try:
        took = warm_up_profiler()
        _PROFILER_PREPARED = True
        log.info("profiler_ready", seconds=round(took, 3))
    except Exception as exc:
        internal.report("capture", exc)


def _before_fork() -> None:
    """Parent, just before fork(): say so once if the profiler ran here (the child may hang at exit)."""
    global _WARNED_FORK
    if _PROFILER_PREPARED and not _WARNED_FORK and live:
        _WARNED_FORK = True
        for agent in list(live)[:1]:
            try:
                agent.log.error("fork_after_profiler", pid=os.getpid(),
                                note="torch.profiler ran in this process before fork(): a child that exits "
                                     "through sys.exit may hang or abort; start the monitor after the fork "
                                     "or pass prepare_profiler=False")
            except Exception:  # pragma: no cover - never break a fork
                pass


def _reinit_after_fork() -> None:
    global _FORKED, _PROFILER_PREPARED
    _FORKED = True
    _PROFILER_PREPARED = False  # the child's own Kineto state is not initialised by the parent's run
    for agent in list(live):
        try:
            agent.after_fork_in_child()
        except Exception:  # pragma: no cover - never break the child process
            pass


def _stop_at_exit() -> None:
    """Interpreter exit: stop running monitors (bounded joins, no capture left on, ports closed)."""
    for agent in list(live):
        try:
            agent.stop()
        except Exception:  # pragma: no cover
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_child=_reinit_after_fork)
atexit.register(_stop_at_exit)
