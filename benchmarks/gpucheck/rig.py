"""The device under test: what the checks need of it (``Rig``) and the real one over ``torch.cuda``.

A check queues known device work through a rig and waits for the device through it, never through
``torch.cuda`` directly, so the same check also runs on CPU against ``perfmon.testing.FakeCuda``
(tests/test_gpucheck.py's ``FakeRig``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

import torch

from perfmon import CudaBackend
from perfmon.agent.clocks import TorchCuda

__all__ = ["Rig", "TorchRig"]

#: torch.cuda through ``Any``: ``_sleep``, ``Event`` and ``Stream`` carry no annotations (mypy strict).
_cuda: Any = torch.cuda


class Rig(Protocol):
    """What the checks need of a device: perfmon's backend plus known device work and a device wait."""

    backend: CudaBackend
    #: perfmon's device label for the work (``cuda:0``).
    device: str
    #: True on a real GPU; checks that need torch's CUDA runtime itself skip otherwise.
    real: bool

    def work(self, ms: float) -> torch.nn.Module:
        """A module whose forward queues about ``ms`` milliseconds of device work and returns at once."""
        ...

    def launch_bound(self) -> torch.nn.Module:
        """A module whose forward launches many tiny kernels: the host, not the device, sets its pace."""
        ...

    def input(self) -> Any:
        """An input for the modules above."""
        ...

    def synchronize(self) -> None:
        """Wait until the device has finished everything queued (test code, never perfmon's path)."""
        ...

    def stream(self, index: int) -> contextlib.AbstractContextManager[Any]:
        """A context in which the calling thread's work goes to side stream ``index``."""
        ...

    def capture_graph(self, model: torch.nn.Module, x: Any) -> bool:
        """Capture ``model(x)`` into a CUDA graph and replay it; True when the replay matched eager."""
        ...


class _Sleeper(torch.nn.Module):
    """Queues one ``torch.cuda._sleep`` kernel of ``cycles`` GPU clock cycles."""

    def __init__(self, cycles: int) -> None:
        super().__init__()
        self.cycles = cycles

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _cuda._sleep(self.cycles)
        return x


class _Launches(torch.nn.Module):
    """``n`` tiny element-wise kernels on a small tensor: each costs the host a launch (~5 µs), the device less."""

    def __init__(self, n: int = 200) -> None:
        super().__init__()
        self.n = n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.n):
            x = x + 1
        return x


class TorchRig:
    """The real rig over ``torch.cuda`` on device 0; ``_sleep`` cycles are calibrated against events."""

    real = True

    def __init__(self) -> None:
        self.backend: CudaBackend = TorchCuda()
        self.device = "cuda:0"
        torch.cuda.set_device(0)
        self._x = torch.zeros(16, device="cuda")
        self._streams: dict[int, Any] = {}
        self.cycles_per_ms = self._calibrate()

    def _calibrate(self) -> float:
        """GPU clock cycles of ``_sleep`` per millisecond, measured on a ~10 ms kernel (after a warm-up)."""
        cycles = 10_000_000
        _cuda._sleep(cycles)
        start, end = _cuda.Event(enable_timing=True), _cuda.Event(enable_timing=True)
        start.record()
        _cuda._sleep(cycles)
        end.record()
        torch.cuda.synchronize()
        return float(cycles / max(start.elapsed_time(end), 1e-3))

    def work(self, ms: float) -> torch.nn.Module:
        return _Sleeper(max(1, int(ms * self.cycles_per_ms)))

    def launch_bound(self) -> torch.nn.Module:
        return _Launches()

    def input(self) -> Any:
        return self._x

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def stream(self, index: int) -> contextlib.AbstractContextManager[Any]:
        s = self._streams.get(index)
        if s is None:
            s = self._streams[index] = _cuda.Stream()
        return torch.cuda.stream(s)

    def capture_graph(self, model: torch.nn.Module, x: Any) -> bool:
        side = _cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on a side stream, as torch's graph docs require
            for _ in range(3):
                model(x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = model(x)
        graph.replay()
        torch.cuda.synchronize()
        return bool(torch.allclose(y, model(x)))
