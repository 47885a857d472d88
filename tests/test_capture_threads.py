"""Which thread a capture belongs to: a thread ident is not a thread, and a thread can end mid-capture.

The profiler must be stopped on the OS thread that started it. A thread-per-request server's next thread
often reuses the ident of the one that just ended; a capture must neither step nor stop on it. When the
capturing thread ends, the capture ends with it (on it), exports, and leaves no profiler running.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from perfmon.captures.profiler import profiler_active

from .conftest import wait_until


def _one_call_thread(model: torch.nn.Module) -> int:
    """One model call on a new thread, joined; returns the thread's ident."""
    seen: list[int] = []

    def run() -> None:
        seen.append(threading.get_ident())
        with torch.inference_mode():
            model(torch.ones(2, 8))

    t = threading.Thread(target=run)
    t.start()
    t.join(timeout=30)
    assert not t.is_alive()
    return seen[0]


def test_a_capture_ends_with_its_thread_and_the_next_thread_with_its_ident_is_not_recorded(make_monitor) -> None:
    mon = make_monitor().start()
    model = mon.wrap(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()), name="m")
    cap = mon.capture("m", steps=5, max_seconds=30)
    idents = [_one_call_thread(model) for _ in range(6)]
    assert len(set(idents)) < len(idents), "the test needs an ident reused (glibc reuses a joined thread's stack)"
    meta = wait_until(lambda: (p := mon.profile(cap["id"])) and p.get("status") == "done" and p, timeout=60,
                      what="the capture to finish")
    # Ended when its one-call thread did: one step, never stepped (or stopped) on a thread reusing the ident.
    assert meta["outcome"] == "ok", meta
    assert meta["ended_by"] == "thread_ended" and meta["steps_recorded"] == 1
    _, data = mon.read_trace(cap["id"])
    events = json.loads(gzip.decompress(data))["traceEvents"]
    assert sum(e.get("name") == "aten::linear" for e in events) == 1  # the one recorded call
    assert not profiler_active()  # no flag left on: a new capture, from any monitor, may start
    again = mon.capture("m", steps=1)
    _one_call_thread(model)
    wait_until(lambda: (p := mon.profile(again["id"])) and p.get("outcome") == "ok", timeout=60,
               what="a second capture")


def test_stop_after_the_capturing_thread_ended_leaves_nothing_recording(make_monitor, tmp_path: Path) -> None:
    mon = make_monitor().start()
    model = mon.wrap(torch.nn.Linear(8, 8), name="m")
    cap = mon.capture("m", steps=5, max_seconds=30)
    _one_call_thread(model)
    mon.stop()  # waits (bounded) for the export
    meta = mon.profile(cap["id"])
    assert meta is not None and meta["status"] == "done" and meta["outcome"] == "ok", meta
    assert mon.captures.state == "idle"
    assert not profiler_active()
    # Another monitor in the same process is not refused as busy.
    other = make_monitor().start()
    other_model = other.wrap(torch.nn.Linear(8, 8), name="n")
    second = other.capture("n", steps=1)
    _one_call_thread(other_model)
    wait_until(lambda: (p := other.profile(second["id"])) and p.get("outcome") == "ok", timeout=60,
               what="the other monitor's capture")


def test_a_long_lived_thread_keeps_its_capture_across_calls(make_monitor) -> None:
    """A pool thread records all its steps; other threads' calls in between are neither recorded nor stop it."""
    mon = make_monitor().start()
    model = mon.wrap(torch.nn.Linear(8, 8), name="m")
    cap = mon.capture("m", steps=3, max_seconds=30)
    called, go = threading.Semaphore(0), threading.Semaphore(0)

    def worker() -> None:
        with torch.inference_mode():
            for _ in range(3):
                model(torch.ones(1, 8))
                called.release()
                go.acquire(timeout=30)

    t = threading.Thread(target=worker)
    t.start()
    for _ in range(3):
        assert called.acquire(timeout=30)
        _one_call_thread(model)  # another thread, meanwhile
        go.release()
    t.join(timeout=30)
    meta = wait_until(lambda: (p := mon.profile(cap["id"])) and p.get("status") == "done" and p, timeout=60,
                      what="the capture to finish")
    assert meta["ended_by"] == "steps" and meta["steps_recorded"] == 3, meta


_EXIT_WHILE_RECORDING = """
import sys, torch, perfmon
mon = perfmon.Monitor(port=None, prepare_profiler=False, log_level="error", regression=None,
                      trace_dir=sys.argv[1]).start()
model = mon.wrap(torch.nn.Linear(2, 2), name="lin")
model(torch.randn(1, 2))
mon.capture("lin", steps=50, max_seconds=60)
model(torch.randn(1, 2))
print("state", mon.captures.state, flush=False)  # flushed by the exit, as any program's buffered output
sys.exit(3)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the exit guard is glibc's on_exit")
def test_a_process_exiting_while_a_capture_records_exits_with_its_own_status(tmp_path: Path) -> None:
    """The capturing thread made its last call mid-capture and the program exits: the profiler, which only that
    thread can stop, is still on, and torch's C++ static destructors crashed the exit (SIGSEGV, status 139).
    The exit now skips them: the program's own status, its output flushed."""
    done = subprocess.run([sys.executable, "-c", _EXIT_WHILE_RECORDING, str(tmp_path)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.stdout.strip() == "state recording", done
    assert done.returncode == 3, (done.returncode, done.stderr[-2000:])
