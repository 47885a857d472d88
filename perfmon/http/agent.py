"""What the HTTP layer needs of the agent: the ``Agent`` protocol (``Monitor`` satisfies it structurally).

``http/`` depends on this and never on ``perfmon.monitor``: the routes, the servers and the mounted apps
read the registry and the views through it, and a test can hand them any object that has these members.
"""

from __future__ import annotations

from typing import Any, Protocol

from prometheus_client import CollectorRegistry

from ..config import Config
from ..faults import InternalErrors
from ..selfcost import AgentCpu

__all__ = ["Agent"]


class Agent(Protocol):
    """The members of a running agent that the routes and apps use (attributes may be properties)."""

    @property
    def registry(self) -> CollectorRegistry:
        """What /metrics renders."""

    @property
    def config(self) -> Config:
        """The agent's settings (token, allowed_hosts, host)."""

    @property
    def internal(self) -> InternalErrors:
        """Agent faults: ``.report(where, exc)`` counts one."""

    @property
    def cpu(self) -> AgentCpu:
        """The agent's own CPU: ``.measure("http")`` charges the HTTP thread's."""

    def health(self) -> tuple[bool, dict[str, Any]]:
        """(healthy, the /healthz document)."""

    def stats(self) -> dict[str, Any]:
        """The /stats document."""

    def profiles(self) -> list[dict[str, Any]]:
        """Captures, newest first."""

    def profile(self, capture_id: str) -> dict[str, Any] | None:
        """One capture's metadata, or None."""

    def capture(self, model: str | None = None, *, steps: int = 5, max_seconds: float = 10.0,
                record_shapes: bool = True, with_stack: bool = False, profile_memory: bool = False,
                requested_by: str = "api") -> dict[str, Any]:
        """Arm a capture; its metadata. Raises LookupError, ConfigError, CaptureBusy, CaptureRateLimited."""

    def cancel_capture(self, capture_id: str, *, requested_by: str = "api") -> dict[str, Any]:
        """End the capture in flight with this id; its metadata. Raises LookupError, CaptureBusy."""

    def read_trace(self, capture_id: str) -> tuple[str, bytes] | None:
        """(file name, gzipped bytes) of a stored capture's trace, or None."""
