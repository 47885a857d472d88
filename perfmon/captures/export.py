"""Exporting a finished capture (the export thread): stopped profiler in, stored trace and metadata out.

The export never builds torch's per-event Python objects in this process: the profiler writes its
Chrome trace (C++) to a private temp file and is dropped, and a child process
(``perfmon/captures/trace_summary.py``, run by path, at lower priority, address space capped, killed
after ``timeout_seconds``) streams the file, gzips it and returns the op summary; then this process
collects garbage and hands freed heap back to the OS (``rss.release_memory``). A child that fails or
is killed fails the capture; nothing partial is listed. A regression or manual capture of a model
that has a baseline is compared with it (``perfmon.captures.compare``).
"""

from __future__ import annotations

import collections
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..faults import InternalErrors
from ..selfcost import AgentCpu
from ..store.files import worker_name
from ..store.traces import TraceStore
from .compare import compare, headline, step_work
from .moved import add_ops
from .profiler import Profiler
from .records import COMPARED_TRIGGERS, TOP_OPS, Capture
from .roofline import Peaks, summarise
from .rss import release_memory

__all__ = ["EXPORT_MAX_MEMORY_BYTES", "Exported", "Exporter", "latest_baseline"]

#: Address-space cap of the export child (RLIMIT_AS). Measured: 52 MB peak RSS (VmHWM) and 1.9 s of
#: CPU for a 61 MB trace of 160,800 events (~90 bytes an event plus the interpreter); the cap leaves
#: room for ~5M events and stops a runaway well before it can hurt the pod.
EXPORT_MAX_MEMORY_BYTES = 512 * 2**20
_SUMMARY_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "trace_summary.py")


def latest_baseline(store: TraceStore, model: str, *, like: Mapping[str, Any] | None = None,
                    size_class: str | None = None) -> dict[str, Any] | None:
    """The stored metadata of ``model``'s newest baseline capture that finished ok with an op table,
    or None. Read from the trace store (retention keeps it), so it outlives this process; its
    ``ended_at`` (UTC ISO 8601) says when it was taken.

    ``size_class`` (a label): only a baseline taken for that size class or whose steps mostly ran it.
    ``like`` (a capture's metadata): the newest baseline of its size class when there is one, else the one
    nearest in work per step (compared per unit of work; ``compare.compare_basis``), else the newest."""
    baselines = [meta for meta in store.list()  # newest first
                 if meta.get("model") == model and meta.get("trigger") == "baseline" and meta.get("outcome") == "ok"
                 and meta.get("ops")]
    if size_class is not None:  # one taken for that class counts, whatever its few steps happened to run
        return next((meta for meta in baselines if size_class in (step_work(meta)[1], _reason(meta).get("size_class"))),
                    None)
    work, label = step_work(like) if like is not None else (None, None)
    if work is None or not baselines:
        return baselines[0] if baselines else None
    for meta in baselines:
        if step_work(meta)[1] == label:
            return meta
    sized = [(abs(math.log(w / work)), i) for i, meta in enumerate(baselines) if (w := step_work(meta)[0])]
    return baselines[min(sized)[1]] if sized else baselines[0]


def _reason(meta: Mapping[str, Any]) -> Mapping[str, Any]:
    reason = meta.get("reason")
    return reason if isinstance(reason, Mapping) else {}


@dataclass
class Exported:
    """What an export left: its outcome, the capture's tables and comparison, and the metadata stored."""

    outcome: str  # "ok" | "failed" | "aborted"
    error: str | None
    summary: list[dict[str, Any]]
    compute: dict[str, Any]
    ops: dict[str, dict[str, float]]
    steps: int
    comparison: dict[str, Any] | None
    stored: dict[str, Any]


#: Captures whose metadata the store could not keep, answered from memory (``Exporter.unstored``).
UNSTORED_KEPT = 16


class Exporter:
    """Writes a stopped capture's trace and metadata to the trace store, with its op summary."""

    def __init__(
        self,
        store: TraceStore,
        *,
        internal: InternalErrors,
        cpu: AgentCpu,
        peaks: Callable[[str], Peaks | None],
        timeout_seconds: float,
        max_memory_bytes: int,
    ) -> None:
        self.store = store
        self._internal = internal
        self._cpu = cpu
        self._peaks = peaks
        self.timeout = timeout_seconds
        self.max_memory = max_memory_bytes
        #: The last captures whose metadata the store could not keep (an unwritable or full trace_dir), newest
        #: first: still answered by id, with their error, where they were a 404 ("no such capture") once ended.
        self.unstored: collections.deque[dict[str, Any]] = collections.deque(maxlen=UNSTORED_KEPT)
        #: ``(baseline meta, this capture's meta) -> comparison``: ``captures.compare.compare`` (replaceable).
        self.compare: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]] = compare
        #: Called with each exported capture's stored metadata (export thread; a fault is counted), e.g. the
        #: occupancy view (stats/occupancy.py), which keeps each model's newest.
        self.listeners: list[Callable[[dict[str, Any]], None]] = []

    def export(self, cap: Capture, holder: list[Profiler], aborted: bool) -> Exported:
        """Export the profiler in ``holder`` (taken out of it) for ``cap``; never raises.

        The files are in place when this returns: the caller publishes the outcome after it, so a
        client that sees "ok" can download the trace at once.
        """
        t0 = time.monotonic()
        json_tmp = gz_tmp = None
        name = None
        outcome, error = ("aborted", cap.error) if aborted else ("ok", None)  # an abort's reason: a cancel's
        summary: list[dict[str, Any]] = []
        compute: dict[str, Any] = {}
        ops: dict[str, dict[str, float]] = {}
        top_ops: dict[str, dict[str, Any]] = {}
        steps = 0
        comparison: dict[str, Any] | None = None
        try:
            json_tmp, path = self.store.new_temp("json")
            prof = holder.pop()
            try:
                prof.export_chrome_trace(str(path))  # C++: Kineto writes the file itself
            finally:
                del prof  # the profiler's event buffers go with it
                release_memory()
            gz_tmp, _ = self.store.new_temp("gz")
            result = self._summarise_in_child(json_tmp, gz_tmp, device_time=cap.device.startswith("cuda"))
            self.store.remove_temp(json_tmp)
            json_tmp = None
            name = f"{worker_name()}.{time.time_ns()}.pt.trace.json.gz"
            # The window for achieved FLOP/s and MFU: the host's recording time, or the device's busy
            # span where that is longer (async CUDA work queued in the window runs on after it; with
            # the host window alone, MFU read 4.7 on an H100 for back-to-back matmuls).
            window = max(filter(None, (cap.duration_seconds, result.get("device_span_seconds"))), default=None)
            summary, compute = summarise(result["rows"], cuda=cap.device.startswith("cuda"),
                                         peaks=self._peaks(cap.device), window_seconds=window, limit=TOP_OPS)
            ops, steps = result.get("ops") or {}, int(result.get("steps") or 0)
            top_ops = result.get("top_ops") or {}
            cap.occupancy = result.get("occupancy")  # busy / span per step (CUDA kernels), or None
            cap.export = {"trace_events": result.get("events"), "child_cpu_seconds": result.get("cpu_seconds"),
                          "child_max_rss_bytes": result.get("max_rss_bytes")}
        except Exception as exc:
            self._internal.report("capture_export", exc)
            outcome, error = "failed", f"export failed: {type(exc).__name__}: {exc}"
            name = None
        finally:
            holder.clear()
            for tmp in (json_tmp, gz_tmp if name is None else None):
                if tmp is not None:
                    self.store.remove_temp(tmp)
        if outcome == "ok" and cap.trigger in COMPARED_TRIGGERS:
            comparison = self._compare(cap, ops, top_ops, steps)
        # The capture's dicts are rebound, never changed in place: a reader (monitor.profile, /profiles/{id}) may turn
        # the in-flight capture into a dict at any moment, and asdict() iterating a dict that gains a key raises
        # (a fresh clone's run: "dictionary changed size during iteration" in test_occupancy).
        moved = cap.reason.get("moved")
        if isinstance(moved, dict):  # a regression's "what moved": the ops part, now known
            moved = dict(moved)
            add_ops(moved, comparison, headline(comparison) if comparison else None)
            cap.reason = {**cap.reason, "moved": moved}
        cap.export = {**cap.export, "seconds": round(time.monotonic() - t0, 3)}
        final = {**cap.public(), "status": "done", "outcome": outcome, "error": error, "summary": summary,
                 "compute": compute, "ops": ops, "top_ops": top_ops, "steps": steps, "comparison": comparison}
        try:
            stored = self.store.save(final, None, name, trace_temp=gz_tmp if name is not None else None)
        except Exception as exc:  # disk full, unwritable directory: nothing partial is listed
            self._internal.report("trace_store", exc)
            outcome, error = "failed", f"store failed: {type(exc).__name__}: {exc}"
            stored = {**final, "outcome": outcome, "error": error, "summary": [], "compute": {}, "ops": {},
                      "top_ops": {}, "steps": 0, "comparison": None}
            summary, compute, ops, steps, comparison = [], {}, {}, 0, None
            if gz_tmp is not None:
                self.store.remove_temp(gz_tmp)
            try:
                self.store.save(stored, None, None)
            except Exception:
                self.unstored.appendleft(stored)
        release_memory(collect=False)  # the summary rows: trim only (a full collection costs ~0.2 s of GIL)
        for listener in self.listeners:
            try:
                listener(stored)
            except Exception as exc:
                self._internal.report("capture_listener", exc)
        return Exported(outcome, error, summary, compute, ops, steps, comparison, stored)

    def lost(self, capture_id: str) -> dict[str, Any] | None:
        """The metadata of a capture the store could not keep, if it is one of the last ``UNSTORED_KEPT``."""
        return next((dict(m) for m in list(self.unstored) if m.get("id") == capture_id), None)

    def _compare(self, cap: Capture, ops: dict[str, dict[str, float]], top_ops: dict[str, dict[str, Any]],
                 steps: int) -> dict[str, Any] | None:
        """``compare(baseline, this capture)`` with the baseline of this capture's size class (``latest_baseline``),
        or None without a baseline; never raises (a comparison that fails is reported as a ``capture_compare``
        internal error, the capture stands)."""
        try:
            meta = {**cap.public(), "ops": ops, "top_ops": top_ops, "steps": steps}
            base = latest_baseline(self.store, cap.model, like=meta)
            if base is None:
                return None
            return self.compare(base, meta)
        except Exception as exc:
            self._internal.report("capture_compare", exc)
            return None

    def _summarise_in_child(self, json_tmp: str, gz_tmp: str, *, device_time: bool = False) -> dict[str, Any]:
        """Run ``trace_summary.py`` on the temp trace in a child; returns its result or raises.

        A fresh interpreter (``subprocess``, never ``fork``: this process has threads and a profiler
        library loaded), isolated (``-I``), given the two files as inherited descriptors, so it never
        resolves a path in the trace directory itself.
        """
        src = self.store.open_temp(json_tmp, os.O_RDONLY)
        try:
            dst = self.store.open_temp(gz_tmp, os.O_WRONLY | os.O_TRUNC)
        except BaseException:
            os.close(src)
            raise
        try:
            cmd = [sys.executable, "-I", _SUMMARY_SCRIPT, "--in-fd", str(src), "--gz-fd", str(dst),
                   "--max-memory-bytes", str(int(self.max_memory))] + (["--device-time"] if device_time else [])
            child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     pass_fds=(src, dst), close_fds=True)
        finally:
            os.close(src)
            os.close(dst)
        try:
            out, err = child.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.communicate()
            raise TimeoutError(f"trace summary took over {self.timeout:g} s; child killed") from None
        if child.returncode != 0:
            last = err.decode(errors="replace").strip().splitlines()[-1:] or [f"exit status {child.returncode}"]
            raise RuntimeError(f"trace summary child failed (exit {child.returncode}): {last[0][:300]}")
        result: dict[str, Any] = json.loads(out)
        cpu = result.get("cpu_seconds")
        if isinstance(cpu, (int, float)):
            self._cpu.add("capture_export", float(cpu))
        return result
