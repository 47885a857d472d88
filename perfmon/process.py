"""Process-wide hooks: fork, interpreter exit, and the profiler's one-time preparation.

A process has one Kineto and one fork history, whatever number of monitors it runs: this module keeps
that state and calls each live agent's ``after_fork_in_child(restart=)``/``stop()``/``log`` (any object with
them; it imports no monitor). A fork by a torch DataLoader starting its workers restarts no agent (``forked_for``).

**A forked child of a process that ran the profiler.** Kineto's first start leaves a thread of its own
and C++ static objects that own it. A fork copies the objects but not the thread, so in the child their
destructors, run by ``exit()`` after Python's own shutdown, wait forever for it (a condition variable the
missing thread was waiting on: the child hangs) or join it (``std::system_error``: SIGABRT). Measured with
torch 2.13 alone, no perfmon needed: a profiler run, then ``os.fork()``, and a child that leaves through
``sys.exit(0)`` hangs; after a capture, it aborts. perfmon cannot make torch's destructors safe, so such a
child does not run them: once Python's shutdown is over (every ``atexit`` handler run, ``sys.stdout``
flushed), ``exit()`` ends the process with its status through ``_exit`` (glibc's ``on_exit``, registered
last so it runs first), before the C++ destructors. Nothing of Python's is skipped; C-level exit handlers
registered earlier are (stdio buffers are flushed first). Children that leave through ``os._exit``
(multiprocessing) never needed it.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import sys
import threading
import weakref
from typing import Any

from .captures.profiler import profiler_has_run, warm_up_profiler
from .captures.profiler import reset_after_fork as reset_profiler_after_fork

__all__ = ["PREFORK_SERVERS", "live", "prefork_server", "prepare_profiler"]

#: Agents to reset in a forked child and to stop at exit.
live: weakref.WeakSet[Any] = weakref.WeakSet()
#: Set in a child forked after perfmon was imported: it is a worker, safe to prepare a profiler in.
_FORKED = False
#: This process initialised the profiler (Kineto) ahead of captures; a fork from now on is unsafe.
_PROFILER_PREPARED = False
_WARNED_FORK = False
#: This process's exit skips the C++ static destructors (see the module doc); a fork copies it.
_EXIT_GUARDED = False
#: Set while the fork hook resets and restarts the agents (``prepare_profiler`` then runs on a thread).
_IN_FORK_HOOK = False
#: The thread preparing the profiler, started from the fork hook, or None.
_PREPARING: threading.Thread | None = None
#: How long the exit waits for that thread before it skips the C++ destructors (seconds).
_PREPARE_EXIT_WAIT_SECONDS = 5.0

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
    """Take Kineto's ~1 s first start off the first capture, where that is safe (see ``Config.prepare_profiler``).

    Inside the fork hook (a monitor restarting in a pre-fork server's worker) it runs on a thread of its own: the
    hook runs within ``os.fork()``, before the server has set up the worker (gunicorn installs the worker's signal
    handlers after it), so seconds spent there delayed every worker's boot and a SIGTERM meanwhile went to the
    master's handlers, copied into the worker, which ignore it: the worker stayed up until SIGKILLed at
    ``--graceful-timeout`` (3 of 3). A capture armed while it runs waits for it (``profiler_warming``)."""
    global _PROFILER_PREPARED, _PREPARING
    if _PROFILER_PREPARED or (_PREPARING is not None and _PREPARING.is_alive()):
        return
    server = prefork_server(sys.modules, forked=_FORKED)
    if server is not None:
        log.info("profiler_prepare_deferred", server=server,
                 note="this process may fork workers: each worker prepares its own profiler "
                      "when its monitor restarts after the fork")
        return
    if _IN_FORK_HOOK:
        _PREPARING = threading.Thread(target=_prepare, args=(log, internal), name="perfmon-profiler-prepare",
                                      daemon=True)
        _PREPARING.start()
        return
    _prepare(log, internal)


def _prepare(log: Any, internal: Any) -> None:
    global _PROFILER_PREPARED
    try:
        took = warm_up_profiler()
        _PROFILER_PREPARED = True
        log.info("profiler_ready", seconds=round(took, 3))
    except Exception as exc:
        internal.report("capture", exc)


def _before_fork() -> None:
    """Parent, just before fork(): say once that the profiler ran here and what children do about it."""
    global _WARNED_FORK
    if profiler_has_run() and not _WARNED_FORK and live:
        _WARNED_FORK = True
        for agent in list(live)[:1]:
            try:
                agent.log.info("fork_after_profiler", pid=os.getpid(),
                               note="torch.profiler ran in this process before fork(): each child's exit skips "
                                    "torch's C++ static destructors, which would hang or abort it")
            except Exception:  # pragma: no cover - never break a fork
                pass


def _exit_through_underscore_exit() -> None:
    """Python ``atexit``, in a guarded child: make ``exit()`` call ``_exit(status)`` before anything else.

    Registered at shutdown, so it is the last C exit handler registered and the first to run: after
    Python's finalisation, before the C++ static destructors torch registered in the parent.
    ``on_exit`` hands the handler (status, arg); ``_exit`` takes the status and ignores the rest.
    """
    try:
        libc = ctypes.CDLL(None)
        libc.fflush(None)  # C stdio buffers: _exit would not flush them
        libc.on_exit.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        libc.on_exit(ctypes.cast(libc._exit, ctypes.c_void_p), None)
    except (AttributeError, OSError):  # pragma: no cover - no glibc on_exit (musl, macOS): the torch limit stays
        pass


#: Where a fork starts a process that serves no model: a torch DataLoader's worker (it loads data for the parent).
_HELPER_FORKS = (os.path.join("torch", "utils", "data", "dataloader.py"),)


def forked_for(frame: Any, *, depth: int = 64) -> str | None:
    """The file of ``_HELPER_FORKS`` in whose code the stack from ``frame`` (the fork's caller's) is, or None.

    A DataLoader with workers forks from its iterator (``dataloader.py``, through ``multiprocessing``); its workers
    load data and never serve the model. Started in each, a monitor's agent ran threads, logged ``port_unavailable``
    at error level, retried the parent's port in the background and, once the parent stopped and started again,
    held it (a helper's trial: Prometheus then scraped a worker that had served nothing)."""
    while frame is not None and depth > 0:
        name = frame.f_code.co_filename
        found = next((h for h in _HELPER_FORKS if name.endswith(h)), None)
        if found is not None:
            return found
        frame, depth = frame.f_back, depth - 1
    return None


def _reinit_after_fork() -> None:
    global _FORKED, _PROFILER_PREPARED, _EXIT_GUARDED, _IN_FORK_HOOK, _PREPARING
    _FORKED = True
    _PROFILER_PREPARED = False  # the child's own Kineto state is not initialised by the parent's run
    _PREPARING = None  # a preparation the parent ran has no thread here
    reset_profiler_after_fork()
    if profiler_has_run() and not _EXIT_GUARDED and sys.platform.startswith("linux"):
        _EXIT_GUARDED = True  # a grandchild inherits this handler with the rest of the atexit list
        atexit.register(_exit_through_underscore_exit)
    # A helper's child (a DataLoader worker) keeps fresh agents, stopped: it counts, serves and retries nothing.
    try:
        restart = forked_for(sys._getframe(1)) is None
    except Exception:  # pragma: no cover - a fork with no Python caller: restart, as before
        restart = True
    _IN_FORK_HOOK = True  # what takes seconds goes to a thread (prepare_profiler)
    try:
        for agent in list(live):
            try:
                agent.after_fork_in_child(restart=restart)
            except Exception:  # pragma: no cover - never break the child process
                pass
    finally:
        _IN_FORK_HOOK = False


def _stop_at_exit() -> None:
    """Interpreter exit: stop running monitors (bounded joins, no capture left on, ports closed).

    A capture still recording here (its thread, which alone can stop the profiler, makes no further call) leaves
    torch's profiler on through the exit, and torch's C++ static destructors then crash the process (SIGSEGV,
    exit status 139, a core). So the exit then skips them as a guarded fork child's does (``_exit(status)`` after
    Python's finalisation): the status the program chose, its buffers flushed."""
    global _EXIT_GUARDED
    recording = False
    for agent in list(live):
        try:
            agent.stop()
            recording = recording or agent.captures.state == "recording"
        except Exception:  # pragma: no cover
            pass
    preparing = _PREPARING
    if preparing is not None:  # a worker told to exit as it booted: Kineto may be mid-start on that thread
        preparing.join(_PREPARE_EXIT_WAIT_SECONDS)
        recording = recording or preparing.is_alive()
    if recording and not _EXIT_GUARDED and sys.platform.startswith("linux"):
        _EXIT_GUARDED = True
        _exit_through_underscore_exit()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_child=_reinit_after_fork)
atexit.register(_stop_at_exit)
