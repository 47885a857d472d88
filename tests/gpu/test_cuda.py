"""Real-CUDA checks of the event path. Skipped without a GPU (run them where one is lent)."""

from __future__ import annotations

import time

import pytest
import torch

from perfmon.agent.clocks import TorchCuda

from ..conftest import hist_count, value

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


class Sleeper(torch.nn.Module):
    """Queues a GPU kernel that spins for ``cycles`` clock cycles; returns at once on the host."""

    def __init__(self, cycles: int) -> None:
        super().__init__()
        self.cycles = cycles
        self.anchor = torch.nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(self.cycles)
        return x + self.anchor


def test_backend_semantics_match_what_perfmon_assumes() -> None:
    """A never-recorded event queries True; elapsed_time raises before completion; both work off-thread."""
    backend = TorchCuda()
    start, end = backend.new_event(), backend.new_event()
    assert end.query()
    stream = backend.current_stream(torch.cuda.current_device())
    start.record(stream)
    torch.cuda._sleep(200_000_000)
    end.record(stream)
    assert not end.query()
    with pytest.raises((RuntimeError, ValueError)):
        start.elapsed_time(end)
    torch.cuda.synchronize()  # test code, not the hot path
    assert end.query() and start.elapsed_time(end) > 0


def test_device_time_measured_without_blocking_the_caller(make_monitor) -> None:
    """A call that queues ~100 ms of GPU work returns in far less; perfmon reports the device time."""
    mon = make_monitor(sample_rate=1.0, warmup_calls=1).start()
    model = mon.wrap(Sleeper(100_000_000).cuda(), name="sleep")
    x = torch.zeros(1, device="cuda")
    model(x)  # cold
    torch.cuda.synchronize()
    ref_start, ref_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ref_start.record()
    t0 = time.perf_counter()
    model(x)
    host = time.perf_counter() - t0
    ref_end.record()
    torch.cuda.synchronize()
    truth = ref_start.elapsed_time(ref_end) / 1000
    assert mon.flush(timeout=10)
    device = value(mon, "perfmon_forward_duration_seconds_sum", model="sleep", device="cuda:0", phase="steady")
    assert host < truth / 5
    assert device == pytest.approx(truth, rel=0.1)
    host_sum = value(mon, "perfmon_forward_host_duration_seconds_sum", model="sleep", device="cuda:0",
                     phase="steady")
    assert host_sum < device


def test_graph_capture_is_skipped_not_broken(make_monitor) -> None:
    """Capturing a CUDA graph through a wrapped model works; the sample is dropped as graph_capture."""
    mon = make_monitor(sample_rate=1.0, warmup_calls=0)
    lin = torch.nn.Linear(16, 16).cuda()
    model = mon.wrap(lin, name="lin")
    x = torch.randn(4, 16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            model(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = model(x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.allclose(y, lin(x))
    assert value(mon, "perfmon_samples_dropped_total", model="lin", reason="graph_capture") >= 1


def test_moving_a_model_switches_to_event_timing(make_monitor) -> None:
    """model.to('cuda') through the proxy relabels the device and times with events."""
    mon = make_monitor(sample_rate=1.0, warmup_calls=0)
    model = mon.wrap(torch.nn.Linear(8, 8), name="lin")
    model(torch.randn(2, 8))
    model = model.to("cuda")
    model(torch.randn(2, 8, device="cuda"))
    assert mon.flush(timeout=10)
    assert hist_count(mon, "lin", "cold", device="cpu") == 1
    assert hist_count(mon, "lin", "cold", device="cuda:0") == 1
