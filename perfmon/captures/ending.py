"""How a capture ends other than by its own steps: expiry when its model is never called, a client's cancel, the
monitor's stop; and what is answered about it by id meanwhile.

The ``CaptureController``'s second half (controller.py arms, records and exports): the same object, the same lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from ..exceptions import CaptureBusy
from .export import Exporter
from .records import ARMED, RECORDING, Capture

__all__ = ["STOPPED", "CaptureEnds"]

#: ``arm``'s refusal while the monitor is stopped (no resolver to expire a capture, no stop() to end its recording).
STOPPED = "perfmon: the monitor is stopped; start() it before a capture"


class CaptureEnds:
    """Expiry (``tick``), ``cancel``, ``stop``/``accept`` and ``view``, over ``CaptureController``'s state."""

    _lock: threading.Lock
    state: str
    current: Capture | None
    clock: Callable[[], float]
    arm_timeout: float
    exporter: Exporter
    _state_ref: Any
    _armed_t: float
    _abort: bool
    _refusal: str | None
    _log: Any
    _export_thread: threading.Thread | None

    def _finish_locked(self, st: Any, outcome: str, error: str | None, event: str) -> None:
        raise NotImplementedError  # CaptureController's

    def tick(self) -> None:
        """Expire a capture armed for too long with no call of its model."""
        with self._lock:
            if self.state == ARMED and self.clock() - self._armed_t > self.arm_timeout:
                self._finish_locked(self._state_ref, "aborted",
                                    f"no call of the model within {self.arm_timeout:g} s of arming", "cancel")

    def view(self, capture_id: str) -> dict[str, Any] | None:
        """The in-flight capture's metadata if it has this id, or one the store could not keep (``Exporter.lost``)."""
        cap = self.current
        return cap.public() if cap is not None and cap.id == capture_id else self.exporter.lost(capture_id)

    def accept(self) -> None:
        """Arm captures again (the monitor started)."""
        self._refusal = None

    def stop(self, timeout_seconds: float) -> None:
        """Refuse new captures until ``accept``; cancel an armed one; ask a recording one to end at its thread's next
        call; wait for export."""
        deadline = self.clock() + timeout_seconds
        with self._lock:
            self._refusal = STOPPED
            if self.state == ARMED:
                self._finish_locked(self._state_ref, "aborted", "monitor stopped", "cancel")
            elif self.state == RECORDING:
                self._abort = True
        while self.state == RECORDING and self.clock() < deadline:
            time.sleep(0.01)  # the recording thread's next call ends it (bounded by the deadline)
        if self.state == RECORDING and self._log is not None:
            self._log.warning("capture_still_recording", id=self.current.id if self.current else None,
                              note="the profiler stops at the capturing thread's next call of the model")
        with self._lock:
            exporter = self._export_thread
        if exporter is not None:
            exporter.join(max(0.0, deadline - self.clock()))

    def cancel(self, capture_id: str, by: str) -> dict[str, Any]:
        """End the capture ``capture_id`` at a client's request (``by``: who): an armed one is aborted now; a
        recording one ends at its thread's next call of the model (what it recorded is exported, outcome aborted).
        Returns its metadata.
        Raises ``LookupError`` when no capture in flight has that id, ``CaptureBusy`` when it is being exported."""
        with self._lock:
            cap = self.current
            if cap is None or cap.id != capture_id:
                raise LookupError(f"no capture {capture_id[:40]!r} in flight")
            if self.state == ARMED:
                self._finish_locked(self._state_ref, "aborted", f"cancelled by {by[:200]}", "cancel")
            elif self.state == RECORDING:
                self._abort = True
                cap.error = f"cancelled by {by[:200]}"  # the export keeps it (an abort's error is otherwise None)
            else:
                raise CaptureBusy(f"capture {capture_id} is {self.state}: it ends on its own", capture_id)
            return cap.public()
