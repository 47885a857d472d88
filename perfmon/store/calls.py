"""Calls to an object store that end by a deadline, and the CPU of fsspec's IO thread (the uploader's cost).

``StoreCalls`` bounds each fsspec call whatever its SDK does; ``io_thread_cpu`` reads the CPU seconds of the
one thread on which every async fsspec filesystem (s3fs, gcsfs, adlfs) runs its requests, so the uploader can
count them as its own (``uploader.TraceUploader``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from ..exceptions import ConfigError
from ..selfcost import AgentCpu

__all__ = ["StoreCalls", "count_io", "io_thread_cpu"]


class StoreCalls:
    """Calls to an fsspec filesystem that end by a deadline whatever the SDK does: its timeouts bound a connect
    and a read, not a request (s3fs's PUT, ``Expect: 100-continue``, to an endpoint that accepts and never
    answers ran on past 60 s with 5 s set). An async filesystem's call (s3fs, gcsfs, adlfs) is a task on its
    loop, cancelled at the deadline, which closes its connection (measured there: within 1 ms). Any other's
    runs on a thread of its own, which cannot be stopped: while ``max_abandoned`` such calls run on past
    their deadline (each holds a connection and a body), a new call fails at once instead of starting.
    """

    def __init__(self, *, max_abandoned: int, cpu: AgentCpu) -> None:
        if max_abandoned < 1:
            raise ConfigError(f"max_abandoned_calls must be >= 1, got {max_abandoned!r}")
        self.max_abandoned = max_abandoned
        self._cpu = cpu
        self._abandoned: list[threading.Event] = []  # one per call given up, set when it has ended

    def abandoned(self) -> int:
        """Calls given up at their deadline that are still running."""
        self._abandoned = [ended for ended in self._abandoned if not ended.is_set()]
        return len(self._abandoned)

    def call(self, fs: Any, method: str, *args: Any, deadline: float, **kwargs: Any) -> Any:
        """``fs.<method>(*args, **kwargs)``, or ``TimeoutError`` when it has not returned by ``deadline``
        (``time.monotonic()`` seconds), or at once when ``max_abandoned`` calls are still running."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the store did not answer within the attempt's deadline")
        if self.abandoned() >= self.max_abandoned:
            raise TimeoutError(f"{len(self._abandoned)} earlier calls to the store are still running past their "
                               "deadline; none is started until one ends")
        ended = threading.Event()
        coroutine = getattr(fs, f"_{method}", None) if getattr(fs, "async_impl", False) else None
        loop = getattr(fs, "loop", None)
        future: concurrent.futures.Future[Any]
        if coroutine is not None and isinstance(loop, asyncio.AbstractEventLoop) and loop.is_running():
            async def run() -> Any:
                try:
                    return await coroutine(*args, **kwargs)
                finally:
                    ended.set()

            future = asyncio.run_coroutine_threadsafe(run(), loop)
        else:
            future = concurrent.futures.Future()
            threading.Thread(target=self._run, args=(future, ended, getattr(fs, method), args, kwargs),
                             name="perfmon-trace-upload-call", daemon=True).start()
        done, _ = concurrent.futures.wait([future], timeout=left)
        if not done:
            future.cancel()  # a task: cancelled on its loop; a thread's call runs on (cancel is a no-op)
            if not ended.is_set():
                self._abandoned.append(ended)
            raise TimeoutError(f"the store did not answer within {left:.1f} s; the call was abandoned")
        return future.result()

    def _run(self, future: concurrent.futures.Future[Any], ended: threading.Event, fn: Callable[..., Any],
             args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        try:
            if future.set_running_or_notify_cancel():  # False: given up before this thread ran
                with self._cpu.measure("upload"):  # a sync store's requests are the upload's cost
                    future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # handed to the waiting thread, raised there
            future.set_exception(exc)
        finally:
            ended.set()


def io_thread_cpu() -> float | None:
    """CPU seconds (user + system) of fsspec's shared IO thread, or None (no async filesystem used yet,
    not Linux, unreadable). Read from ``/proc/self/task/<tid>/stat`` (10 ms ticks): a file read, safe
    whatever the thread's state, where a pthread CPU clock of a thread that is gone is undefined behaviour."""
    try:
        asyn = sys.modules.get("fsspec.asyn")
        thread = getattr(asyn, "iothread", [None])[0] if asyn is not None else None
        tid = getattr(thread, "native_id", None)
    except (TypeError, IndexError, AttributeError):  # a future fsspec with another shape: count nothing
        return None
    if not isinstance(tid, int):
        return None
    try:
        with open(f"/proc/self/task/{tid}/stat", "rb") as f:
            stat_line = f.read()
        # Fields after the parenthesised name (which may hold spaces): state is field 3, utime 14, stime 15.
        fields = stat_line.rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
    except (OSError, IndexError, ValueError):
        return None


def _clock_ticks() -> float:
    """Clock ticks per second of /proc's CPU times (100 on Linux)."""
    try:
        return float(os.sysconf("SC_CLK_TCK"))
    except (AttributeError, ValueError, OSError):
        return 100.0


_CLOCK_TICKS = _clock_ticks()


def count_io(cpu: AgentCpu, before: float | None) -> None:
    """Add what fsspec's IO thread spent since ``before`` (``io_thread_cpu()`` then) to ``thread="upload"``: async
    filesystems (s3fs, gcsfs, adlfs) run their requests, TLS and signing there, not on the upload thread. The
    thread is shared, so other fsspec work of the process in that interval counts too (rare in a model server).
    Created during the attempt (``before`` None): all of its CPU is this attempt's."""
    after = io_thread_cpu()
    if after is not None:
        cpu.add("upload", max(0.0, after - (before or 0.0)))
