# One file, over 500 lines: the export runs it by path in a child (``python -I trace_summary.py``), standard
# library only, so it cannot import a sibling module of the package (that would need a sys.path dance there).
"""A capture's op summary from its Chrome trace, streamed; run in a child process by the exporter.

The trace is read once, in chunks: each chunk is gzipped to the output file and fed to a JSON
decoder that takes one event at a time (``raw_decode``), so memory holds a chunk, a few numbers per
event and one row per (op, input shapes) — never the whole trace or a Python object per event.
This replaces ``prof.events()``, which built a FunctionEvent per event in the serving process
(measured: gigabytes and tens of seconds of GIL for 100 steps of a 200-layer MLP).

Rows carry what ``perfmon.captures.roofline.aggregate`` builds from FunctionEvents, computed the same
way from the trace's own fields:

* times from each op's ``dur`` (µs); self time is the duration minus that of the ops nested in it on
  the same thread (the interval nesting of ``EventList._populate_cpu_children``);
* device time from the kernels, copies and memsets whose ``External id`` is the op's (the op that
  launched them); an op's total adds the device time of the ops nested in it;
* the device's busy span, first kernel (or copy, memset) start to last end: the host queues work and
  returns, so on CUDA the device may still be running the window's kernels after the host stopped;
* input shapes and dtypes from ``Input Dims`` / ``Input type``;
* FLOPs from the shapes, with the formulas of torch's ``computeFlops`` (torch/csrc/profiler/util.cpp)
  for the ops it counts (conv2d, mm, addmm, bmm, baddbmm, mul, add); the Chrome trace does not carry
  the FLOPs torch computed.

Besides the rows, a per-op table fit for diffing two captures (``step_table``): per op *name* (shapes
move with traffic), its self time and calls in each recorded step, as mean and spread over steps. The
capture controller wraps every recorded model call in a ``perfmon.step`` annotation; an op belongs to
the step whose annotation encloses it on the same thread (the parent chain of the interval nesting
above), and a kernel to its op through ``External id``, so a kernel that runs after the host left the
step still counts for it. Ops outside every step (another thread's, the profiler's own start) are left
out of the table; the annotation itself is left out of the rows, which read as they did without it.

On a CUDA trace, the device's occupancy per step (``step_occupancy``): the union of the step's kernel, copy
and memset intervals (busy) over the step's device span as perfmon's event pair measures it, from the step's
start (or the end of the previous steps' device work, when the device was still on it) to the later of the
step's end and its last kernel's end. A kernel belongs to a step through its ``correlation`` (the runtime call
that launched it, nested in the step on its thread: CUDA graph replays too) or else its op's ``External id``.

Standard library only, and started as a script (``python -I trace_summary.py``), not as
``-m perfmon...``: importing the package would import torch. The child lowers its priority and
caps its own address space before reading. Output: one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import array
import codecs
import gzip
import json
import math
import os
import re
import statistics
import sys
from collections.abc import Callable, Iterator
from typing import IO, Any

#: Event categories that are host-side (CPU) FunctionEvents in ``prof.events()``.
HOST_CATEGORIES = frozenset({"cpu_op", "user_annotation", "cuda_runtime", "cuda_driver", "python_function"})
#: Categories whose events carry an op's own ``External id`` (runtime calls share their op's).
OWN_ID_CATEGORIES = frozenset({"cpu_op", "user_annotation"})
#: Device activity attributed to the op that launched it.
DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
CHUNK_BYTES = 1 << 20
#: The ``record_function`` name the capture controller wraps each recorded model call in.
STEP_ANNOTATION = "perfmon.step"
#: The per-step op table keeps this many op names (by total self time); the rest is summed as ``[other]``.
STEP_TABLE_OPS = 200
#: The top-level table keeps this many names, and each of its entries this many ops of its breakdown.
TOP_TABLE_OPS = 50
BREAKDOWN_OPS = 8
OTHER = "[other]"

Row = dict[str, Any]


def _numel(dims: Any) -> int:
    return math.prod(int(d) for d in dims)


def _is_tensor(types: list[Any], i: int) -> bool:
    return i < len(types) and types[i] not in ("Scalar", "ScalarList", "", None, "GenericList", "TensorList")


def tensor_dtypes(types: Any) -> set[str]:
    """The dtype names of an op's tensor inputs: its ``Input type`` list less the non-tensor entries
    (torch 2.11 lists ``Scalar``/``ScalarList`` there, 2.13 an empty string)."""
    types = list(types or ())
    return {str(t) for i, t in enumerate(types) if _is_tensor(types, i)}


def _int_list(text: Any) -> list[int] | None:
    try:
        value = json.loads(text) if isinstance(text, str) else text
    except ValueError:
        return None
    if isinstance(value, int):
        return [value]
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return value
    return None


def flops(name: str, dims: list[Any], types: list[Any], concrete: list[Any]) -> int:
    """torch's ``computeFlops`` for one op call, from its trace fields; 0 for ops torch does not count."""
    try:
        if name in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"):
            first = 1 if name in ("aten::addmm", "aten::baddbmm") else 0
            if not (_is_tensor(types, first) and _is_tensor(types, first + 1)):
                return 0
            m1, m2 = dims[first], dims[first + 1]
            if not m1 or not m1[-1]:
                return 0
            total = _numel(m1) // int(m1[-1])
            if name in ("aten::bmm", "aten::baddbmm"):
                if not m1[0]:
                    return 0
                total //= int(m1[0])
            return int(2 * total * _numel(m2))
        if name in ("aten::mul", "aten::add"):
            return _numel(dims[0]) if _is_tensor(types, 0) else 0
        if name == "aten::conv2d":
            x, w = dims[0], dims[1]
            stride, padding, dilation = (_int_list(concrete[i]) for i in (3, 4, 5))
            groups = _int_list(concrete[6])
            if len(x) != 4 or len(w) != 4 or not groups or not groups[0]:
                return 0
            if not stride or not padding or not dilation or len(stride) != 2 or stride[0] * stride[1] == 0:
                return 0
            if len(padding) != 2 or len(dilation) != 2:
                return 0
            out_h = (x[2] + 2 * padding[0] - dilation[0] * (w[2] - 1) - 1) // stride[0] + 1
            out_w = (x[3] + 2 * padding[1] - dilation[1] * (w[3] - 1) - 1) // stride[1] + 1
            return int(2 * x[0] * out_h * out_w * w[2] * w[3] * x[1] * w[0] // groups[0])
    except (IndexError, TypeError, ValueError):
        return 0
    return 0


#: torch's Chrome trace writer does not escape quotes in op and annotation names
#: (``record_function('a "b"')`` gives ``"name": "a "b"",``), which makes the whole file invalid JSON.
#: A chunk is suspect (checked in C) when a quote inside a ``"name"`` value is followed by something
#: other than what ends a value; only then are its names rewritten. A name's value ends at the first
#: quote followed by ``, "key":`` or the end of the line (Kineto's layouts: a field a line in torch
#: 2.13, several a line in others; a name is never an event's last field), and never spans another
#: ``"name"``. A name that itself holds ``", "key":`` stays ambiguous: torch wrote valid JSON for it.
_SUSPECT = re.compile(rb'"name": "[^"\n]*"[^,\r\n]')
_NAME = re.compile(rb'"name": "((?:(?!"name": ").)*?)"(?=[ \t]*(?:,[ \t]*"[A-Za-z_ ]+"[ \t]*:|,?[ \t]*\r?$))', re.M)
_BARE_QUOTE = re.compile(rb'(?<!\\)"')


def _escape_name(m: re.Match[bytes]) -> bytes:
    inner = m.group(1)
    if b'"' not in inner.replace(b'\\"', b""):
        return m.group(0)  # no bare quote: left byte for byte
    return b'"name": "' + _BARE_QUOTE.sub(b'\\"', inner) + b'"'


def repairing(read: Callable[[int], bytes]) -> Callable[[int], bytes]:
    """``read`` that returns whole lines, with unescaped quotes inside ``"name"`` values escaped.

    Only lines that need it are rewritten (a chunk is scanned by one regular expression first), so a
    valid trace passes through byte for byte, and the gzipped copy of a broken one loads in Perfetto.
    """
    pending = b""
    eof = False

    def read_lines(n: int) -> bytes:
        nonlocal pending, eof
        while not eof:
            chunk = read(n)
            if not chunk:
                eof = True
                break
            pending += chunk
            cut = pending.rfind(b"\n")
            if cut < 0 and len(pending) > 4 * CHUNK_BYTES:
                out, pending = pending, b""  # no lines (not Kineto's layout): passed through, memory bounded
                return out
            if cut >= 0:
                out, pending = pending[:cut + 1], pending[cut + 1:]
                return _NAME.sub(_escape_name, out) if _SUSPECT.search(out) else out
        out, pending = pending, b""
        return _NAME.sub(_escape_name, out) if _SUSPECT.search(out) else out

    return read_lines


def iter_events(read: Callable[[int], bytes], on_chunk: Callable[[bytes], None] | None = None
                ) -> Iterator[dict[str, Any]]:
    """The objects of the trace's ``traceEvents`` array, one at a time, reading ``CHUNK_BYTES`` at a time.

    ``on_chunk`` sees every byte read (the gzip writer); the rest of the file is read through to the
    end after the array so that it gets them all.
    """
    read = repairing(read)
    decoder = json.JSONDecoder()
    text = codecs.getincrementaldecoder("utf-8")()
    buf = ""
    eof = False

    def more() -> bool:
        nonlocal buf, eof
        if eof:
            return False
        chunk = read(CHUNK_BYTES)
        if on_chunk is not None and chunk:
            on_chunk(chunk)
        eof = not chunk
        buf += text.decode(chunk, final=eof)
        return True

    # Find the array: everything before it (schema, device properties) is small.
    while True:
        at = buf.find('"traceEvents"')
        if at >= 0:
            bracket = buf.find("[", at)
            if bracket >= 0:
                pos = bracket + 1
                break
        if not more():
            raise ValueError("no traceEvents array in the trace")
    while True:
        n = len(buf)
        while pos < n and buf[pos] in " \t\r\n,":
            pos += 1
        if pos >= n:
            buf, pos = "", 0
            if not more():
                raise ValueError("trace ends inside traceEvents")
            continue
        if buf[pos] == "]":
            break
        try:
            event, end = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError:
            buf, pos = buf[pos:], 0
            if not more():
                raise
            continue
        pos = end
        if isinstance(event, dict):
            yield event
        if pos > CHUNK_BYTES:  # drop what has been decoded, keep memory at about a chunk
            buf, pos = buf[pos:], 0
    while more():  # the trailer (traceName...): read for the gzip copy, not parsed
        buf = ""


class _Thread:
    """One thread's host events, a few numbers each (arrays, not objects: a trace can hold millions)."""

    __slots__ = ("bytes", "corrs", "ends", "exts", "flops", "keys", "py", "starts")

    def __init__(self) -> None:
        self.py = bytearray()  # 1 for a Python frame (``python_function``, with_stack): not an op the user called
        self.starts = array.array("d")
        self.ends = array.array("d")
        self.keys = array.array("q")
        self.exts = array.array("q")
        self.corrs = array.array("q")  # a runtime call's ``correlation`` (its kernels carry the same), else -1
        self.flops = array.array("q")
        self.bytes = array.array("q")


class _Steps:
    """What each recorded step (one model call) spent: per op name its self seconds (``leaf``), per
    top-level op its total seconds (``top``: the ops the model's own code called, their children's time
    folded in) and, per top-level op, the self seconds of each op inside it (``under``)."""

    def __init__(self, starts: dict[Any, list[float]]) -> None:
        # Steps are numbered in start order over all threads (a capture records one thread).
        ordered = sorted(((ts, tkey) for tkey, tss in starts.items() for ts in tss), key=lambda p: p[0])
        self.number = {(tkey, ts): i for i, (ts, tkey) in enumerate(ordered)}
        self.count = len(ordered)
        self.leaf = _PerStep(self.count)
        self.top = _PerStep(self.count)
        self.under: dict[str, _PerStep] = {}
        #: Which step launched a kernel: by the runtime call's correlation id, by the op's External id.
        self.by_corr: dict[int, int] = {}
        self.by_ext: dict[int, int] = {}
        #: step -> (start, end) of its annotation on the host (µs).
        self.bounds: dict[int, tuple[float, float]] = {}

    def add_under(self, top: str, name: str, step: int, cpu_us: float, device_us: float) -> None:
        per = self.under.get(top)
        if per is None:
            per = self.under[top] = _PerStep(self.count)
        per.add(name, step, cpu_us, device_us)


class _PerStep:
    """Seconds (host and device) and calls per name and step."""

    __slots__ = ("calls", "count", "cpu", "device")

    def __init__(self, count: int) -> None:
        self.count = count
        self.cpu: dict[str, array.array[float]] = {}
        self.device: dict[str, array.array[float]] = {}
        self.calls: dict[str, array.array[int]] = {}

    def add(self, name: str, step: int, cpu_us: float, device_us: float) -> None:
        cpu = self.cpu.get(name)
        if cpu is None:
            zeros = bytes(8 * self.count)
            cpu = self.cpu[name] = array.array("d", zeros)
            self.device[name] = array.array("d", zeros)
            self.calls[name] = array.array("q", zeros)
        cpu[step] += cpu_us / 1e6
        self.device[name][step] += device_us / 1e6
        self.calls[name][step] += 1


class _Kernels:
    """Every kernel, copy and memset: its interval (µs) and what launched it (arrays: a trace holds millions)."""

    __slots__ = ("corrs", "ends", "exts", "starts")

    def __init__(self) -> None:
        self.starts = array.array("d")
        self.ends = array.array("d")
        self.corrs = array.array("q")
        self.exts = array.array("q")

    def add(self, ts: float, dur: float, args: dict[str, Any]) -> None:
        corr, ext = args.get("correlation"), args.get("External id")
        self.starts.append(ts)
        self.ends.append(ts + dur)
        self.corrs.append(corr if isinstance(corr, int) else -1)
        self.exts.append(ext if isinstance(ext, int) else -1)


def step_occupancy(kernels: _Kernels, steps: _Steps) -> dict[str, Any] | None:
    """The device's occupancy in the recorded steps: busy (the union of a step's device intervals) over the
    step's device span, which is what perfmon's event pair around the call measures: from the step's start, or
    the end of earlier steps' device work when the device was still on it (the start event waits for it), to
    the later of the step's end and its last kernel's end. Summed over the steps used (the first left out when
    there are two or more, as in ``step_table``); times in seconds. None without device work in any step."""
    per: dict[int, list[tuple[float, float]]] = {}
    for j in range(len(kernels.starts)):
        step = steps.by_corr.get(kernels.corrs[j], -1) if kernels.corrs[j] >= 0 else -1
        if step < 0 and kernels.exts[j] >= 0:
            step = steps.by_ext.get(kernels.exts[j], -1)
        if step >= 0:
            per.setdefault(step, []).append((kernels.starts[j], kernels.ends[j]))
    if not per:
        return None
    rows = []  # (busy, span, host, device intervals) per step, µs
    tail = -math.inf  # where earlier steps' device work ended
    for step in sorted(steps.bounds):
        start, end = steps.bounds[step]
        intervals = sorted(per.get(step, ()))
        last = max((b for _, b in intervals), default=-math.inf)
        begin, finish = max(start, tail), max(end, last)
        busy, cursor = 0.0, begin
        for a, b in intervals:  # the union, clipped to the span
            a, b = max(a, cursor), min(b, finish)
            if b > a:
                busy += b - a
                cursor = b
        rows.append((busy, finish - begin, end - start, len(intervals)))
        tail = max(tail, last)
    used = rows[1:] if len(rows) >= 2 else rows
    n = len(used)
    busy_us, span_us = sum(r[0] for r in used), sum(r[1] for r in used)
    return {"steps": n, "ratio": round(busy_us / span_us, 6) if span_us > 0 else None,
            "busy_seconds_per_step": round(busy_us / n / 1e6, 12),
            "span_seconds_per_step": round(span_us / n / 1e6, 12),
            "host_seconds_per_step": round(sum(r[2] for r in used) / n / 1e6, 12),
            "kernels_per_step": round(sum(r[3] for r in used) / n, 3),
            "ratio_per_step": [round(r[0] / r[1], 6) if r[1] > 0 else None for r in used]}


def summarise(read: Callable[[int], bytes], on_chunk: Callable[[bytes], None] | None = None, *,
              device_time: bool = False) -> dict[str, Any]:
    """Rows per (op name, input shapes), as ``roofline.aggregate`` builds them from FunctionEvents,
    the number of host events, the device's busy span, and the per-step op table (``ops``, ``steps``;
    see ``step_table``: self device time when ``device_time``, else self CPU time); times in seconds."""
    rows: dict[tuple[str, str], Row] = {}
    order: list[Row] = []  # key index -> row
    threads: dict[Any, _Thread] = {}
    step_starts: dict[Any, list[float]] = {}  # thread -> start (µs) of each step annotation on it
    device_us: dict[int, float] = {}
    first_us, last_us = math.inf, -math.inf  # the device's busy span (kernels run after the host queued them)
    kernels = _Kernels()
    events = 0
    for e in iter_events(read, on_chunk):
        if e.get("ph") != "X":
            continue
        cat = e.get("cat")
        args = e.get("args")
        args = args if isinstance(args, dict) else {}
        if cat in DEVICE_CATEGORIES:
            ext = args.get("External id")
            dur = float(e.get("dur") or 0.0)
            if isinstance(ext, int):
                device_us[ext] = device_us.get(ext, 0.0) + dur
            ts = float(e.get("ts") or 0.0)
            first_us, last_us = min(first_us, ts), max(last_us, ts + dur)
            kernels.add(ts, dur, args)
            continue
        if cat not in HOST_CATEGORIES:
            continue
        events += 1
        name = str(e.get("name"))
        dims = args.get("Input Dims") or []
        types = args.get("Input type") or []
        key = (name, str(dims) if dims else "")
        row = rows.get(key)
        if row is None:
            row = rows[key] = {"name": name, "calls": 0, "cpu_time_total_seconds": 0.0,
                               "self_cpu_time_total_seconds": 0.0, "device_time_total_seconds": 0.0,
                               "self_device_time_total_seconds": 0.0,
                               "input_shapes": [str(s) for s in dims] or None, "flops": 0,
                               "input_bytes_estimate": 0, "dtypes": set(), "_i": len(order)}
            order.append(row)
        row["dtypes"].update(tensor_dtypes(types))
        tkey = (e.get("pid"), e.get("tid"))
        t = threads.get(tkey)
        if t is None:
            t = threads[tkey] = _Thread()
        ts = float(e.get("ts") or 0.0)
        ext = args.get("External id") if cat in OWN_ID_CATEGORIES else None
        if cat == "user_annotation" and name == STEP_ANNOTATION:
            step_starts.setdefault(tkey, []).append(ts)
        t.starts.append(ts)
        t.ends.append(ts + float(e.get("dur") or 0.0))
        t.keys.append(row["_i"])
        t.py.append(cat == "python_function")
        t.exts.append(ext if isinstance(ext, int) else -1)
        corr = args.get("correlation") if cat in ("cuda_runtime", "cuda_driver") else None
        t.corrs.append(corr if isinstance(corr, int) else -1)
        t.flops.append(flops(name, dims, types, args.get("Concrete Inputs") or []))
        t.bytes.append(input_bytes(dims, types))
    steps = _Steps(step_starts)
    for tkey, t in threads.items():
        _attribute(t, order, device_us, steps, tkey)
    out = []
    for row in order:
        del row["_i"]
        row["dtypes"] = sorted(row["dtypes"])
        # Not the step annotation (perfmon's own, not the model's); not an op whose every event was a
        # duplicate torch drops.
        if row["calls"] and row["name"] != STEP_ANNOTATION:
            out.append(row)
    span = (last_us - first_us) / 1e6 if last_us > first_us else None
    ops, used = _table_of(steps.leaf, device_time)
    top, _ = _table_of(steps.top, device_time, limit=TOP_TABLE_OPS)
    for name, entry in top.items():
        under = steps.under.get(name)
        if under is not None:
            entry["breakdown"] = _table_of(under, device_time, limit=BREAKDOWN_OPS)[0]
    return {"rows": out, "events": events, "device_span_seconds": span, "ops": ops, "top_ops": top, "steps": used,
            "occupancy": step_occupancy(kernels, steps)}


def _table_of(per: _PerStep, device_time: bool, *, limit: int = STEP_TABLE_OPS) -> tuple[dict[str, Any], int]:
    return step_table(per.device if device_time else per.cpu, per.calls, per.count, limit=limit)


def step_table(seconds: dict[str, array.array[float]], calls: dict[str, array.array[int]], count: int, *,
               limit: int = STEP_TABLE_OPS) -> tuple[dict[str, dict[str, float]], int]:
    """``({op name: {"calls_per_step", "seconds_per_step", "seconds_per_step_stdev", "seconds_per_step_median",
    "seconds_per_step_mad", "share_of_steps"}}, steps used)``; ``share_of_steps`` is the fraction of the steps
    used in which the op was called at all.

    ``seconds[name][i]`` and ``calls[name][i]`` are the op's self seconds and calls in step ``i`` of
    ``count``. With two steps or more the first is left out: it runs right after the profiler started
    and pays its warm-up (measured on a warm 256-wide MLP on CPU: 0.5-1.4 ms against 0.2-0.3 ms for
    the steps after it), which would swell both the mean and the spread. Means are per step over the
    steps used (an op absent from a step counts 0 there); the spread is the sample standard deviation
    over those steps (0 with one step), the median the middle step's seconds (the mean of the two middle ones;
    what ``compare`` reads for an op called in every step: a preempted step moves one op's mean by the
    preemption, its median not), ``seconds_per_step_mad`` the median absolute deviation from the median (the
    spread ``compare`` reads with it). The ``limit`` names with the most self time are kept; the
    others are summed step by step into ``[other]``.
    """
    first = 1 if count >= 2 else 0
    n = count - first
    if n <= 0:
        return {}, 0
    totals = []
    for name, per_step in seconds.items():
        c = sum(calls[name][first:])
        if c:  # seen only in the warm-up step: not part of the table
            totals.append((-sum(per_step[first:]), name))
    totals.sort()
    table: dict[str, dict[str, float]] = {}
    rest_s = [0.0] * n
    rest_c = 0
    for rank, (_, name) in enumerate(totals):
        per_step = seconds[name][first:]
        if rank < limit:
            table[name] = _step_stats(per_step, sum(calls[name][first:]), n)
            table[name]["share_of_steps"] = round(sum(1 for c in calls[name][first:] if c) / n, 6)
        else:
            rest_s = [a + b for a, b in zip(rest_s, per_step)]
            rest_c += sum(calls[name][first:])
    if rest_c:
        table[OTHER] = _step_stats(rest_s, rest_c, n)
    return table, n


def _step_stats(per_step: Any, calls: int, n: int) -> dict[str, float]:
    mean = sum(per_step) / n
    var = sum((x - mean) ** 2 for x in per_step) / (n - 1) if n > 1 else 0.0
    median = statistics.median(per_step)
    return {"calls_per_step": round(calls / n, 6), "seconds_per_step": round(mean, 12),
            "seconds_per_step_stdev": round(math.sqrt(var), 12),
            "seconds_per_step_median": round(median, 12),
            # The spread that goes with the median (compare reads it for an op in every step): one preempted
            # step moves it as little as it moves the median.
            "seconds_per_step_mad": round(statistics.median(abs(x - median) for x in per_step), 12)}


def _attribute(t: _Thread, order: list[Row], device_us: dict[int, float], steps: _Steps, tkey: Any) -> None:
    """Add one thread's events to their rows, with self CPU time and device times from the nesting,
    and to the per-step table where a step annotation encloses them.

    Mirrors ``EventList._build_tree``: sorted by (start, -end), an event's parent is the innermost
    open interval that contains it; then ``_remove_dup_nodes``: an event that is the only child of
    a parent of the same name is dropped, its children and kernels lifted to that parent.
    """
    n = len(t.starts)
    starts, ends = t.starts, t.ends
    idx = sorted(range(n), key=lambda i: (starts[i], -ends[i]))
    parent = array.array("q", bytes(8 * n))
    nchild = array.array("q", bytes(8 * n))
    child_us = array.array("d", bytes(8 * n))
    direct = array.array("d", (device_us.get(x, 0.0) if x >= 0 else 0.0 for x in t.exts))
    dropped = bytearray(n)
    stack: list[int] = []
    for i in idx:
        while stack and (starts[i] >= ends[stack[-1]] or ends[i] > ends[stack[-1]]):
            stack.pop()
        p = stack[-1] if stack else -1
        parent[i] = p
        if p >= 0:
            nchild[p] += 1
            child_us[p] += ends[i] - starts[i]
        stack.append(i)

    def up(i: int) -> int:
        p = parent[i]
        while p >= 0 and dropped[p]:
            p = parent[p]
        return p

    # The step of each event: its own number for a step annotation, else its parent's (parents come
    # first in idx); -1 outside every step.
    step_of = array.array("q", [-1]) * n
    for i in idx:
        if order[t.keys[i]]["name"] == STEP_ANNOTATION:
            step_of[i] = steps.number.get((tkey, starts[i]), -1)
        elif parent[i] >= 0:
            step_of[i] = step_of[parent[i]]
        step = step_of[i]
        if step >= 0:  # what launched a kernel, for the step's device occupancy
            if t.corrs[i] >= 0:
                steps.by_corr[t.corrs[i]] = step
            if t.exts[i] >= 0:
                steps.by_ext[t.exts[i]] = step
            if order[t.keys[i]]["name"] == STEP_ANNOTATION:
                steps.bounds[step] = (starts[i], ends[i])
    for i in idx:  # parents first, so a chain a > a > a folds into its top
        p = up(i)
        if p >= 0 and nchild[p] == 1 and order[t.keys[p]]["name"] == order[t.keys[i]]["name"]:
            dropped[i] = 1
            nchild[p], child_us[p], direct[p] = nchild[i], child_us[i], direct[i]
    # The top-level op of each event in a step: the outermost op under the step annotation, looking
    # through Python frames (with_stack), which are the user's code rather than ops it called.
    # -1: none (outside every step, the annotation itself, a Python frame above every op).
    top_of = array.array("q", [-1]) * n
    for i in idx:
        if dropped[i] or step_of[i] < 0 or order[t.keys[i]]["name"] == STEP_ANNOTATION:
            continue
        p = up(i)
        if p >= 0 and top_of[p] >= 0:
            top_of[i] = top_of[p]
        elif not t.py[i]:
            top_of[i] = i
    dev = array.array("d", direct)
    for i in reversed(idx):  # children after parents in idx: a reverse walk finishes each subtree first
        if dropped[i]:
            continue
        row = order[t.keys[i]]
        row["calls"] += 1
        row["cpu_time_total_seconds"] += (ends[i] - starts[i]) / 1e6
        row["self_cpu_time_total_seconds"] += (ends[i] - starts[i] - child_us[i]) / 1e6
        row["self_device_time_total_seconds"] += direct[i] / 1e6
        row["device_time_total_seconds"] += dev[i] / 1e6
        row["flops"] += t.flops[i]
        row["input_bytes_estimate"] += t.bytes[i]
        if step_of[i] >= 0 and row["name"] != STEP_ANNOTATION:
            self_us = ends[i] - starts[i] - child_us[i]
            steps.leaf.add(row["name"], step_of[i], self_us, direct[i])
            top = top_of[i]
            if top >= 0:
                top_name = order[t.keys[top]]["name"]
                steps.add_under(top_name, row["name"], step_of[i], self_us, direct[i])
                if top == i:  # children come first in this walk: dev[i] holds its whole subtree by now
                    steps.top.add(top_name, step_of[i], ends[i] - starts[i], dev[i])
        p = up(i)
        if p >= 0:
            dev[p] += dev[i]


_ITEMSIZE = {
    "float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8, "long": 8, "int": 4,
    "short int": 2, "short": 2, "signed char": 1, "unsigned char": 1, "bool": 1, "c10::complex<float>": 8,
    "c10::complex<double>": 16, "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1,
}


def input_bytes(shapes: Any, dtypes: Any) -> int:
    """Bytes of an op's tensor inputs from their shapes and dtype names (unknown dtypes count 0)."""
    total = 0
    for shape, dtype in zip(shapes or (), dtypes or ()):
        size = _ITEMSIZE.get(str(dtype))
        if size is None or not isinstance(shape, (list, tuple)) or not shape:
            continue
        total += math.prod(int(d) for d in shape) * size
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--in-fd", type=int, required=True, help="descriptor of the Chrome trace JSON")
    p.add_argument("--gz-fd", type=int, help="descriptor to write the gzipped trace to")
    p.add_argument("--max-memory-bytes", type=int, default=0, help="address-space cap (RLIMIT_AS); 0: none")
    p.add_argument("--compresslevel", type=int, default=6)
    p.add_argument("--device-time", action="store_true",
                   help="per-step op table by self device time (a CUDA capture), not self CPU time")
    args = p.parse_args(argv)
    try:
        os.nice(10)  # the serving threads of the parent come first
    except OSError:
        pass
    if args.max_memory_bytes:
        try:
            import resource

            resource.setrlimit(resource.RLIMIT_AS, (args.max_memory_bytes, args.max_memory_bytes))
        except (ImportError, ValueError, OSError):
            pass
    src: IO[bytes] = os.fdopen(args.in_fd, "rb", buffering=0)
    raw: IO[bytes] | None = os.fdopen(args.gz_fd, "wb") if args.gz_fd is not None else None
    gz = gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=args.compresslevel, mtime=0) if raw else None
    def write(chunk: bytes) -> None:
        assert gz is not None
        gz.write(chunk)

    result = summarise(src.read, write if gz is not None else None, device_time=args.device_time)
    if gz is not None and raw is not None:
        gz.close()  # writes the gzip trailer; the file object stays open
        raw.flush()
        os.fsync(raw.fileno())
        raw.close()
    try:
        import resource

        use = resource.getrusage(resource.RUSAGE_SELF)
        result["cpu_seconds"] = use.ru_utime + use.ru_stime
        # ru_maxrss: KiB on Linux (bytes on macOS); on Linux it carries the parent's peak across
        # fork+exec, so /proc's VmHWM (this address space only) is preferred where it exists.
        result["max_rss_bytes"] = use.ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    except (ImportError, OSError):
        pass
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    result["max_rss_bytes"] = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    json.dump(result, sys.stdout)
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
