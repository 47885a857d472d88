"""The resolver: turns pending timed calls into samples, off the request thread.

Each step drains the queue the hot path appends to, asks every pending CUDA pair whether its end
event completed (``query()``, no synchronize), converts completed pairs to seconds, returns the
events to their pool and hands the pass's ``Sample`` list to each sink (metrics, windows...). Pairs complete
out of order across streams and devices; each is polled on its own. The step is guarded by a
lock so ``Monitor.flush()`` can run it from the caller's thread and tests can drive it without
a thread at all.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from time import perf_counter_ns
from typing import Any

from ..faults import count_value
from .clocks import elapsed_seconds
from .doze import Doze
from .records import COLD, STEADY, Pending, Sample
from .state import Hub, ModelState

__all__ = ["Annotate", "Resolver", "Sink"]

_tuple_new = tuple.__new__

#: A stage that consumes resolved samples (structlog-style: a plain callable), a pass's at once, in order: one call
#: (and one lock) a pass, not a sample (as ``GenerationSink`` and ``PauseSink``).
Sink = Callable[[list[Sample]], None]
#: Runs on each pass's samples before the sinks, every pass (even with none), and returns them (replaced
#: items allowed): telemetry/gcpauses.py marks the calls that overlapped a GC pause.
Annotate = Callable[[list[Sample]], list[Sample]]


class Resolver:
    """Owns the pending list and the background thread that works it."""

    def __init__(
        self,
        hub: Hub,
        sinks: Iterable[Sink],
        *,
        states: Callable[[], Iterable[ModelState]] = tuple,
        log: Any = None,
        on_tick: Callable[[int], int | None] | None = None,
        device_refresh_seconds: float = 10.0,
        idle_seconds: float = 1.0,
        doze_seconds: float = 8.0,
    ) -> None:
        #: How long the thread sleeps when no device event is in flight (seconds): housekeeping's cadence.
        self.idle_seconds = idle_seconds
        #: Longer sleeps after quiet passes, up to ``doze.seconds`` (agent/doze.py); ``doze.dozers`` are the record
        #: queues that wake the thread on their first record meanwhile: the hub's, and the monitor adds its own.
        self.doze = Doze([hub.doze, self._in_flight], internal=hub.internal, seconds=doze_seconds)
        #: Housekeeping called once per resolver pass with perf_counter_ns (faults are counted, never raised). It
        #: returns when it next has work of its own (perf_counter_ns: a window closes, a retry falls due; the pass's
        #: own time when it did some or more waits), or None for nothing until a record arrives.
        self.on_tick = on_tick
        #: Called on each pass's samples after they are resolved, before the sinks (None: nothing).
        self.annotate: Annotate | None = None
        #: Called with the seconds left when stop() has drained: sinks with threads of their own end them there.
        self.on_stop: list[Callable[[float], None]] = []
        self.hub = hub
        self.sinks = list(sinks)
        self._states = states
        self._log = log
        self._pending: list[Pending] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: How often each model's device is re-read and dropped samples are logged (ns). ``.to()``, ``.cuda()``...
        #: relabel at once (wrap._apply_then_relabel): this only catches moves that bypass ``_apply`` (a parameter
        #: reassigned), and walking every stage's parameters each second was ~40% of an idle wake's work.
        self._refresh_ns = int(device_refresh_seconds * 1e9)
        #: perf_counter_ns when the next model's sampling floor falls due (None: none pending).
        self.floor_due_ns: int | None = None
        #: perf_counter_ns when the last pass's housekeeping next has work (``on_tick``'s answer; None: none).
        self.tick_due_ns: int | None = None
        self._last_refresh_ns = 0
        self._dropped_seen: dict[tuple[str, str], int] = {}

    def reset_after_fork(self) -> None:
        """In a forked child: the parent's thread does not exist here; start from an empty slate."""
        self._pending = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        self._dropped_seen = {}
        self.tick_due_ns = None
        self.doze.reset()  # the parent may have forked while its thread dozed

    # -- one step -------------------------------------------------------------------------

    def step(self, now_ns: int | None = None) -> int:
        """Resolve what can be resolved now; returns the number of samples delivered."""
        with self._lock:
            done = self._collect()
            if self.annotate is not None:
                try:
                    done = self.annotate(done)
                except Exception as exc:  # the samples go on unmarked
                    self.hub.internal.report("resolver", exc)
            delivered = self._deliver(done)
            now = perf_counter_ns() if now_ns is None else now_ns
            busy = self._housekeeping(now)
            due = self.tick_due_ns
            self.doze.passed(not delivered and not busy and not self._pending
                             and (due is None or due - now > self.idle_seconds * 1e9))
            return delivered

    def _collect(self) -> list[Sample]:
        queue = self.hub.queue
        pending = self._pending
        while queue:
            try:
                pending.append(queue.popleft())
            except IndexError:  # pragma: no cover - only this thread pops
                break
        done: list[Sample] = []
        keep: list[Pending] = []
        for p in pending:
            try:
                sample = self._resolve(p)
            except Exception as exc:
                self.hub.internal.report("resolver", exc)
                self._release(p)
                continue
            if sample is None:
                keep.append(p)
            elif sample is not _DROPPED:
                done.append(sample)  # type: ignore[arg-type]
        self._pending = keep
        return done

    def _resolve(self, p: Pending) -> Sample | object | None:
        # One unpacking, not a named field's read each (~25 ns apiece).
        probe, seq, cold, start_ns, end_ns, pair, device, items, size, trace, sig = p
        host_seconds = (end_ns - start_ns) / 1e9
        if pair is None:
            duration = host_seconds
        else:
            # query() on a never-recorded event is True; ours were recorded on the hot path.
            if not pair.end.query():
                return None
            try:
                duration = elapsed_seconds(pair)
            except (RuntimeError, ValueError) as exc:
                next(probe.drops["timing_failed"])
                self.hub.internal.report("elapsed_time", exc)
                return _DROPPED
            finally:
                self.hub.pools.release(pair)
        if trace is not None and self.hub.trace_read is not None:
            trace = self._read_trace(trace)
        # Every field in order, built without the named tuple's Python __new__ (~0.3 µs a sample).
        return _tuple_new(Sample, (probe.name, device, COLD if cold else STEADY, seq, duration, host_seconds, end_ns,
                                   items, probe.stage, size, trace, 0.0, -1, sig))

    def _read_trace(self, taken: Any) -> tuple[int, int] | None:
        """The span ids of a timed call, from what the request thread took (the default reader's second half,
        exemplars.otel_deferred); a reader that fails costs the exemplar, not the sample."""
        try:
            return self.hub.trace_read(taken)  # type: ignore[misc]
        except Exception as exc:
            self.hub.internal.report("exemplar", exc)
            return None

    def _release(self, p: Pending) -> None:
        if p.events is not None:
            try:
                self.hub.pools.release(p.events)
            except Exception as exc:  # pragma: no cover
                self.hub.internal.report("resolver", exc)

    def _deliver(self, samples: list[Sample]) -> int:
        if samples:
            for sink in self.sinks:
                try:
                    sink(samples)
                except Exception as exc:  # that sink's view of this pass is lost; the others still get it
                    self.hub.internal.report("sink", exc)
        return len(samples)

    def _housekeeping(self, now_ns: int) -> bool:
        """The models' floors and items, the device re-read, then ``on_tick``; True if calls ran since the last pass."""
        refresh = now_ns - self._last_refresh_ns >= self._refresh_ns
        if refresh:
            self._last_refresh_ns = now_ns
        soonest = None
        busy = False
        idle_ns = int(self.idle_seconds * 1e9)
        for st in self._states():
            try:
                # The sampling floor: a model with no timed call for floor_seconds gets its next call timed; one due
                # within a quarter of a floor (at most a tick) now, a little early, not by a wake of its own just
                # after this pass (the floor and the tick both a second: 2 wakes a second; docs/design.md).
                early = min(st.sampler.floor_ns >> 2, idle_ns)
                if st.sampler.floor_due(st.last_sample_ns, now_ns + early):
                    st.next_index = 0
                elif st.next_index:  # not armed yet: its floor falls due then (the thread wakes for it)
                    due = st.last_sample_ns + st.sampler.floor_ns
                    soonest = due if soonest is None or due < soonest else soonest
                busy = st.item_counts.drain() or busy
                # Calls since the last pass, timed or not: traffic, however light, is no quiet spell (else a pass
                # that timed nothing dozed, and the next timed call woke the thread at once).
                calls = count_value(st.calls)
                if calls != st.calls_seen:
                    st.calls_seen = calls
                    busy = True
                if refresh:
                    st.refresh_device()
                    self._note_drops(st)
            except Exception as exc:
                self.hub.internal.report("housekeeping", exc)
        self.floor_due_ns = soonest
        self.tick_due_ns = None
        if self.on_tick is not None:
            try:
                self.tick_due_ns = self.on_tick(now_ns)
            except Exception as exc:
                self.hub.internal.report("housekeeping", exc)
                self.tick_due_ns = now_ns  # not known: keep the usual cadence
        if self._log is not None:
            self.hub.internal.log_new(self._log)
        return busy

    def _note_drops(self, st: ModelState) -> None:
        """Log a burst of dropped samples once per refresh period (never per dropped sample)."""
        for reason, c in st.drops.items():
            n = count_value(c)
            key = (st.name, reason)
            before = self._dropped_seen.get(key, 0)
            if n > before:
                self._dropped_seen[key] = n
                if self._log is not None:
                    self._log.warning("samples_dropped", model=st.name, reason=reason, dropped=n - before,
                                      dropped_total=n)

    @property
    def pending(self) -> int:
        """Samples waiting: queued plus in flight on a device."""
        return len(self._pending) + len(self.hub.queue)

    def lag_seconds(self, now_ns: int | None = None) -> float:
        """Age of the oldest record not yet resolved (0 when none): how far behind the resolver runs."""
        oldest = None
        try:
            if self._pending:
                oldest = self._pending[0].end_ns
            elif self.hub.queue:
                oldest = self.hub.queue[0].end_ns
        except IndexError:  # emptied by the resolver meanwhile
            oldest = None
        if oldest is None:
            return 0.0
        return max(0.0, ((perf_counter_ns() if now_ns is None else now_ns) - oldest) / 1e9)

    # -- the thread -------------------------------------------------------------------------

    def start(self, interval_seconds: float) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, args=(interval_seconds,),
                                        name="perfmon-resolver", daemon=True)
        self._thread.start()

    def _run(self, interval: float) -> None:
        """Wake only when there is work. While device events are in flight, poll them every ``interval``;
        otherwise sleep ``idle_seconds`` (housekeeping: windows, the sampling floor, device refresh), or
        until the hot path says a quarter of the queue or event pool waits (``Hub.wake``). Host-timed
        samples wait for the next tick (at most a second, against a 15 s scrape); each wake the thread
        saves is a GIL hand-off the serving thread does not pay (docs/design.md, "What the agent costs").
        With nothing arriving it dozes (agent/doze.py): an idle agent wakes for what falls due, not each second."""
        cpu = self.hub.cpu
        wake = self.hub.wake
        doze = self.doze
        wait = interval
        while True:
            woken = wake.wait(wait)
            if self._stop.is_set():
                return
            wake.clear()
            if doze.dozing:
                doze.woke(woken)
            cpu.woke("resolver")
            try:
                with cpu.measure("resolver"):
                    self.step()
            except Exception as exc:  # a sink or housekeeping bug must not kill the thread
                self.hub.internal.report("resolver", exc)
            wait = interval if self._pending else doze.sleep(self.idle_seconds, interval, self.floor_due_ns,
                                                             self.tick_due_ns)

    def _in_flight(self, on: bool) -> bool:
        """A dozer: events a ``flush()`` on another thread took from the queue meanwhile are polled, not dozed on."""
        return bool(self._pending)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout_seconds: float) -> None:
        """Stop the thread, resolve what completes within the timeout, drop the rest (reason shutdown)."""
        deadline = perf_counter_ns() + int(timeout_seconds * 1e9)
        self._stop.set()
        self.hub.wake.set()
        if self._thread is not None:
            self._thread.join(timeout_seconds)
            self._thread = None
        self.doze.reset()
        self.drain(deadline_ns=deadline)
        with self._lock:
            for p in self._pending + _pop_all(self.hub.queue):
                next(p.probe.drops["shutdown"])
                self._release(p)
            self._pending = []
        for hook in self.on_stop:
            try:
                hook(max(0.0, (deadline - perf_counter_ns()) / 1e9))
            except Exception as exc:
                self.hub.internal.report("resolver", exc)

    def drain(self, *, deadline_ns: int) -> bool:
        """Step until nothing is pending or the deadline passes; True if everything resolved."""
        while True:
            self.step()
            if not self.pending:
                return True
            if perf_counter_ns() >= deadline_ns:
                return False
            # Waiting for the device to finish in-flight work: a short poll, bounded by the deadline.
            time.sleep(0.001)


_DROPPED = object()


def _pop_all(queue: Any) -> list[Pending]:
    out = []
    while queue:
        try:
            out.append(queue.popleft())
        except IndexError:  # pragma: no cover
            break
    return out
