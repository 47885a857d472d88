"""The CUDA-event path, on the fake GPU of perfmon.testing (no GPU needed)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from perfmon.agent.clocks import EventPair, elapsed_seconds
from perfmon.testing import FakeCuda, FakeEvent, FakeGpu, GpuWork, event_pairs_in_flight

from .conftest import hist_count, value, wait_until


def test_fake_event_semantics_match_torch() -> None:
    """query() is True before record, False until the GPU reaches it; elapsed_time raises until both complete."""
    gpu = FakeGpu()
    start, end = FakeEvent(gpu), FakeEvent(gpu)
    assert start.query()  # never recorded
    with pytest.raises(RuntimeError, match="recorded"):
        start.elapsed_time(end)
    start.record()
    gpu.launch(2.0)
    end.record()
    assert start.query() and not end.query()
    with pytest.raises(RuntimeError, match="completed"):
        start.elapsed_time(end)
    gpu.advance(1.0)
    assert not end.query()
    gpu.advance(1.0)
    assert end.query() and start.elapsed_time(end) == pytest.approx(2.0)
    assert elapsed_seconds(EventPair(start, end, 0)) == pytest.approx(0.002)
    other = FakeGpu(devices=2)
    ev = FakeEvent(other)
    ev.record(other.streams[0])
    with pytest.raises(RuntimeError, match="does not match"):
        ev.record(other.streams[1])


def _gpu_monitor(make_monitor, gpu: FakeGpu, **kw):
    kw.setdefault("sample_rate", 1.0)
    kw.setdefault("warmup_calls", 1)
    return make_monitor(cuda=FakeCuda(gpu), **kw)


def test_device_time_comes_from_events_not_the_host_clock(make_monitor) -> None:
    """A call that enqueues 5 ms of GPU work returns at once; the histogram records 5 ms of device time."""
    gpu = FakeGpu()
    mon = _gpu_monitor(make_monitor, gpu)
    model = mon.wrap(GpuWork(gpu, ms=5.0), name="gpu", device="cuda:0")
    x = torch.zeros(1)
    for _ in range(4):
        model(x)
    assert mon.resolver.step() == 0  # nothing completed: the resolver never waits
    assert hist_count(mon, "gpu", "steady", device="cuda:0") == 0
    gpu.finish()
    mon.flush()
    assert hist_count(mon, "gpu", "cold", device="cuda:0") == 1
    assert hist_count(mon, "gpu", "steady", device="cuda:0") == 3
    total = value(mon, "perfmon_forward_duration_seconds_sum", model="gpu", device="cuda:0", phase="steady")
    assert total == pytest.approx(0.015)
    host = value(mon, "perfmon_forward_host_duration_seconds_sum", model="gpu", device="cuda:0", phase="steady")
    assert host < 0.015  # the host only enqueued
    assert event_pairs_in_flight(mon) == 0


def test_out_of_order_completion_loses_and_duplicates_nothing(make_monitor) -> None:
    """Samples on two streams completing out of order are each counted exactly once with the right time."""
    gpu = FakeGpu()
    slow, fast = gpu.stream(0, "slow"), gpu.stream(0, "fast")
    mon = _gpu_monitor(make_monitor, gpu, warmup_calls=0, track_signatures=False)
    model = mon.wrap(GpuWork(gpu, ms=1.0), name="m", device="cuda:0")
    x = torch.zeros(1)
    # 10 slow calls (100 ms each) then 10 fast ones (1 ms), on different streams
    gpu.current[0] = slow
    model.ms = 100.0
    for _ in range(10):
        model(x)
    gpu.current[0] = fast
    model.ms = 1.0
    for _ in range(10):
        model(x)
    gpu.advance(10.0)  # the fast stream is done, the slow one is not
    mon.resolver.step()
    assert hist_count(mon, "m", "steady", device="cuda:0") == 10
    assert value(mon, "perfmon_forward_duration_seconds_sum", model="m", device="cuda:0",
                 phase="steady") == pytest.approx(0.010)
    gpu.advance(500.0)
    mon.resolver.step()
    assert hist_count(mon, "m", "steady", device="cuda:0") == 15  # 5 slow ones finished by t=510 ms
    gpu.finish()
    mon.flush()
    assert hist_count(mon, "m", "steady", device="cuda:0") == 20
    assert value(mon, "perfmon_forward_duration_seconds_sum", model="m", device="cuda:0",
                 phase="steady") == pytest.approx(1.010)
    assert event_pairs_in_flight(mon) == 0
    assert value(mon, "perfmon_samples_dropped_total", model="m", reason="timing_failed") == 0


def test_pool_exhaustion_is_counted_as_drops(make_monitor) -> None:
    """With 4 event pairs and a busy GPU, the 5th..10th timed calls are dropped with reason pool_exhausted."""
    gpu = FakeGpu()
    mon = _gpu_monitor(make_monitor, gpu, event_pool_size=4)
    model = mon.wrap(GpuWork(gpu, ms=1.0), name="m", device="cuda:0")
    x = torch.zeros(1)
    for _ in range(10):
        model(x)
    assert gpu.events_created == 8  # preallocated once, never per call
    assert value(mon, "perfmon_samples_dropped_total", model="m", reason="pool_exhausted") == 6
    assert value(mon, "perfmon_forward_calls_total", model="m") == 10
    gpu.finish()
    mon.flush()
    for _ in range(3):  # pairs came back to the pool
        model(x)
    gpu.finish()
    mon.flush()
    assert hist_count(mon, "m", "cold", device="cuda:0") + hist_count(mon, "m", "steady", device="cuda:0") == 7
    assert value(mon, "perfmon_samples_dropped_total", model="m", reason="pool_exhausted") == 6


def test_graph_capture_is_never_timed(make_monitor) -> None:
    """While the stream is capturing a CUDA graph no event is recorded; the sample is dropped as graph_capture."""
    gpu = FakeGpu()
    mon = _gpu_monitor(make_monitor, gpu)
    model = mon.wrap(GpuWork(gpu, ms=1.0), name="m", device="cuda:0")
    gpu.current[0].capturing = True
    out = model(torch.ones(1))  # would raise inside FakeEvent.record if perfmon recorded
    assert torch.equal(out, torch.ones(1))
    assert value(mon, "perfmon_samples_dropped_total", model="m", reason="graph_capture") == 1


def test_user_exception_returns_the_event_pair(make_monitor) -> None:
    """A timed call that raises gives its events back and is counted as an error."""
    gpu = FakeGpu()
    mon = _gpu_monitor(make_monitor, gpu, event_pool_size=2)

    class Fails(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (fake)")

    model = mon.wrap(Fails(), name="m", device="cuda:0")
    for _ in range(5):
        with pytest.raises(torch.cuda.OutOfMemoryError):
            model(torch.ones(1))
    assert event_pairs_in_flight(mon) == 0
    assert value(mon, "perfmon_forward_errors_total", model="m", exception="OutOfMemoryError") == 5
    assert value(mon, "perfmon_samples_dropped_total", model="m", reason="pool_exhausted") == 0


def test_stop_with_pending_events_returns_promptly_and_leaks_no_thread(make_monitor) -> None:
    """stop() with GPU work that never finishes returns within its timeout, drops as shutdown, joins threads."""
    gpu = FakeGpu()
    before = {t.name for t in threading.enumerate()}
    mon = _gpu_monitor(make_monitor, gpu, stop_timeout_seconds=0.3, port=0).start()
    model = mon.wrap(GpuWork(gpu, ms=1e9), name="m", device="cuda:0")
    for _ in range(5):
        model(torch.ones(1))
    t0 = time.perf_counter()
    mon.stop()
    elapsed = time.perf_counter() - t0
    assert elapsed < 2.0
    assert value(mon, "perfmon_samples_dropped_total", model="m", reason="shutdown") == 5
    assert event_pairs_in_flight(mon) == 0
    leftover = {t.name for t in threading.enumerate() if t.is_alive()} - before
    assert not {n for n in leftover if n.startswith("perfmon")}


def test_resolver_thread_resolves_without_flush(make_monitor) -> None:
    """The background resolver alone turns completed events into histogram samples."""
    gpu = FakeGpu()
    mon = _gpu_monitor(make_monitor, gpu, resolve_interval_seconds=0.01).start()
    model = mon.wrap(GpuWork(gpu, ms=3.0), name="m", device="cuda:0")
    model(torch.ones(1))
    gpu.finish()
    wait_until(lambda: hist_count(mon, "m", "cold", device="cuda:0"), timeout=5, what="the resolver thread")
    assert hist_count(mon, "m", "cold", device="cuda:0") == 1
    assert value(mon, "perfmon_cold_start_seconds", model="m") == pytest.approx(0.003)


def test_elapsed_time_failure_is_a_drop_not_a_crash(make_monitor) -> None:
    """If elapsed_time raises after query() said done, the sample is dropped (timing_failed) and counted."""
    gpu = FakeGpu()
    backend = FakeCuda(gpu)

    class Broken(FakeEvent):
        def elapsed_time(self, end_event: FakeEvent) -> float:
            raise ValueError("driver said no")

    backend.new_event = lambda: Broken(gpu)  # type: ignore[method-assign]
    mon = make_monitor(cuda=backend, sample_rate=1.0)
    model = mon.wrap(GpuWork(gpu, ms=1.0), name="m", device="cuda:0")
    model(torch.ones(1))
    gpu.finish()
    mon.flush()
    assert value(mon, "perfmon_samples_dropped_total", model="m", reason="timing_failed") == 1
    assert value(mon, "perfmon_internal_errors_total", stage="elapsed_time") == 1
    assert event_pairs_in_flight(mon) == 0


def test_two_devices_use_their_own_streams_and_pools(make_monitor) -> None:
    """A model on cuda:1 records on cuda:1's stream with cuda:1's events."""
    gpu = FakeGpu(devices=2)
    mon = _gpu_monitor(make_monitor, gpu)
    m0 = mon.wrap(GpuWork(gpu, ms=2.0, device=0), name="m0", device="cuda:0")
    m1 = mon.wrap(GpuWork(gpu, ms=7.0, device=1), name="m1", device="cuda:1")
    m0(torch.ones(1))
    m1(torch.ones(1))
    gpu.finish()
    mon.flush()
    assert value(mon, "perfmon_cold_start_seconds", model="m0") == pytest.approx(0.002)
    assert value(mon, "perfmon_cold_start_seconds", model="m1") == pytest.approx(0.007)
    assert hist_count(mon, "m1", "cold", device="cuda:1") == 1


def test_a_flop_count_never_queues_work_on_the_users_stream(make_monitor) -> None:
    """A forward that reaches the device past the dispatcher (a raw kernel launch: ``torch.cuda._sleep``, an
    extension taking no tensor) does so in the FLOP count's fake forward too. On the counting thread's default
    stream, the user's, that kernel would run between the user's kernels and inside their timings; it goes to
    perfmon's own stream instead, and the user's stream holds exactly the user's calls."""
    gpu = FakeGpu()
    cuda = FakeCuda(gpu)

    class RawKernel(torch.nn.Module):
        """Launches 2 ms on the calling thread's current stream whatever its input, fake or not (the GPU is the
        class's: a copy of the module launches on it too, as a raw launch reaches the real device)."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with gpu.lock:
                gpu.record_call(gpu.now_ms, [(gpu.now_ms, *gpu.launch(2.0))])
            return x

    mon = make_monitor(cuda=cuda, sample_rate=1.0, warmup_calls=0, stats_window_seconds=3600)
    model = mon.wrap(RawKernel(), name="raw", device="cuda:0")
    x = torch.zeros(4)
    for _ in range(5):
        model(x)
    gpu.finish()
    mon.flush()
    wait_until(lambda: value(mon, "perfmon_flop_counts_total", outcome="ok") == 1, what="the signature's count")
    assert gpu.calls_made == 6  # the five calls, and the count's fake forward: it did launch its kernel
    assert gpu.streams[0].tail_ms == pytest.approx(10.0)  # the user's stream: their five 2 ms kernels, nothing else
    with cuda.own_stream(0) as own:
        # the count's kernel, after the device's 10 ms
        assert own is not gpu.streams[0] and own.tail_ms == pytest.approx(12.0)
        assert cuda.current_stream(0) is own
    assert cuda.current_stream(0) is gpu.streams[0]  # per thread, and only inside the block


def test_a_backend_written_before_own_stream_still_counts(make_monitor) -> None:
    """A user's CudaBackend with only the seam's first four methods (own_stream came later) still makes a monitor
    whose signatures are counted: the count runs on the thread's current stream, as before."""
    gpu = FakeGpu()

    class OldBackend:
        def __init__(self) -> None:
            self._cuda = FakeCuda(gpu)

        def available(self) -> bool:
            return True

        def new_event(self) -> FakeEvent:
            return self._cuda.new_event()

        def current_stream(self, device_index: int) -> object:
            return self._cuda.current_stream(device_index)

        def is_capturing(self, device_index: int) -> bool:
            return self._cuda.is_capturing(device_index)

    mon = make_monitor(cuda=OldBackend(), sample_rate=1.0, warmup_calls=0)
    model = mon.wrap(torch.nn.Linear(4, 4), name="lin", device="cuda:0")
    for _ in range(3):
        model(torch.ones(2, 4))
    gpu.finish()
    mon.flush()
    wait_until(lambda: value(mon, "perfmon_flop_counts_total", outcome="ok") == 1, what="the signature's count")
