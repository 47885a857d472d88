"""The agent wakes only when there is work: each background wake costs a GIL-bound server's serving thread."""

from __future__ import annotations

import time
import urllib.request

import torch

from .conftest import hist_count, value, wait_until


def test_an_idle_agent_stays_quiet_and_counts_its_wakes(make_monitor) -> None:
    """Started, no traffic: the resolver wakes about once a second (it used to wake every 50 ms, 20 a
    second), and perfmon_agent_wakeups_total says so."""
    mon = make_monitor(port=0).start()
    wait_until(lambda: (value(mon, "perfmon_agent_wakeups_total", thread="resolver") or 0) >= 1, timeout=10,
               what="the resolver's first wake")
    first = value(mon, "perfmon_agent_wakeups_total", thread="resolver")
    t0 = time.monotonic()
    wait_until(lambda: time.monotonic() - t0 >= 3.0, timeout=10, what="3 s")  # a span to count over
    woke = value(mon, "perfmon_agent_wakeups_total", thread="resolver") - first
    assert 1 <= woke <= 8, woke  # ~3 at 1/s; 60 at the old 50 ms cadence
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
