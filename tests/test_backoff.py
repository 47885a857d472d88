"""perfmon.backoff: the one retry schedule, and the three schedules it stands for."""

from __future__ import annotations

import pytest

from perfmon.backoff import backoff_seconds


def test_doubles_from_initial_up_to_the_cap() -> None:
    """The delay starts at ``initial``, doubles per failure and stays at ``cap``."""
    delays = [backoff_seconds(n, initial=1.0, cap=300.0) for n in range(1, 12)]
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 300.0, 300.0]


def test_jitter_scales_the_delay_by_half_to_whole() -> None:
    """A draw of 0 halves the delay, 1 leaves it whole, and a draw out of 0..1 is clamped."""
    assert backoff_seconds(3, initial=1.0, cap=300.0, jitter=0.0) == 2.0
    assert backoff_seconds(3, initial=1.0, cap=300.0, jitter=0.5) == 3.0
    assert backoff_seconds(3, initial=1.0, cap=300.0, jitter=1.0) == 4.0
    assert backoff_seconds(3, initial=1.0, cap=300.0, jitter=-7.0) == 2.0
    assert backoff_seconds(3, initial=1.0, cap=300.0, jitter=7.0) == 4.0


def test_a_long_outage_never_overflows() -> None:
    """Millions of consecutive failures still give the cap, not an OverflowError."""
    assert backoff_seconds(10**7, initial=0.02, cap=60.0) == 60.0


@pytest.mark.parametrize("interval", [0.02, 0.1, 1.0, 3.0, 7.5])
def test_reproduces_the_nvml_pollers_schedule(interval: float) -> None:
    """The NVML poller's call gives exactly its former min(interval * 2**failures, 60 s)."""
    for failures in range(1, 40):
        expected = min(interval * 2**failures, 60.0)
        assert backoff_seconds(failures, initial=2 * interval, cap=60.0) == expected


def test_reproduces_the_agent_ports_rebind_schedule() -> None:
    """The port rebind's call gives exactly its former min(30 s, 2**min(n - 1, 5) s)."""
    for n in range(1, 100):
        assert backoff_seconds(n, initial=1.0, cap=30.0) == min(30.0, 2.0 ** min(n - 1, 5))


def test_reproduces_the_uploaders_schedule() -> None:
    """The uploader's call gives min(cap, initial * 2**(n - 1)) * (0.5 + 0.5 * draw), as before."""
    for n in range(1, 70):
        for draw in (0.0, 0.25, 0.999, 1.0):
            expected = min(300.0, 1.0 * 2.0 ** min(n - 1, 60)) * (0.5 + 0.5 * draw)
            assert backoff_seconds(n, initial=1.0, cap=300.0, jitter=draw) == expected


def test_reproduces_the_fleet_listings_read_retries() -> None:
    """The listing's pauses between its three reads stay 0.5 s then 1 s (formerly 0.5 s x attempt)."""
    from perfmon.store.remote import LIST_READ_TRIES, LIST_RETRY_SECONDS

    assert LIST_READ_TRIES == 3
    for attempt in range(1, LIST_READ_TRIES):
        assert backoff_seconds(attempt, initial=LIST_RETRY_SECONDS, cap=5.0) == LIST_RETRY_SECONDS * attempt
