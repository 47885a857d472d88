"""GPU occupancy and launch-bound detection per model: how busy the device was inside the model's calls, and
whether the host, not the device, sets their pace (the case where a faster GPU buys nothing).

A timed CUDA call's event pair measures its device *span*, and the span includes the gaps between kernels:
when the host launches kernels slower than the device runs them, the device idles between them and the span is
about the host's launch time. So the span alone cannot say how busy the device was. Two sources, neither on
the request path:

* **A capture** (exact): the device's busy time (the union of each call's kernel intervals) over the call's
  span, per recorded step, from the model's newest ok CUDA capture (``trace_summary.step_occupancy``; the
  regression policy's baseline captures keep one fresh, regression and manual ones count too), used while it is
  younger than ``occupancy_capture_max_age_seconds``. A profiled call's host side runs slower (the profiler's
  per-op cost), so a launch-bound model reads a little lower in a capture than it runs; a device-bound one
  does not move.
* **Live** (every timed call): host time ÷ device span per call (``Sample.host_seconds`` /
  ``Sample.duration_seconds``), the median over the ``/stats`` window. At or above ``HOST_BOUND_RATIO`` the
  device finished right after the host's last launch: launch-bound — *or* a forward that synchronises
  (``.item()``, ``.cpu()``, a stopping criterion) makes the host wait for a device that was busy all along.
  Below it, the host returned while the device still had work queued: device-bound.

The rule (``perfmon_model_host_bound``, ``/stats`` ``models[m].occupancy``, which says which source it took and
when): with a capture, host-bound when its occupancy is below ``HOST_BOUND_OCCUPANCY``; without one, when the
live ratio reaches ``HOST_BOUND_RATIO`` over at least ``MIN_SAMPLES`` calls (a forward that synchronises is
flagged until a capture says the device was busy). A CPU model has no device: no occupancy, no series.

Rejected, a live probe: queue a device spin (``torch.cuda._sleep``) longer than the call's launch time before a
sampled call, so that its kernels run back to back and its event pair reads busy time. It costs that request
the spin's latency (about its own host time again for a launch-bound model), needs the spin calibrated in clock
cycles (boost clocks move), and reads wrong for exactly the case the live ratio cannot settle: a forward that
synchronises drains the spin mid-call and goes back to launching with gaps. A capture measures the same for
free on the request path and is taken anyway.

Feeding: ``sample`` is a resolver sink (one ring append per steady CUDA sample), ``capture_done`` a capture
export listener (the export thread); reads (``model``, ``rows``) come from ``/stats`` and scrapes.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from time import perf_counter_ns
from typing import Any, NamedTuple

from ..agent.models import Models
from ..agent.records import STEADY, Sample
from ..store.traces import TraceStore
from .windows import quantile

__all__ = ["HOST_BOUND_OCCUPANCY", "HOST_BOUND_RATIO", "MIN_SAMPLES", "RING", "Measured", "Occupancy", "Row"]

#: A capture whose device was busy less than half of its calls' span: host-bound.
HOST_BOUND_OCCUPANCY = 0.5
#: Live: host time at least 0.9 x the device span (median over the window): the device finished right after
#: the host's last launch.
HOST_BOUND_RATIO = 0.9
#: Live calls needed in the window before the live ratio decides.
MIN_SAMPLES = 5
#: Host/span ratios kept per model (the newest; those older than the window are skipped on read).
RING = 512


class Measured(NamedTuple):
    """One capture's occupancy of a model (``Capture.occupancy``), with where and when it was measured."""

    capture_id: str
    trigger: str
    ended_unix: float  # seconds since the epoch
    ratio: float  # busy / span over the capture's steps, 0..1
    parts: Mapping[str, Any]  # the capture's whole occupancy entry (per step: busy, span, host, kernels)


class Row(NamedTuple):
    """What the collector exports for one CUDA model; None where there is no such number."""

    model: str
    occupancy: float | None
    host_bound: bool | None
    host_device_ratio: float | None
    capture_unix: float | None


class Occupancy:
    """Occupancy and the host-bound verdict per model (see the module docstring); fail soft, lock free."""

    def __init__(self, *, models: Models, store: TraceStore, window_seconds: float, max_age_seconds: float,
                 clock: Callable[[], float] = time.time) -> None:
        self._models = models
        self._store = store
        self.window_ns = int(window_seconds * 1e9)
        self.max_age_seconds = max_age_seconds
        self._clock = clock
        #: model -> its newest capture's occupancy (a dict assignment: atomic under the GIL, fork-safe).
        self._latest: dict[str, Measured] = {}
        self._loaded = False
        self.reset_after_fork()

    def reset_after_fork(self) -> None:
        """The live rings start empty (the parent's calls are the parent's); captures still describe the model."""
        self._rings: dict[str, collections.deque[tuple[int, float]]] = {}

    # -- feeding ------------------------------------------------------------------------------

    def sample(self, samples: list[Sample]) -> None:
        """Resolver sink: each steady call of a pass timed with CUDA events adds its host time / device span."""
        rings = self._rings
        for s in samples:
            if s.phase == STEADY and s.duration_seconds > 0 and s.device.startswith("cuda"):
                ring = rings.get(s.model)
                if ring is None:
                    ring = rings[s.model] = collections.deque(maxlen=RING)
                ring.append((s.end_ns, s.host_seconds / s.duration_seconds))

    def capture_done(self, meta: Mapping[str, Any]) -> None:
        """Capture listener (a capture's stored metadata): an ok CUDA capture that saw kernels becomes its
        model's newest measurement."""
        model, measured = meta.get("model"), _measured(meta)
        if isinstance(model, str) and measured is not None:
            self._latest[model] = measured

    def _load(self) -> None:
        """Once, at the first read: each model's newest stored capture (it may predate this process)."""
        if self._loaded:
            return
        self._loaded = True
        for meta in self._store.list():  # newest first
            model, measured = meta.get("model"), _measured(meta)
            if isinstance(model, str) and measured is not None:
                self._latest.setdefault(model, measured)

    # -- reading ------------------------------------------------------------------------------

    def live(self, model: str, now_ns: int) -> tuple[float | None, int]:
        """(median host time / device span of the window's steady CUDA calls, how many), or (None, count)."""
        ring = self._rings.get(model)
        cutoff = now_ns - self.window_ns
        # list(deque) is one C call under the GIL: the resolver's appends cannot interleave with the copy.
        ratios = sorted(r for end, r in list(ring) if end >= cutoff) if ring is not None else []
        return (quantile(ratios, 0.5) if len(ratios) >= MIN_SAMPLES else None), len(ratios)

    def measured(self, model: str) -> tuple[Measured | None, float | None]:
        """(the model's newest capture measurement, its age in seconds), or (None, None)."""
        self._load()
        m = self._latest.get(model)
        return (m, self._clock() - m.ended_unix) if m is not None else (None, None)

    def model(self, name: str, now_ns: int | None = None) -> dict[str, Any] | None:
        """``/stats`` ``models[name].occupancy``: the numbers, the verdict, its source and a one-line why."""
        st = self._models.get(name)
        if st is None:
            return None
        if st.cuda_index < 0:  # not timed with CUDA events: its durations are the host's own clock
            return {"device": st.device, "occupancy_ratio": None, "host_bound": None, "source": None,
                    "host_device_ratio": None, "why": "a CPU model: no device to keep busy, so no occupancy and no "
                    "host-bound series" if st.device == "cpu" else f"{st.device} is not timed with CUDA events here"}
        now_ns = perf_counter_ns() if now_ns is None else now_ns
        ratio, n = self.live(name, now_ns)
        m, age = self.measured(name)
        fresh = m is not None and age is not None and age <= self.max_age_seconds
        source = "capture" if fresh else "live" if ratio is not None else None
        host_bound = (m.ratio < HOST_BOUND_OCCUPANCY if source == "capture" and m is not None
                      else ratio >= HOST_BOUND_RATIO if source == "live" and ratio is not None else None)
        capture = None if m is None else {
            "id": m.capture_id, "trigger": m.trigger, "age_seconds": age, "used": fresh, "occupancy_ratio": m.ratio,
            **{k: m.parts.get(k) for k in ("steps", "busy_seconds_per_step", "span_seconds_per_step",
                                           "host_seconds_per_step", "kernels_per_step")}}
        return {"device": st.device, "occupancy_ratio": m.ratio if fresh and m is not None else None,
                "host_bound": host_bound, "source": source, "host_device_ratio": ratio, "samples": n,
                "capture": capture, "why": _why(source, host_bound, m, ratio, n, age, self.max_age_seconds)}

    def rows(self) -> list[Row]:
        """One row per CUDA model with at least one number (the collector's read, at scrape)."""
        now_ns = perf_counter_ns()
        out = []
        for name in list(self._models.by_name):
            v = self.model(name, now_ns)
            if v is None:
                continue
            m = self._latest.get(name)
            row = Row(name, v["occupancy_ratio"], v["host_bound"], v["host_device_ratio"],
                      m.ended_unix if m is not None and v["source"] == "capture" else None)
            if row.occupancy is not None or row.host_bound is not None or row.host_device_ratio is not None:
                out.append(row)
        return out


def _measured(meta: Mapping[str, Any]) -> Measured | None:
    """A stored or finished capture's occupancy, when it is an ok CUDA capture that saw kernels."""
    occ = meta.get("occupancy")
    if meta.get("outcome") != "ok" or not str(meta.get("device", "")).startswith("cuda") or not isinstance(occ, dict):
        return None
    ratio = occ.get("ratio")
    try:
        ended = datetime.fromisoformat(str(meta.get("ended_at")))
    except ValueError:
        return None
    if not isinstance(ratio, (int, float)) or math.isnan(ratio):
        return None
    if ended.tzinfo is None:
        ended = ended.replace(tzinfo=timezone.utc)
    return Measured(str(meta.get("id")), str(meta.get("trigger")), ended.timestamp(), min(max(float(ratio), 0.0), 1.0),
                    occ)


def _why(source: str | None, host_bound: bool | None, m: Measured | None, ratio: float | None, n: int,
         age: float | None, max_age: float) -> str:
    """One line for the status page's badge and /stats: what decided, and what it means."""
    if source == "capture" and m is not None:
        kernels = m.parts.get("kernels_per_step")
        seen = (f"the device was busy {m.ratio:.0%} of each call's span in capture {m.capture_id} "
                f"({m.trigger}, {kernels:g} kernels a call)" if isinstance(kernels, (int, float)) else
                f"the device was busy {m.ratio:.0%} of each call's span in capture {m.capture_id} ({m.trigger})")
        if host_bound:
            return (f"launch-bound: {seen}; the host launches kernels slower than the GPU runs them, so a faster GPU "
                    "buys nothing: cut launches (CUDA graphs, torch.compile mode='reduce-overhead', bigger batches)")
        waits = ratio is not None and ratio >= HOST_BOUND_RATIO
        return f"device-bound: {seen}" + ("; the host waits for it (the forward synchronises)" if waits else "")
    stale = "" if m is None else f" (capture {m.capture_id} is {age:.0f} s old, over {max_age:g} s)"
    if source == "live" and ratio is not None:
        if host_bound:
            return (f"host time is {ratio:.2f}x the device span (median of {n} calls): the device finished right after "
                    "the host's last launch — launch-bound, or a forward that synchronises; a capture will tell"
                    + stale)
        return (f"host time is {ratio:.2f}x the device span (median of {n} calls): the host returns while the device "
                "still has work queued — device-bound" + stale)
    return f"not measured yet: {n} timed call(s) in the window (needs {MIN_SAMPLES}) and no capture" + stale
