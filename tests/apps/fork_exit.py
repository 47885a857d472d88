"""A monitor started, then a raw ``os.fork()``: the child uses the model and leaves through ``sys.exit``.

``python -m tests.apps.fork_exit MODE CODE``: MODE holds ``prep`` (prepare_profiler=True, the default),
``parentcap`` (a capture in the parent before the fork), ``childcap`` (a capture in the child). The child
prints a line (left in stdio's buffer: it must still come out) and exits with CODE; the parent prints
``child-exit <status> <seconds>`` (or ``child-hung``) and exits 0.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import torch

import perfmon


def main() -> None:
    mode, code = sys.argv[1], int(sys.argv[2])
    mon = perfmon.Monitor(port=None, regression=None, prepare_profiler="prep" in mode, log_level="error",
                          trace_dir=tempfile.mkdtemp(prefix="perfmon-fork-")).start()
    model = mon.wrap(torch.nn.Linear(8, 8), name="m")
    x = torch.ones(2, 8)

    def capture() -> str:
        cap = mon.capture("m", steps=1)
        model(x)
        for _ in range(1200):  # bounded: 60 s
            meta = mon.profile(cap["id"])
            if meta and meta.get("status") == "done":
                return str(meta["outcome"])
            time.sleep(0.05)
        return "unfinished"

    for _ in range(3):
        model(x)
    if "parentcap" in mode:
        print("parent-capture", capture(), flush=True)
    pid = os.fork()
    if pid == 0:
        for _ in range(3):
            model(x)
        if "childcap" in mode:
            print("child-capture", capture())
        print("child-done")  # not flushed: Python's shutdown must still write it
        sys.exit(code)
    t0 = time.monotonic()
    for _ in range(600):  # bounded: 30 s
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            print("child-exit", os.waitstatus_to_exitcode(status), round(time.monotonic() - t0, 2), flush=True)
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        print("child-hung", flush=True)
    mon.stop()


if __name__ == "__main__":
    main()
