"""Occupancy on real kernels: a device-bound model reads near 1, a launch-bound one low and host-bound, from a
real profiler capture and from live event pairs. Skipped without a GPU (run them where one is lent)."""

from __future__ import annotations

import pytest
import torch

from ..conftest import value, wait_capture

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


class Sleepers(torch.nn.Module):
    """Four ~5 ms spin kernels queued back to back: the host returns long before the device is done."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(4):
            torch.cuda._sleep(5_000_000)  # ~2-5 ms depending on the clock
        return x + 1


class Launches(torch.nn.Module):
    """Two hundred tiny element-wise kernels: each costs the host a launch (µs), the device far less."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(200):
            x = x + 1
        return x


@pytest.mark.parametrize(("kind", "host_bound"), [("device", False), ("launch", True)])
def test_occupancy_and_the_verdict_on_real_kernels(make_monitor, kind: str, host_bound: bool) -> None:
    """Live: host / span under 0.5 (device-bound) or at least 0.9 (launch-bound); a capture then reads occupancy at
    least 0.9 or under 0.5, and the gauges agree."""
    mon = make_monitor(sample_rate=1.0, warmup_calls=2).start()
    model = mon.wrap(Sleepers() if kind == "device" else Launches(), name=kind, device="cuda:0")
    x = torch.zeros(16, device="cuda")
    for _ in range(12):
        model(x)
        torch.cuda.synchronize()  # test code between calls: each call alone on the device
    assert mon.flush(timeout=10)
    live = mon.stats()["models"][kind]["occupancy"]
    assert live["source"] == "live" and live["host_bound"] is host_bound, live
    cap = mon.capture(kind, steps=5)
    meta = wait_capture(mon, cap["id"], drive=lambda: model(x), timeout=60)
    torch.cuda.synchronize()
    assert meta["outcome"] == "ok", meta.get("error")
    occ = meta["occupancy"]
    assert occ is not None and (occ["ratio"] >= 0.9 if kind == "device" else occ["ratio"] < 0.5), occ
    after = mon.stats()["models"][kind]["occupancy"]
    assert after["source"] == "capture" and after["host_bound"] is host_bound, after
    assert value(mon, "perfmon_model_host_bound", model=kind) == float(host_bound)
    assert value(mon, "perfmon_model_occupancy_ratio", model=kind) == pytest.approx(occ["ratio"])
