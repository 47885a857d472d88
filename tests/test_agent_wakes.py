"""The agent wakes only when there is work: each background wake costs a GIL-bound server's serving thread."""

from __future__ import annotations

import time
import urllib.request

import pytest
import torch

import perfmon

from .conftest import hist_count, value, wait_until


def test_an_idle_agent_stays_quiet_and_counts_its_wakes(make_monitor) -> None:
    """Started, a model wrapped, no traffic: the resolver finds nothing to do and dozes (up to ``doze_seconds``,
    8 s), so over the next 3 s at a 50 ms idle cadence (60 wakes without dozing; it used to wake every 50 ms whatever
    there was, then once a second) it wakes at most once; perfmon_agent_wakeups_total says so."""
    import gc

    mon = make_monitor(port=0)
    mon.wrap(torch.nn.Linear(4, 4), name="m")
    mon.resolver.idle_seconds = 0.05
    gc.collect()
    gc.disable()  # nothing to do means no collections either: a pass that drains GC pauses is work (below)
    try:
        mon.start()
        wait_until(lambda: mon.resolver.doze.dozing, timeout=10, what="the resolver dozing after a quiet pass")
        first = value(mon, "perfmon_agent_wakeups_total", thread="resolver")
        assert first >= 1
        t0 = time.monotonic()
        wait_until(lambda: time.monotonic() - t0 >= 3.0, timeout=10, what="3 s")  # a span to count over
        woke = value(mon, "perfmon_agent_wakeups_total", thread="resolver") - first
    finally:
        gc.enable()
    assert woke <= 1, woke
    assert value(mon, "perfmon_agent_wakeups_total", thread="http") is not None


def test_a_filling_queue_wakes_the_resolver_from_its_idle_sleep(make_monitor) -> None:
    """Timed calls that fill a quarter of the queue wake the resolver at once, however long its idle sleep."""
    mon = make_monitor(sample_rate=1.0, queue_size=64)
    mon.resolver.idle_seconds = 3600.0  # asleep for an hour once idle: only the hot path's wake can drain it
    mon.start()
    model = mon.wrap(torch.nn.Linear(4, 4), name="m")
    wait_until(lambda: (value(mon, "perfmon_agent_wakeups_total", thread="resolver") or 0) >= 1, timeout=10,
               what="the resolver's first wake (then it sleeps)")
    for _ in range(40):  # a quarter of the queue is 16
        model(torch.ones(1, 4))
    wait_until(lambda: mon.resolver.pending == 0, timeout=10, what="the queue drained by a woken resolver")
    assert (value(mon, "perfmon_samples_dropped_total", model="m", reason="queue_full") or 0) == 0
    assert hist_count(mon, "m", "steady") + hist_count(mon, "m", "cold") == 40  # every call timed, resolved


def test_the_resolver_wakes_for_the_next_sampling_floor(make_monitor) -> None:
    """A model whose last timed call was just now has its floor due a floor later: the resolver's idle sleep
    ends then, not at its one-second cadence, so a low-traffic model keeps a timed call a second."""
    mon = make_monitor(sample_rate=0.001, warmup_calls=1, sample_floor_seconds=0.4)
    model = mon.wrap(torch.nn.Linear(4, 4), name="m")
    for _ in range(3):
        model(torch.ones(1, 4))  # the cold call is timed; the next ones are not (0.1% sampling)
    mon.flush()
    (st,) = mon.models.states()
    assert st.next_index > 0  # not armed: its floor is still ahead
    assert mon.resolver.floor_due_ns == st.last_sample_ns + int(0.4e9)


def test_an_idle_http_loop_sleeps_until_a_socket_wants_it(make_monitor) -> None:
    """No connection held, nothing queued: the HTTP loop sleeps until a socket (it used to wake every second to
    check deadlines that no connection had); a request still gets its answer at once, and the loop sleeps again."""
    mon = make_monitor(port=0).start()

    def wakes() -> float:
        return value(mon, "perfmon_agent_wakeups_total", thread="http") or 0

    wait_until(lambda: wakes() >= 1, timeout=10, what="the HTTP loop's first turn")
    # Start-up settled: no wake for 1.2 s (the old loop woke every second, so it never got here). A loaded machine
    # can leave the first turns' CPU as triage debt, which the loop pauses off in slices for a while (it did once).
    seen = {"wakes": wakes(), "since": time.monotonic()}

    def quiet() -> bool:
        now = wakes()
        if now != seen["wakes"]:
            seen.update(wakes=now, since=time.monotonic())
        return time.monotonic() - seen["since"] >= 1.2

    wait_until(quiet, timeout=20, what="1.2 s without a wake of the idle HTTP loop")
    first = wakes()
    t0 = time.monotonic()
    wait_until(lambda: time.monotonic() - t0 >= 2.5, timeout=10, what="2.5 s")  # a span to count over
    assert wakes() == first  # the old loop: 2-3 wakes here
    with urllib.request.urlopen(f"{mon.url}/healthz", timeout=10) as response:
        assert response.status == 200
    # A turn is counted when it begins (before its wait): the turn after the answer counts this wake, a moment after
    # the client has its response (a fresh clone's run read the counter first).
    wait_until(lambda: wakes() > first, timeout=10, what="the wake that answered the request, counted")


def timed(mon) -> int:
    """Timed calls of model ``m`` resolved so far, cold and steady."""
    return hist_count(mon, "m", "cold") + hist_count(mon, "m", "steady")


def _dozing_for_an_hour(mon) -> None:
    """Start the monitor with its resolver's doze an hour long: after its first (quiet) pass only a wake (a record, a
    capture armed, a reader) or work falling due ends its sleep."""
    mon.resolver.doze.seconds = 3600.0
    mon.start()
    wait_until(lambda: mon.resolver.doze.dozing, timeout=30, what="the resolver dozing after its first quiet pass")


@pytest.mark.parametrize("record", ["timed call", "generation", "request span"])
def test_a_dozing_resolver_wakes_for_the_first_record_of_each_queue(make_monitor, record: str) -> None:
    """Dozing for an hour: one timed call, one generation request or one request span is resolved at once (each
    queue's first record wakes the resolver), and the usual cadence resumes."""
    # Sampling every call, but for the span: its call untimed (its cold call before), so only the span's record wakes.
    rate = 1e-6 if record == "request span" else 1.0
    mon = make_monitor(sample_rate=rate, warmup_calls=0, sample_floor_seconds=3600, resolve_interval_seconds=0.01)
    model = mon.wrap(torch.nn.Linear(4, 4), name="m")
    model(torch.ones(1, 4))  # the shape's cold call: timed
    _dozing_for_an_hour(mon)
    woke = value(mon, "perfmon_agent_wakeups_total", thread="resolver")
    if record == "timed call":
        model(torch.ones(1, 4))
        wait_until(lambda: timed(mon) == 2, timeout=30, what="the timed call resolved")
    elif record == "generation":
        with mon.generation("chat", prompt_tokens=3) as g:
            g.token()
            g.token()
        wait_until(lambda: (value(mon, "perfmon_time_to_first_token_seconds_count", model="chat") or 0) == 1,
                   timeout=30, what="the generation's records drained")
    else:
        with mon.request():
            model(torch.ones(1, 4))
        wait_until(lambda: mon.requests.recent("m", 0)["total"]["count"], timeout=30, what="the span drained")
        assert timed(mon) == 1  # the call inside was not timed: the span's record woke the resolver
    assert value(mon, "perfmon_agent_wakeups_total", thread="resolver") > woke


def test_a_dozing_resolver_still_closes_a_window_when_it_ends(make_monitor) -> None:
    """The detector's windows close on time with nothing arriving: the resolver's doze ends when the next
    window does (``Detector.due_ns``), so a regression is never judged late because traffic paused."""
    policy = perfmon.RegressionPolicy(window_seconds=0.5, min_samples=5, baseline_windows=3)
    mon = make_monitor(sample_rate=1.0, warmup_calls=0, regression=policy, resolve_interval_seconds=0.01,
                       sample_floor_seconds=3600)  # no floor to wake for: only the window's end
    model = mon.wrap(torch.nn.Linear(4, 4), name="m")
    model(torch.ones(1, 4))  # the shape's cold call: the detector's series begins with the first steady sample below
    _dozing_for_an_hour(mon)
    mon.resolver.idle_seconds = 1000.0  # not even the idle cadence: only the window's end (or a record) wakes it
    closed = mon.detector.windows_closed
    for _ in range(10):  # one window's worth of samples, then nothing; those after the first wait for the window's end
        model(torch.ones(1, 4))  # (with under min_samples in the woken pass, for 6 windows: the longest a window lasts)
    wait_until(lambda: timed(mon) == 11, timeout=30, what="the samples resolved")
    wait_until(lambda: mon.detector.windows_closed > closed, timeout=30,
               what="the window closed at its end (0.5 s), the resolver dozing for an hour otherwise")


def test_a_capture_armed_while_the_resolver_dozes_still_expires(make_monitor) -> None:
    """Arming wakes the resolver, which then keeps its usual cadence while a capture is armed: an armed capture
    with no call of its model expires after ``capture_arm_timeout_seconds``, not after the doze."""
    mon = make_monitor(capture_arm_timeout_seconds=0.2, resolve_interval_seconds=0.01)
    mon.wrap(torch.nn.Linear(4, 4), name="m")
    _dozing_for_an_hour(mon)
    mon.resolver.idle_seconds = 0.05
    cap = mon.capture("m")
    meta = wait_until(lambda: (mon.profile(cap["id"]) or {}).get("outcome") and mon.profile(cap["id"]), timeout=20,
                      what="the armed capture's expiry")
    assert meta["outcome"] == "aborted" and "no call" in meta["error"]


def test_opening_the_status_page_wakes_a_dozing_resolver_for_its_history(make_monitor) -> None:
    """Someone starts reading /stats (the status page): the resolver, dozing, wakes and records the page's
    history points every 2 s while they look."""
    mon = make_monitor(resolve_interval_seconds=0.01)
    model = mon.wrap(torch.nn.Linear(4, 4), name="m")
    model(torch.ones(1, 4))
    _dozing_for_an_hour(mon)
    mon.resolver.idle_seconds = 0.05
    mon.stats()
    wait_until(lambda: mon.history.series()["models"].get("m"), timeout=30,
               what="a history point (two records 2 s apart) while the resolver would otherwise doze")


def test_collections_keep_the_resolver_at_its_cadence(make_monitor) -> None:
    """A GC pause is work (its histogram, the calls it overlapped): a pass that drained pauses is not quiet, so
    while the process collects the resolver keeps its idle cadence rather than dozing, and its pause ring (4,096)
    fills no faster than before."""
    import gc

    mon = make_monitor()
    mon.resolver.idle_seconds, mon.resolver.doze.seconds = 0.05, 3600.0
    mon.start()
    first = value(mon, "perfmon_agent_wakeups_total", thread="resolver") or 0
    woke, deadline = 0.0, time.monotonic() + 20.0
    # Collections all along until 5 wakes (~0.25 s at 50 ms) or 20 s: a deadline, not a window a loaded host might
    # starve. A pass with pauses counted as quiet dozes for the hour: 1 wake in the 20 s.
    while woke < 5 and time.monotonic() < deadline:
        for _ in range(100):
            gc.collect(0)
        woke = value(mon, "perfmon_agent_wakeups_total", thread="resolver") - first
    assert woke >= 5, woke
    assert (value(mon, "perfmon_gc_pause_seconds_count", generation="0") or 0) >= 5  # and drained as they came


def test_collections_that_begin_during_a_doze_are_all_counted(make_monitor) -> None:
    """The collection hook cannot wake the resolver (it takes no lock): pauses that begin while it dozes wait in the
    ring for its next pass, which holds 8 s of them at 4,096 a second. 6,000 collections with the resolver asleep
    (the old ring of 4,096 lost a third of them) are every one counted by the next pass."""
    import gc

    mon = make_monitor()
    _dozing_for_an_hour(mon)
    before = value(mon, "perfmon_gc_pause_seconds_count", generation="0") or 0
    for _ in range(6000):
        gc.collect(0)
    assert mon.resolver.doze.dozing  # nothing woke it: the pauses wait in the ring
    mon.flush()  # the next pass, on this thread
    assert (value(mon, "perfmon_gc_pause_seconds_count", generation="0") or 0) - before >= 6000


def test_the_doze_sleep_ends_at_the_work_due() -> None:
    """``Doze.sleep``: the idle cadence, or ``seconds`` after a quiet pass; never past a future due; a sampling floor
    that fell due since the pass is armed at the next poll, while a housekeeping due already past (work the pass did)
    keeps the idle cadence; thresholds drop only when it sleeps past the idle cadence, and a record already waiting
    ends the doze before it starts."""
    from time import perf_counter_ns

    from perfmon.agent.doze import Doze
    from perfmon.faults import InternalErrors

    switched: list[bool] = []
    waiting = [False]

    def dozer(on: bool) -> bool:
        switched.append(on)
        return waiting[0]

    doze = Doze([dozer], internal=InternalErrors(), seconds=8.0)
    now = perf_counter_ns()
    assert doze.sleep(1.0, 0.05, None, None) == 1.0 and switched == []  # no quiet pass yet
    doze.passed(True)
    assert doze.sleep(1.0, 0.05, None, None) == 8.0 and switched == [True] and doze.dozing
    assert 2.0 < doze.sleep(1.0, 0.05, None, now + int(3e9)) <= 3.0  # a window's end in 3 s
    assert doze.sleep(1.0, 0.05, now - 1_000_000, None) == 0.05  # a floor just past: arm it now
    assert doze.sleep(1.0, 0.05, None, now - 1_000_000) == 1.0  # the pass's own work: the idle cadence
    waiting[0] = True
    assert doze.sleep(1.0, 0.05, None, None) == 0.05 and not doze.dozing and switched[-1] is False
    doze.passed(False)
    assert not doze.quiet and doze.sleep(1.0, 0.05, None, None) == 1.0


def test_a_doze_ended_by_a_wake_lingers_for_a_few_wakes() -> None:
    """``Doze.woke``: a doze ended by a wake keeps the thresholds at one for ``LINGER_WAKES`` more wakes (the request
    that ended it queues more as it ends), each using one; a lingering wait that runs out with nothing come ends the
    lingering, and so does a doze that ends at its work due rather than by a wake."""
    from perfmon.agent.doze import LINGER_WAKES, Doze
    from perfmon.faults import InternalErrors

    switched: list[bool] = []

    def dozer(on: bool) -> bool:
        switched.append(on)
        return False

    doze = Doze([dozer], internal=InternalErrors(), seconds=8.0)
    doze.passed(True)
    assert doze.sleep(1.0, 0.05, None, None) == 8.0 and doze.dozing
    doze.woke(True)  # a record ended the doze
    assert not doze.dozing and doze.linger == LINGER_WAKES
    doze.passed(False)  # the woken pass had work: the idle cadence, thresholds still at one
    for left in range(LINGER_WAKES, 0, -1):
        assert doze.sleep(1.0, 0.05, None, None) == 1.0 and doze.dozing and switched[-1] is True
        doze.woke(True)
        assert doze.linger == left - 1 and switched[-1] is False
    assert doze.sleep(1.0, 0.05, None, None) == 1.0 and not doze.dozing  # spent: the usual thresholds
    doze.passed(True)
    doze.sleep(1.0, 0.05, None, None)
    doze.woke(True)
    doze.passed(False)
    assert doze.sleep(1.0, 0.05, None, None) == 1.0 and doze.dozing
    doze.woke(False)  # the lingering wait ran out: nothing came
    assert doze.linger == 0 and doze.sleep(1.0, 0.05, None, None) == 1.0 and not doze.dozing
    doze.passed(True)
    doze.sleep(1.0, 0.05, None, None)
    doze.woke(False)  # the doze ended at its work due, not by a wake: no lingering
    assert doze.linger == 0


def test_the_request_that_ends_a_doze_has_its_later_records_resolved_at_once(make_monitor) -> None:
    """Dozing for an hour with an hour's idle cadence: a request whose timed call ends the doze queues its span's
    record as it ends, after the woken pass; the doze's lingering wakes for it (without it, it waited for the next
    tick: ~1 s at the default cadence, an hour here). The lingering ends after ``LINGER_WAKES`` wakes."""
    from perfmon.agent.doze import LINGER_WAKES

    mon = make_monitor(sample_rate=1.0, warmup_calls=0, sample_floor_seconds=3600, resolve_interval_seconds=0.01)
    model = mon.wrap(torch.nn.Linear(4, 4), name="m")
    model(torch.ones(1, 4))  # the shape's cold call
    _dozing_for_an_hour(mon)
    mon.resolver.idle_seconds = 3600.0
    with mon.request():
        model(torch.ones(1, 4))  # timed: its record ends the doze
        wait_until(lambda: timed(mon) == 2, timeout=30, what="the timed call resolved")
    wait_until(lambda: mon.requests.recent("m", 0)["total"]["count"], timeout=30,
               what="the span's record, queued after the woken pass, resolved")
    doze = mon.resolver.doze
    calls = 0
    while doze.linger and calls <= LINGER_WAKES:  # each lingering wake resolves its record at once, then it ends
        model(torch.ones(1, 4))
        calls += 1
        wait_until(lambda c=calls: timed(mon) == 2 + c, timeout=30, what="a record resolved while lingering")
    assert doze.linger == 0 and calls <= LINGER_WAKES


def test_calls_since_the_last_pass_keep_it_from_counting_as_quiet(make_monitor) -> None:
    """Traffic, however light, is no quiet spell: a pass after calls that timed nothing (1 in a million, no floor)
    is not quiet, so the resolver keeps its cadence rather than dozing and having the next timed call wake it at
    once (a helper read ~2 wakes a second at 10-60 calls a second, not the documented ~1); the pass after a spell
    with no call is quiet again."""
    import gc

    mon = make_monitor(sample_rate=1e-6, warmup_calls=0, sample_floor_seconds=3600)
    model = mon.wrap(torch.nn.Linear(4, 4), name="m")
    doze = mon.resolver.doze
    gc.collect()
    gc.disable()  # a pass that drains a GC pause is not quiet either: none here
    try:
        model(torch.ones(1, 4))  # the shape's cold call: timed
        mon.flush()
        mon.resolver.step()
        assert doze.quiet  # nothing since
        for _ in range(3):
            model(torch.ones(1, 4))  # untimed
        mon.resolver.step()
        assert not doze.quiet
        assert timed(mon) == 1  # no record: the calls alone made the pass busy
        mon.resolver.step()
        assert doze.quiet
    finally:
        gc.enable()


def test_a_floor_due_before_the_next_tick_is_armed_at_this_pass(make_monitor) -> None:
    """A sampling floor that falls due within a quarter of a floor (at most the idle tick) is armed by the pass that
    sees it, not by a wake of its own a moment later: with the floor and the tick both a second, every tick used to
    be followed by that extra wake. One due later than that waits for its own time."""
    mon = make_monitor(sample_rate=1e-6, warmup_calls=1, sample_floor_seconds=4.0)
    model = mon.wrap(torch.nn.Linear(4, 4), name="m")
    model(torch.ones(1, 4))  # the warm-up call: timed
    mon.flush()
    (st,) = mon.models.states()
    last = st.last_sample_ns
    mon.resolver.step(now_ns=last + int(2.5e9))  # 1.5 s before the floor: more than its quarter (1 s, the tick)
    model(torch.ones(1, 4))
    mon.flush()
    assert hist_count(mon, "m", "steady") == 0
    mon.resolver.step(now_ns=last + int(3.2e9))  # 0.8 s before it: armed now
    model(torch.ones(1, 4))
    mon.flush()
    assert hist_count(mon, "m", "steady") == 1


def _voluntary_switches(thread) -> int:
    """The OS's count of the times ``thread`` blocked (each wake of a sleeping thread is one): ground truth taken
    apart from perfmon's own counter."""
    with open(f"/proc/self/task/{thread.native_id}/status") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    raise AssertionError("no voluntary_ctxt_switches line")


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/task"), reason="reads Linux's /proc")
def test_an_idle_health_port_sleeps_until_a_probe_comes(make_monitor) -> None:
    """The health port's thread (``health_port``, set by the shipped Kubernetes deployment) sleeps until a socket
    wants it: it used to wake 4 times a second (a 0.25 s select timeout) and count none of it. A probe wakes it, and
    perfmon_agent_wakeups_total{thread="health"} counts that; stop() still ends the thread at once."""
    import threading

    mon = make_monitor(port=0, health_port=0).start()
    (thread,) = [t for t in threading.enumerate() if t.name == "perfmon-health"]
    url = mon.health_url
    assert url is not None

    def wakes() -> float:
        return value(mon, "perfmon_agent_wakeups_total", thread="health") or 0

    seen = {"n": _voluntary_switches(thread), "since": time.monotonic()}

    def quiet() -> bool:  # 1.5 s in which the OS saw the thread block no more
        n = _voluntary_switches(thread)
        if n != seen["n"]:
            seen.update(n=n, since=time.monotonic())
        return time.monotonic() - seen["since"] >= 1.5

    wait_until(quiet, timeout=20, what="1.5 s without a wake of the idle health thread (the old loop: 6)")
    first = wakes()
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
    wait_until(lambda: wakes() > first, timeout=10, what="the probe's wake, counted")
    mon.stop()
    assert not thread.is_alive()  # stop() woke it: the loop has no timeout to notice it by
