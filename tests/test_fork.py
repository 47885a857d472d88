"""Fork safety and multi-worker ports: a monitor started before fork() works in the children."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

import perfmon

from .conftest import in_forked_child, wait_until

CALLS = {0: 11, 1: 17, 2: 23}


def _free_range(n: int) -> int:
    """A base port with ``n`` consecutive free ports after it (on 127.0.0.1)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65535:
            continue
        ok = True
        for p in range(base, base + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free port range")


def _scrape_calls(port: int, model: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for line in body.splitlines():
        if line.startswith(f'perfmon_forward_calls_total{{model="{model}",stage=""}}'):
            return float(line.split()[-1])
    raise AssertionError(f"no calls series on port {port}")


def _info_port(port: int) -> str:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    line = next(x for x in body.splitlines() if x.startswith("perfmon_info{"))
    return line.split('port="')[1].split('"')[0]


def _monitor(**kw) -> perfmon.Monitor:
    kw.setdefault("log_level", "error")
    kw.setdefault("regression", None)
    kw.setdefault("prepare_profiler", False)
    kw.setdefault("registry", CollectorRegistry())
    return perfmon.Monitor(**kw)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_raw_fork_child_gets_fresh_counts_its_own_port_and_threads(tmp_path) -> None:
    """After os.fork() the child counts only its own calls, serves on the next port, and the parent is unharmed."""
    base = _free_range(3)
    mon = _monitor(port=base, port_range=3, sample_rate=1.0, trace_dir=str(tmp_path)).start()
    model = mon.wrap(torch.nn.Linear(4, 4), name="m")
    for _ in range(5):
        model(torch.ones(1, 4))
    assert mon.url.endswith(f":{base}")
    def child_body() -> dict[str, Any]:
        for _ in range(7):
            model(torch.ones(2, 4))
        ok = mon.flush(timeout=5)
        port = int(mon.url.rsplit(":", 1)[1])
        result = {"flushed": ok, "port": port, "calls": _scrape_calls(port, "m"),
                  "info_port": _info_port(port), "items": mon.stats()["models"]["m"]["items"],
                  "threads": sorted(t.name for t in __import__("threading").enumerate())}
        mon.stop()
        return result

    child = in_forked_child(child_body)
    assert child["port"] == base + 1 and child["info_port"] == str(base + 1)
    assert child["calls"] == 7 and child["items"] == 14 and child["flushed"]
    assert "perfmon-resolver" in child["threads"] and "perfmon-http" in child["threads"]
    # the parent still serves and still has only its own calls
    assert _scrape_calls(base, "m") == 5 and _info_port(base) == str(base)
    model(torch.ones(1, 4))
    assert _scrape_calls(base, "m") == 6
    mon.stop()


def _worker(index: int, base: int, span: int, ready, done, preload: perfmon.Monitor | None, trace_dir: str) -> None:
    mon = preload if preload is not None else _monitor(port=base, port_range=span, trace_dir=trace_dir).start()
    model = mon._wrapped if preload is not None else mon.wrap(torch.nn.Linear(4, 4), name="m")
    for _ in range(CALLS[index]):
        model(torch.ones(1, 4))
    ready.put(int(mon.url.rsplit(":", 1)[1]))
    done.wait(30)  # stay up until the parent has scraped every worker
    mon.stop()


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_three_workers_each_reachable_once_and_nothing_double_counted(method: str, tmp_path) -> None:
    """Three worker processes take distinct ports of the range; their counts sum to the calls made."""
    ctx = mp.get_context(method)
    base = _free_range(5)
    preload = None
    if method == "fork":  # gunicorn --preload: the monitor starts, and the model runs, before fork
        preload = _monitor(port=base, port_range=5, trace_dir=str(tmp_path)).start()
        preload._wrapped = preload.wrap(torch.nn.Linear(4, 4), name="m")  # type: ignore[attr-defined]
        for _ in range(3):
            preload._wrapped(torch.ones(1, 4))  # type: ignore[attr-defined]
    ready, done = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_worker, args=(i, base, 5, ready, done, preload, str(tmp_path))) for i in range(3)]
    for p in procs:
        p.start()
    try:
        ports = sorted(ready.get(timeout=120) for _ in procs)
        assert len(set(ports)) == 3 and all(base <= p < base + 5 for p in ports)
        total = sum(_scrape_calls(p, "m") for p in ports)
        assert total == sum(CALLS.values())
        if preload is not None:
            assert base not in ports and _scrape_calls(base, "m") == 3  # the parent keeps its own port and calls
    finally:
        done.set()
        for p in procs:
            p.join(60)
        if preload is not None:
            preload.stop()
    assert all(p.exitcode == 0 for p in procs)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the exit guard uses glibc's on_exit")
@pytest.mark.parametrize("mode,code", [("prep", 0), ("prep-parentcap", 0), ("parentcap", 0), ("childcap", 0),
                                       ("prep-childcap", 0), ("prep-parentcap", 3)])
def test_forked_child_exits_promptly_with_its_status_after_the_profiler_ran(mode: str, code: int) -> None:
    """A raw fork after the profiler ran (prepared at start, a capture in the parent, in the child, or both):
    the child leaving through sys.exit used to hang (>30 s) or abort (SIGABRT). It exits at once with its
    own status, and what it printed is not lost."""
    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERFMON_")}
    env["PYTHONPATH"] = str(root)
    out = subprocess.run([sys.executable, "-m", "tests.apps.fork_exit", mode, str(code)], cwd=root, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    exit_line = next((line for line in lines if line.startswith("child-")
                      and line.split()[0] in ("child-exit", "child-hung")), None)
    assert exit_line is not None and exit_line.startswith("child-exit"), (out.stdout, out.stderr[-2000:])
    status, seconds = int(exit_line.split()[1]), float(exit_line.split()[2])
    assert status == code, (out.stdout, out.stderr[-2000:])
    assert seconds < 20, exit_line  # a hang is >30 s (killed); a prompt exit is ~1 s (the child's capture included)
    assert "child-done" in lines
    if "childcap" in mode:
        assert "child-capture ok" in lines
    if "parentcap" in mode:
        assert "parent-capture ok" in lines


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_childs_dozing_resolver_is_woken_by_its_own_readers_and_records(tmp_path) -> None:
    """The wakes that end a doze reach the child's own resolver (a fork replaces the hub's event): its status-page
    reader starts the history points, and its first timed call is resolved at once, while it dozes for an hour."""
    mon = _monitor(port=None, sample_rate=1.0, sample_floor_seconds=3600, trace_dir=str(tmp_path)).start()
    model = mon.wrap(torch.nn.Linear(4, 4), name="m")
    model(torch.ones(1, 4))
    mon.resolver.doze.seconds = 3600.0

    def child_body() -> dict[str, Any]:
        wait_until(lambda: mon.resolver.doze.dozing, timeout=20, what="the child's resolver dozing")
        mon.resolver.idle_seconds = 0.05
        mon.stats()  # someone starts looking: the history's wake
        wait_until(lambda: mon.history.series()["models"].get("m"), timeout=20, what="the child's history point")
        mon.resolver.idle_seconds = 3600.0  # from here only the record's own wake ends a sleep
        wait_until(lambda: mon.resolver.doze.dozing, timeout=20, what="the child's resolver dozing again")
        before = mon.resolver.pending
        model(torch.ones(1, 4))
        wait_until(lambda: not mon.resolver.pending, timeout=20, what="the child's timed call resolved")
        mon.stop()
        return {"before": before}

    assert in_forked_child(child_body) == {"before": 0}  # each wait above raises in the child, which then exits 1
    mon.stop()


_DATA_LOADER_WORKERS = """
import json, os, socket, threading, urllib.request
import torch
from prometheus_client import CollectorRegistry
from torch.utils.data import DataLoader, Dataset
import perfmon

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
mon = perfmon.Monitor(port=port, host="127.0.0.1", registry=CollectorRegistry(), log_level="error",
                      prepare_profiler=False, count_flops=False).start()
model = mon.wrap(torch.nn.Linear(4, 4), name="lin")
url = mon.url


class Rows(Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):  # in a worker: what its copy of the monitor does (no torch op: a fork's OpenMP)
        return (os.getpid(), mon.running, sum(t.name.startswith("perfmon") for t in threading.enumerate()), mon.url)


loader = DataLoader(Rows(), batch_size=2, num_workers=2, multiprocessing_context="fork", collate_fn=list,
                    persistent_workers=True)
rows = [row for batch in loader for row in batch]
with torch.no_grad():
    model(torch.ones(1, 4))
mon.stop()
mon.start()  # the port is free a moment: a worker retrying it in the background took it
rows += [row for batch in loader for row in batch]
with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
    served = "perfmon_forward_calls_total" in r.read().decode()
print(json.dumps({"workers": sorted({r[0] for r in rows}), "parent": os.getpid(),
                  "worker_running": any(r[1] for r in rows), "worker_threads": max(r[2] for r in rows),
                  "worker_urls": sorted({str(r[3]) for r in rows}), "same_url": mon.url == url, "served": served}))
mon.stop()
"""


def test_data_loader_workers_start_no_agent_and_leave_the_port_to_the_parent() -> None:
    """A torch DataLoader's forked workers load data and serve no model: the monitor the parent runs is reset in
    each but not started (it ran threads, logged ``port_unavailable`` at error level and retried the parent's port
    in the background, taking it once the parent stopped and started again), so the parent keeps its port."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    done = subprocess.run([sys.executable, "-c", _DATA_LOADER_WORKERS], capture_output=True, text=True, timeout=180,
                          env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    got = __import__("json").loads(done.stdout.strip().splitlines()[-1])
    assert len(got["workers"]) == 2 and got["parent"] not in got["workers"]  # the rows came from forked workers
    assert (got["worker_running"], got["worker_threads"], got["worker_urls"]) == (False, 0, ["None"])
    assert got["same_url"] and got["served"]
    assert "port_unavailable" not in done.stdout + done.stderr


_FORK_WHILE_RECORDING = r"""
import json, threading, time, torch, perfmon
from torch.utils.data import DataLoader, TensorDataset
torch.set_num_threads(1)
mon = perfmon.Monitor(port=None, count_flops=False, trace_dir=%r, log_level="error").start()
model = mon.wrap(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)), name="enc")
stop = threading.Event()
def serve():
    deadline = time.monotonic() + 60
    with torch.inference_mode():
        while not stop.is_set() and time.monotonic() < deadline:
            model(torch.randn(2, 16))
            stop.wait(0.02)  # ~50 calls a second: the capture's 100 steps outlast the workers' fork
t = threading.Thread(target=serve, daemon=True)
t.start()
loader = DataLoader(TensorDataset(torch.randn(64, 16)), batch_size=8, num_workers=2, timeout=60)
mon.capture("enc", steps=100, max_seconds=30)
deadline = time.monotonic() + 30
while mon.captures.state != "recording" and time.monotonic() < deadline:
    time.sleep(0.001)
batches = iter(loader)  # two workers forked while the serving thread records
state_at_fork = mon.captures.state
batches = sum(1 for _ in batches)
deadline = time.monotonic() + 60
while mon.captures.state != "idle" and time.monotonic() < deadline:
    time.sleep(0.01)
stop.set()
t.join(60)
done = mon.profiles()[0]
print(json.dumps({"at_fork": state_at_fork, "batches": batches, "outcome": done["outcome"],
                  "ended_by": done["ended_by"]}))
mon.close()
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_workers_forked_while_a_capture_records_on_another_thread_live(tmp_path: Path) -> None:
    """A DataLoader's workers forked while a capture records on the serving thread: each child clears the (absent)
    owner thread's locals inside os.fork(), and the recording's end-of-thread finaliser used to stop the parent's
    profiler there and start an export mid-fork: every worker died of SIGSEGV (5 of 5). Now the finaliser leaves a
    child alone, the workers load every batch, and the parent's capture records on and ends as asked."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    done = subprocess.run([sys.executable, "-c", _FORK_WHILE_RECORDING % str(tmp_path)], capture_output=True,
                          text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    got = __import__("json").loads(done.stdout.strip().splitlines()[-1])
    assert got == {"at_fork": "recording", "batches": 8, "outcome": "ok", "ended_by": "steps"}, got
