"""Agent faults are counted and logged once; they never reach the caller's request."""

from __future__ import annotations

import contextlib
import io
import json

import torch

from perfmon.logs import LineWriter, make_logger
from perfmon.testing import FakeCuda, FakeGpu, GpuWork, event_pairs_in_flight

from .conftest import value, wait_until


def test_backend_failure_never_reaches_the_request(make_monitor) -> None:
    """If the CUDA backend raises while timing, the call still returns its result and the fault is counted."""
    gpu = FakeGpu()
    backend = FakeCuda(gpu)

    def broken(device_index: int) -> object:
        raise RuntimeError("driver exploded")

    backend.current_stream = broken  # type: ignore[method-assign]
    mon = make_monitor(cuda=backend, sample_rate=1.0)
    model = mon.wrap(GpuWork(gpu, ms=1.0), name="m", device="cuda:0")
    x = torch.ones(2)
    for _ in range(5):
        assert torch.equal(model(x), x)
    assert value(mon, "perfmon_forward_calls_total", model="m") == 5
    assert value(mon, "perfmon_internal_errors_total", stage="instrument") == 5
    assert event_pairs_in_flight(mon) == 0  # the pair taken before the failure went back


def test_failing_sink_is_counted_and_others_still_run(make_monitor) -> None:
    """A sink that raises is counted under stage 'sink'; the histograms still get the sample."""
    mon = make_monitor(sample_rate=1.0)

    def bad_sink(sample: object) -> None:
        raise KeyError("sink bug")

    mon.resolver.sinks.insert(0, bad_sink)
    model = mon.wrap(torch.nn.Linear(2, 2), name="m")
    model(torch.ones(1, 2))
    mon.flush()
    assert value(mon, "perfmon_internal_errors_total", stage="sink") == 1
    assert value(mon, "perfmon_forward_duration_seconds_count", model="m", device="cpu", phase="cold") == 1


def test_full_queue_drops_and_counts_without_blocking(make_monitor) -> None:
    """With the resolver stalled, samples beyond queue_size are dropped as queue_full; calls go on."""
    mon = make_monitor(sample_rate=1.0, queue_size=5)
    model = mon.wrap(torch.nn.Linear(2, 2), name="m")
    for _ in range(12):
        model(torch.ones(1, 2))
    assert value(mon, "perfmon_samples_dropped_total", model="m", reason="queue_full") == 7
    assert value(mon, "perfmon_forward_calls_total", model="m") == 12
    assert mon.stats()["pending_samples"] == 5  # all still queued: the resolver never ran


def test_internal_errors_logged_once_per_kind() -> None:
    """The same fault repeated 100 times produces one log line and a count of 100."""
    from perfmon.faults import InternalErrors

    out = io.StringIO()
    log = make_logger("json", "info", component="resolver", stream=out)
    faults = InternalErrors()
    for _ in range(100):
        faults.report("sink", KeyError("x"))
    faults.report("sink", ValueError("y"))
    faults.log_new(log)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    kinds = [(e["event"], e["error"]) for e in lines]
    assert kinds == [("internal_error", "KeyError"), ("internal_error", "ValueError")]
    assert lines[0]["component"] == "resolver" and dict(faults.counts()) == {"sink": 101}


def test_logs_are_json_lines_off_a_tty_and_readable_on_one() -> None:
    """log_format=auto renders JSON lines to a pipe and console text to a terminal."""

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    pipe, tty = io.StringIO(), Tty()
    make_logger("auto", "info", component="monitor", stream=pipe).info("started", url="x")
    make_logger("auto", "info", component="monitor", stream=tty).info("started", url="x")
    assert json.loads(pipe.getvalue())["event"] == "started"
    assert "started" in tty.getvalue() and not tty.getvalue().lstrip().startswith("{")
    quiet = io.StringIO()
    make_logger("json", "error", component="m", stream=quiet).info("started")
    assert quiet.getvalue() == ""


def test_a_closed_log_stream_loses_lines_and_breaks_nothing(make_monitor) -> None:
    """stderr closed under a running agent (a test's capture ended, a daemon's pipe gone): its log lines are lost
    and counted, and neither the background threads nor stop() raise (before: ValueError out of stop())."""
    out = io.StringIO()
    writer = LineWriter(out)
    writer.info('{"event": "started"}')
    assert out.getvalue() == '{"event": "started"}\n' and writer.lost == 0
    out.close()
    writer.info('{"event": "stopped"}')
    writer.error('{"event": "internal_error"}')
    assert writer.lost == 2
    closed = io.StringIO()
    log = make_logger("json", "info", component="m", stream=closed)
    closed.close()
    log.info("stopped")  # through structlog's processors: nothing raised
    with contextlib.redirect_stderr(io.StringIO()) as err:
        mon = make_monitor(log_level="info", sample_rate=1.0).start()
    model = mon.wrap(torch.nn.Linear(4, 4), name="m")
    err.close()
    for _ in range(5):
        model(torch.ones(1, 4))
    assert mon.flush(timeout=5)
    mon.stop()  # logs "stopped" to the closed stream
    assert value(mon, "perfmon_forward_calls_total", model="m") == 5
    assert mon.stats()["internal_errors"] == {}


def test_agent_self_cost_is_exported(make_monitor) -> None:
    """The resolver's CPU time, the pending records and the resolver lag are exported."""
    from perfmon.testing import FakeCuda, FakeGpu, GpuWork

    gpu = FakeGpu()
    mon = make_monitor(cuda=FakeCuda(gpu), sample_rate=1.0, resolve_interval_seconds=0.01, port=0).start()
    model = mon.wrap(GpuWork(gpu, ms=1.0), name="m", device="cuda:0")
    for _ in range(3):
        model(torch.ones(1))  # the GPU never finishes: these stay pending
    wait_until(lambda: value(mon, "perfmon_agent_cpu_seconds_total", thread="resolver"), timeout=5,
               what="resolver CPU time")
    assert value(mon, "perfmon_agent_cpu_seconds_total", thread="resolver") > 0
    assert value(mon, "perfmon_pending_records") == 3
    # The oldest record ages while the GPU holds it: the lag gauge follows (a poll with a deadline, not a sleep).
    wait_until(lambda: value(mon, "perfmon_resolver_lag_seconds") >= 0.05, timeout=5, what="the lag to reach 50 ms")
    gpu.finish()
    mon.flush()
    assert value(mon, "perfmon_pending_records") == 0 and value(mon, "perfmon_resolver_lag_seconds") == 0
    import urllib.request

    urllib.request.urlopen(mon.url + "/metrics", timeout=5).read()
    # Charged when the server's loop turn ends, just after the answer went out.
    wait_until(lambda: value(mon, "perfmon_agent_cpu_seconds_total", thread="http"), timeout=5,
               what="the HTTP thread's CPU time")
