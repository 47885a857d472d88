"""The captures part of ``Monitor``'s surface: arm a manual capture, list captures, read one (monitor.py wires).

Kept with the stage it drives, as ``RequestApi`` is (agent/requests.py): the ``Monitor`` class stays the wiring.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .records import CaptureOptions

if TYPE_CHECKING:
    from ..agent.models import Models
    from ..agent.state import Hub
    from ..stats.views import Views
    from ..store.traces import TraceStore
    from .controller import CaptureController

__all__ = ["CaptureApi"]


class CaptureApi:
    """``Monitor.capture``, ``cancel_capture``, ``profiles``, ``profile`` and ``read_trace``."""

    models: Models
    captures: CaptureController
    traces: TraceStore
    _views: Views
    _hub: Hub

    def capture(self, model: str | None = None, *, steps: int = 5, max_seconds: float = 10.0,
                record_shapes: bool = True, with_stack: bool = False, profile_memory: bool = False,
                requested_by: str = "api") -> dict[str, Any]:
        """Arm a manual capture of ``model`` (the only model when None); returns its metadata.

        Raises ``LookupError`` for an unknown model, ``ConfigError`` for bad options, ``CaptureBusy``
        while a capture runs or the monitor is stopped, and ``CaptureRateLimited`` past ``manual_captures_per_hour``.
        """
        st = self.models.pick(model)  # (stopped or closed: the controller refuses it, under its lock)
        options = CaptureOptions(steps=steps, max_seconds=max_seconds, record_shapes=record_shapes,
                                 with_stack=with_stack, profile_memory=profile_memory)
        cap = self.captures.arm(st, options, trigger="manual", reason={"requested_by": requested_by[:200]})
        self._hub.wake.set()  # the resolver, perhaps dozing, expires it after capture_arm_timeout_seconds
        return cap.public()

    def cancel_capture(self, capture_id: str, *, requested_by: str = "api") -> dict[str, Any]:
        """End the capture in flight with this id: an armed one now (outcome aborted), a recording one at its
        thread's next call of the model. Returns its metadata; raises ``LookupError`` when no capture in flight has
        that id, ``CaptureBusy`` while it is exported (it ends on its own)."""
        meta = self.captures.cancel(capture_id, requested_by)
        self._hub.wake.set()
        return meta

    def profiles(self) -> list[dict[str, Any]]:
        """Captures, newest first: the one in flight (if any) and the stored ones."""
        return self._views.profiles()

    def profile(self, capture_id: str) -> dict[str, Any] | None:
        """One capture's metadata and op summary, or None."""
        return self._views.profile(capture_id)

    def read_trace(self, capture_id: str) -> Any:
        """One stored capture's trace file (see ``TraceStore.read_trace``), or None."""
        return self.traces.read_trace(capture_id)
