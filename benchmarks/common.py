"""Helpers shared by the benchmark scripts: quiet monitors and markdown tables."""

from __future__ import annotations

import json
import platform
import random
import statistics
import threading
import time
import urllib.request
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from prometheus_client import CollectorRegistry

import perfmon


def machine() -> str:
    """One line describing where the numbers come from."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import os

    return (f"{os.cpu_count()} cores ({cpu}), Python {platform.python_version()}, torch {torch.__version__}, "
            f"perfmon {perfmon.__version__}")


def monitor(**kw: Any) -> perfmon.Monitor:
    """A monitor that logs only errors, has its own registry and no HTTP unless asked."""
    kw.setdefault("port", None)
    kw.setdefault("log_level", "error")
    kw.setdefault("registry", CollectorRegistry())
    kw.setdefault("prepare_profiler", False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # high sample rates are the point of some benchmarks
        return perfmon.Monitor(**kw)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None) -> str:
    """A markdown table; ``align`` is one character per column, l or r."""
    align = align or "l" + "r" * (len(headers) - 1)
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def dump(path: str | None, data: Any) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=1)


class ScraperProcess:
    """GET ``url/metrics`` every ``period`` seconds from a child process, as Prometheus does from its own: the
    scrape's client costs the serving process's GIL nothing (an in-process ``Scraper`` thread would be charged to
    the agent). ``url`` is fixed (give the monitor a fixed ``port``); a refused scrape (the monitor stopped) is
    skipped. Stopped by ``stop()`` (then ``scrapes`` and ``times``: the ``time.time()`` each ended); bounded by
    ``limit`` seconds even if never stopped."""

    _CHILD = (
        "import sys, time, urllib.request\n"
        "url, period, limit = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])\n"
        "end = time.monotonic() + limit\n"
        "while time.monotonic() + period < end:\n"
        "    time.sleep(period)\n"
        "    try:\n"
        "        urllib.request.urlopen(url, timeout=10).read()\n"
        "        print('ok', time.time(), flush=True)\n"
        "    except OSError:\n"
        "        pass\n"
    )

    def __init__(self, url: str, period: float = 15.0, limit: float = 3600.0) -> None:
        import subprocess
        import sys

        self._proc = subprocess.Popen([sys.executable, "-c", self._CHILD, f"{url}/metrics", str(period), str(limit)],
                                      stdout=subprocess.PIPE, text=True)
        #: time.time() of each scrape answered, once stopped
        self.times: list[float] = []

    @property
    def scrapes(self) -> int:
        """Scrapes answered (known once stopped)."""
        return len(self.times)

    def stop(self) -> None:
        self._proc.terminate()
        out, _ = self._proc.communicate(timeout=15)
        self.times = [float(line.split()[1]) for line in out.splitlines() if line.startswith("ok ")]


def flops_counted(mon: perfmon.Monitor, call: Callable[[], Any], *, timeout: float = 60.0) -> dict[str, float]:
    """Run ``call`` (calls of a wrapped model) until the monitor has counted its signatures' FLOPs: a count done
    (any outcome but ``deferred``) and the counting thread gone, or ``timeout`` seconds. A signature is counted once,
    on its first steady sample, on a thread of its own (agent/flopcount.py: a fake copy and a fake forward, tens of
    ms for an encoder); a benchmark of the steady state starts after it and reports that one-time cost apart
    (``seconds``: perfmon_flop_count_seconds_total; ``counts``; ``waited``: seconds this took; ``settled``: 1.0
    when counted, 0.0 on timeout or with counting off)."""
    def state() -> tuple[float, float]:  # counts done (deferrals apart), seconds counting; (0, 0) with counting off
        got = mon.stats()["flop_counting"]
        if got is None:
            return 0.0, 0.0
        return float(sum(n for outcome, n in got["counts"].items() if outcome != "deferred")), got["seconds"]

    t0 = time.perf_counter()
    settled = 0.0
    while mon.stats()["flop_counting"] is not None:
        if state()[0] >= 1 and not any(t.name == "perfmon-flops" for t in threading.enumerate()):
            settled = 1.0
            break
        if time.perf_counter() - t0 > timeout:
            break
        call()
    counts, seconds = state()
    return {"counts": counts, "seconds": seconds, "waited": time.perf_counter() - t0, "settled": settled}


def agent_threads(prefix: str = "perfmon") -> dict[str, tuple[int, int]]:
    """name -> (voluntary context switches, CPU ns) of this process's threads named ``prefix``...: a switch is a
    wake or a wait for the GIL; CPU time of a Python thread is time it held the GIL (or ran C code that released
    it)."""
    out: dict[str, tuple[int, int]] = {}
    for t in threading.enumerate():
        if not t.name.startswith(prefix) or t.native_id is None or t.ident is None:
            continue
        try:
            with open(f"/proc/self/task/{t.native_id}/status") as f:
                text = f.read()
            cpu = time.clock_gettime_ns(time.pthread_getcpuclockid(t.ident))
        except (OSError, ValueError):
            continue
        switches = int(text.split("voluntary_ctxt_switches:")[1].split()[0])
        old = out.get(t.name, (0, 0))
        out[t.name] = (old[0] + switches, old[1] + cpu)
    return out


def thread_deltas(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """name -> (switches, CPU ns) between two ``agent_threads`` readings (threads present in both)."""
    return {k: (after[k][0] - before[k][0], after[k][1] - before[k][1]) for k in after.keys() & before.keys()}


class ThreadTally:
    """Threads' switches and CPU ns (``thread_deltas``), summed by variant (``by_slot``: variant -> thread name ->
    [switches, CPU ns]), with the seconds they were read over (``seconds``)."""

    def __init__(self) -> None:
        self.by_slot: dict[str, dict[str, list[int]]] = {}
        self.seconds: dict[str, float] = {}

    def add(self, slot: str, moved: dict[str, tuple[int, int]], seconds: float) -> None:
        into = self.by_slot.setdefault(slot, {})
        for name, (switches, cpu) in moved.items():
            acc = into.setdefault(name, [0, 0])
            acc[0] += switches
            acc[1] += cpu
        self.seconds[slot] = self.seconds.get(slot, 0.0) + seconds


def thread_cost(switches: int, cpu_ns: float, price_ns: float, wake_cpu_ns: float) -> tuple[float, float]:
    """A background thread's cost to a GIL-bound serving thread, as a bound: (its CPU ns beyond what a do-nothing
    wake spends, ``wake_cpu_ns`` a switch: work it could do holding the GIL; that plus its ``switches`` at
    ``price_ns`` each, the serving time one switch of a do-nothing thread cost, calibrated with ``Waker``)."""
    work = max(0.0, cpu_ns - switches * wake_cpu_ns)
    return work, work + switches * price_ns


def gil_stalls(seconds: float, threshold_ns: int = 20_000) -> list[tuple[float, int]]:
    """The stalls of a pure-Python loop run for ``seconds``, each as (``time.time()`` at its end, ns): the loop holds
    the GIL as a GIL-bound serving thread does, reading the clock ~10 million times a second, and a gap over
    ``threshold_ns`` between two reads is time it could not run: another thread of this process held the GIL (with
    the hand-offs either side), or the OS ran something else on its core. Run beside a monitor running and
    stopped, the difference is what the agent's threads take from a serving thread that always wants the GIL (the
    worst case), whatever their wakes do; the host's speed wandering changes the loop's pace, not its gaps."""
    clock = time.perf_counter_ns
    wall = time.time() - clock() / 1e9
    last = clock()
    end = last + int(seconds * 1e9)
    stalls: list[tuple[float, int]] = []
    while last < end:
        now = clock()
        if now - last > threshold_ns:
            stalls.append((wall + now / 1e9, now - last))
        last = now
    return stalls


class _Polling:
    """A thread calling ``poll`` every ``every`` seconds while on (``set``, as ``Running.set``), keeping the
    ``time.time()`` of each poll."""

    def __init__(self, poll: Callable[[], object], every: float) -> None:
        self._poll, self._every = poll, every
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None
        self.times: list[float] = []

    def set(self, want: bool) -> None:
        if want and self._thread is None:
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._run, args=(self._stop,), daemon=True)
            self._thread.start()
        elif not want and self._thread is not None and self._stop is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def _run(self, stop: threading.Event) -> None:
        while not stop.wait(self._every):
            self._poll()
            self.times.append(time.time())


def poll_stall(poll: Callable[[], object], *, rounds: int, seconds: float, every: float = 0.2) -> dict[str, Any]:
    """What one NVML poll costs a loop holding the GIL: ``probe_background`` with a thread calling ``poll`` (e.g. an
    ``NvmlPoller``'s ``poll``; call it once first, for the lookups) every ``every`` seconds as the running variant.
    Keys: ``stalled`` (variant -> ms stalled a second, a round each), ``polls`` (in the measured spans),
    ``per_poll_ns`` (the median round's added stall over the polls a second)."""
    polling = _Polling(poll, every)
    probed = probe_background(polling.set, rounds, seconds)
    polling.set(False)
    stalled: dict[str, list[float]] = {"no poller": [], "polling": []}
    polls = 0
    for got in probed:
        for variant, key in (("stopped", "no poller"), ("running", "polling")):
            stalls, (t0, t1) = got[variant]
            stalled[key].append(sum(ns for _, ns in stalls) / (t1 - t0) / 1e6)
        r0, r1 = got["running"][1]
        polls += sum(r0 <= t <= r1 for t in polling.times)
    added = statistics.median(p - n for p, n in zip(stalled["polling"], stalled["no poller"], strict=True))
    rate = polls / (rounds * seconds)
    return {"stalled": stalled, "polls": polls, "per_poll_ns": added * 1e6 / rate if rate else float("nan")}


def poll_schedule(reads: Sequence[float], *, seconds: float = 3600.0,
                  interval: float | None = None) -> dict[str, float]:
    """The NVML poller's own schedule for readers reading at ``reads`` (seconds from start) over ``seconds``
    (``perfmon.testing.DrivenPoller``, the configured default interval unless ``interval``), over the second half
    (the readers' pattern known). Keys: ``per_s`` (polls a second), ``age_median`` and ``age_max`` (seconds: how
    old the reading a read got was)."""
    # Imported here: perfmon.testing (the fakes) in every benchmark's process would grow its heap, and a bigger heap
    # makes each garbage collection the agent's threads trigger longer, which the GIL-stall probe reads as the
    # agent's (+0.05..+0.1% in A/B runs of the probe with and without the import).
    from perfmon.config import Config
    from perfmon.testing import DrivenPoller

    driven = DrivenPoller(interval_seconds=interval if interval is not None else Config().nvml_interval_seconds)
    driven.run(seconds, reads=reads)
    ages = [age for t, age in driven.ages if t >= seconds / 2] or [float("nan")]
    return {"per_s": driven.polls_between(seconds / 2, seconds) / (seconds / 2), "age_median": statistics.median(ages),
            "age_max": max(ages)}


#: A scrape's window in ``background_share``: from this long before the scraper read its answer to 5 ms after.
SCRAPE_WINDOW_S = 0.1


def probe_background(set_running: Callable[[bool], object], rounds: int, seconds: float) -> list[dict[str, Any]]:
    """``gil_stalls`` for ``seconds`` beside the monitor stopped and running (``set_running``), in a shuffled order,
    ``rounds`` times, each after a 0.5 s settle: one dict a round, variant -> (its stalls, its ``time.time()`` span),
    for ``background_share``."""
    out: list[dict[str, Any]] = []
    for _ in range(rounds):
        got: dict[str, Any] = {}
        for variant in random.sample(["stopped", "running"], 2):
            set_running(variant == "running")
            time.sleep(0.5)
            t0 = time.time()
            got[variant] = (gil_stalls(seconds), (t0, time.time()))
        out.append(got)
    return out


def background_share(rounds: list[dict[str, Any]], scrape_ends: Sequence[float],
                     scrape_every: float = 15.0) -> dict[str, float]:
    """What ``probe_background`` read, as shares of a serving thread's time.

    A scrape's stalls (those in its window: ``SCRAPE_WINDOW_S`` before the scraper read its answer, ``scrape_ends`` in
    ``time.time()``) are summed over the scrapes whose answer came in a running slot, less what the stopped slots
    stalled in as long, and charged at one every ``scrape_every`` seconds (the benchmark's scraper calls more often, so
    that several fall in the running slots). The rest is the agent's threads' own: per round, running minus stopped
    (a stall the host causes lands in one slot of one round), the median over rounds. Keys: ``stopped`` and
    ``running`` (medians, stalled ns a ns, scrapes apart), ``wakes`` (the median of running minus stopped, which the
    host's noise can make negative), ``per_scrape`` (ns), ``scrapes``, ``background`` (a bound: ``wakes`` at least 0,
    plus the scrapes' share)."""
    window = SCRAPE_WINDOW_S + 0.005

    def at_scrape(when: float) -> bool:
        return any(e - SCRAPE_WINDOW_S <= when <= e + 0.005 for e in scrape_ends)

    stopped, running, diffs = [], [], []
    scraped = seen = 0.0
    for got in rounds:
        (s_stalls, (s0, s1)), (r_stalls, (r0, r1)) = got["stopped"], got["running"]
        stop = sum(ns for _, ns in s_stalls) / ((s1 - s0) * 1e9)
        run = sum(ns for when, ns in r_stalls if not at_scrape(when)) / ((r1 - r0) * 1e9)
        stopped.append(stop)
        running.append(run)
        diffs.append(run - stop)
        scraped += sum(ns for when, ns in r_stalls if at_scrape(when))
        seen += sum(1 for e in scrape_ends if r0 <= e <= r1 + 0.005)
    host = statistics.median(stopped) * window * 1e9 if stopped else 0.0  # what a window stalls anyway
    per_scrape = max(0.0, scraped / seen - host) if seen else 0.0
    wakes = statistics.median(diffs)
    return {"stopped": statistics.median(stopped), "running": statistics.median(running), "wakes": wakes,
            "per_scrape": per_scrape, "scrapes": seen,
            "background": max(0.0, wakes) + per_scrape / (scrape_every * 1e9)}


class Running:
    """A monitor started and stopped between variants (``running``: whether it is now); ``set`` says whether it
    switched (a start's own work settles before a variant is measured)."""

    def __init__(self, mon: perfmon.Monitor, running: bool = True) -> None:
        self.mon, self.running = mon, running

    def set(self, want: bool) -> bool:
        if want == self.running:
            return False
        self.mon.start() if want else self.mon.stop()
        self.running = want
        return True


class Wrapping:
    """One module wrapped and unwrapped between variants, in place (``Monitor.unwrap`` restores its class; wrapped
    again under the same name, its counters continue). Two copies instead (one bare, one wrapped) would differ by
    their objects' places in memory alone: two wrapped copies of one Linear(64,64), same code, read +309 and +425 ns
    a call added; two bare GPT-2 twins ±9 µs a token. ``settle``, when given, runs after each switch (unmeasured
    calls: a class switch leaves CPython's specialised attribute reads on the old class until they miss
    ``SETTLE_EXECUTIONS`` times, and a new wrap times its first call in full)."""

    def __init__(self, mon: perfmon.Monitor, module: Any, name: str, *, device: str = "auto",
                 settle: Callable[[], Any] | None = None) -> None:
        self.mon, self.module, self.name, self.device, self.settle = mon, module, name, device, settle
        self.wrapped = False

    def set(self, want: bool) -> None:
        if want == self.wrapped:
            return
        if want:
            self.mon.wrap(self.module, name=self.name, device=self.device)
        else:
            self.mon.unwrap(self.module)
        self.wrapped = want
        if self.settle is not None:
            self.settle()


class Waker:
    """The calibration: a plain Python thread waking every ``interval`` seconds and doing nothing, for the serving
    time one background switch costs (the issue measured +4.8% for one at 1 ms, +0.0% at 50 ms)."""

    def __init__(self, interval: float = 0.001) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), name="bench-waker", daemon=True)
        self._thread.start()

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def quiet_ratio_bounds(vals: Sequence[float], base: Sequence[float], *, draws: int = 1000,
                       seed: int = 0) -> tuple[float, float]:
    """The 5th and 95th percentiles of the quiet-block ratio (``vals``' 10th-percentile block over ``base``'s) over
    ``draws`` bootstrap resamples of the slots, paired by index (a round's slots share the host's moment).

    A verdict on the ratio itself reads one draw of the host's noise: on the lent GPUs a x1.005 target sat inside
    an A/A's ±0.7-2%, so a single A/A slot's distance from x1 is no measure of the noise either. A lower bound
    above the target says the slowdown is there at 95% whatever the host did; a bound straddling it says the
    direct timing cannot tell, and the modelled bound decides."""
    n = len(vals)
    if n != len(base) or n < 2:
        raise ValueError(f"quiet_ratio_bounds: {n} and {len(base)} blocks, paired, at least 2 each")
    rng = random.Random(seed)
    k = max(0, n // 10 - 1)  # the 10th-percentile block of a resample (the least under 20: a --quick run's few)
    ratios = []
    for _ in range(draws):
        idx = [rng.randrange(n) for _ in range(n)]
        ratios.append(sorted(vals[i] for i in idx)[k] / sorted(base[i] for i in idx)[k])
    ratios.sort()
    return ratios[int(0.05 * draws)], ratios[min(draws - 1, int(0.95 * draws))]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Scraper:
    """GET ``url()/metrics`` every ``period`` seconds while the monitor serves (a Prometheus at its default
    cadence; ``url()`` None: not serving now, skipped). Stopped by ``stop()``."""

    def __init__(self, url: Callable[[], str | None], period: float = 15.0) -> None:
        self._url, self._period = url, period
        self._stop = threading.Event()
        self.scrapes = 0
        self._thread = threading.Thread(target=self._run, name="bench-scraper", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            url = self._url()
            if url is None:
                continue
            try:
                urllib.request.urlopen(f"{url}/metrics", timeout=10).read()
                self.scrapes += 1
            except OSError:
                pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=15)


#: Times each line of a decode step runs after a switch of the model's class before a call is measured. CPython 3.11
#: specialises an attribute read on ``self`` (``self.prepare_inputs_for_generation``, ``self.config``...) for the
#: class it saw; after a switch to another class each such read misses and runs the generic path until 53 misses
#: have re-specialised it. One call of 32 tokens after a switch left the next call paying those misses on ~20 of its
#: steps: an empty subclass of the model (no code of its own) read +0.6..+1.1 µs a step against bare that way, and
#: +0.1..+0.3 after three calls (BENCHMARKS §3b, session 20). In production a model keeps one class.
SETTLE_EXECUTIONS = 60


def settle_calls(tokens: int) -> int:
    """Unmeasured ``generate()`` calls after a switch: enough for every decode-step line to run ``SETTLE_EXECUTIONS``
    times, plus one (the first call of a new wrap is timed in full: ``CallSampler``)."""
    return 1 + -(-SETTLE_EXECUTIONS // max(1, tokens - 1))


def tiny_gpt2() -> Any:
    """The benchmarks' tiny random GPT-2 (2 layers, d=64, a 1,000-token vocabulary), in eval mode, one torch thread,
    transformers' logging at errors only."""
    import transformers

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=128, bos_token_id=0,
                                  eos_token_id=1)
    return transformers.GPT2LMHeadModel(cfg).eval()


def stamp_method(cls: type, name: str, stamps: list[int]) -> Callable[[], None]:
    """Replace ``cls.<name>`` with a wrapper that appends ``perf_counter_ns()`` to ``stamps`` at its start and at its
    return (``functools.wraps``: the signature stays, so perfmon still finds a model generative); returns what puts
    the original back."""
    import functools

    original = getattr(cls, name)
    stamp, clock = stamps.append, time.perf_counter_ns

    @functools.wraps(original)
    def stamped(self: Any, *a: Any, **k: Any) -> Any:
        stamp(clock())
        out = original(self, *a, **k)
        stamp(clock())
        return out

    setattr(cls, name, stamped)
    return lambda: setattr(cls, name, original)
