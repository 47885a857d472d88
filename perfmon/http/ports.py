"""The agent's ports: bind the agent server and the health port, retry in the background, report.

Never fails the application's start over a port: a bind that fails is logged once, retried with a
back-off (``retry``, on the resolver thread's housekeeping) and reported in ``/healthz``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from time import perf_counter_ns
from typing import Any

from ..backoff import backoff_seconds
from .agent import Agent
from .agent_server import AgentServer
from .health_port import HealthServer
from .routes import Router
from .security import is_loopback

__all__ = ["HEALTH_RETRY_SECONDS", "Ports"]

#: How often (seconds) a health port that could not be bound is tried again.
HEALTH_RETRY_SECONDS = 5.0


class Ports:
    """The agent server and the health port of one agent; every method runs under the caller's lifecycle lock.

    ``shedding`` and ``set_port`` are the agent's own: what its server refused, and the port it exports.
    """

    def __init__(self, agent: Agent, *, shedding: Any, set_port: Callable[[int | None], None], log: Any) -> None:
        self._agent = agent
        self.config = agent.config
        self._shedding = shedding
        self._set_port = set_port
        self._log = log
        self.server: AgentServer | None = None
        self.health_server: HealthServer | None = None
        self._reset()

    def _reset(self) -> None:
        #: Why the last bind failed (None once bound), and when to try again (perf_counter_ns).
        self.error: str | None = None
        self._retry_ns: int | None = None
        self._failures = 0
        #: The same for the health port.
        self._health_error: str | None = None
        self._health_retry_ns: int | None = None

    def open(self) -> bool:
        """Bind the ports the settings name; False only when ``require_port`` and the agent's port is not bound."""
        cfg = self.config
        if cfg.port is not None and not self.bind() and cfg.require_port:
            return False
        if cfg.health_port is not None:
            self.bind_health()
        if cfg.port is not None and cfg.token is None and not is_loopback(cfg.host):
            self._log.warning("control_api_disabled", host=cfg.host,
                              note="no token set on a non-loopback address: /profile and /profiles answer 403; "
                                   "/metrics, /healthz and /stats are served")
        return True

    def bind(self) -> bool:
        """Bind and start the agent's server; False, logged and retried, if no port is free."""
        cfg, agent = self.config, self._agent
        assert cfg.port is not None
        try:
            server = AgentServer(
                Router(agent, mounted=False), cfg.host, cfg.port, port_range=cfg.port_range,
                connection_timeout=cfg.http_connection_timeout_seconds, cpu_budget=cfg.http_cpu_budget,
                cpu=agent.cpu, shedding=self._shedding, internal=agent.internal)
        except OSError as exc:
            first = self.error is None
            self.error = str(exc)
            self._failures += 1
            # 1 s, 2 s, 4 s ... 30 s: a worker waiting for a port held in TIME_WAIT or by a dying
            # sibling gets it soon; a range that is simply too narrow costs a bind() every 30 s.
            delay = backoff_seconds(self._failures, initial=1.0, cap=30.0)
            self._retry_ns = perf_counter_ns() + int(delay * 1e9)
            if first:
                last = cfg.port + cfg.port_range - 1
                self._log.error("port_unavailable", host=cfg.host, port_range=f"{cfg.port}..{last}",
                                error=str(exc), pid=os.getpid(),
                                note="timing and counting go on; the bind is retried in the background. "
                                     "Widen PERFMON_PORT_RANGE to cover every process that starts a "
                                     "monitor (workers, and the master if it starts one)")
            return False
        if self.error is not None:  # logged before the URL is published: whoever sees the URL sees the line
            self._log.info("port_bound", url=server.url, attempts=self._failures + 1)
        self.server = server  # before start(): a start that fails leaves a server stop() still closes
        self._set_port(server.port)
        server.start()
        self.error = None
        self._retry_ns = None
        self._failures = 0
        return True

    def bind_health(self) -> bool:
        """Bind and start the health port's server; logged and retried if taken."""
        cfg = self.config
        assert cfg.health_port is not None
        router = Router(self._agent, mounted=False)
        try:
            server = HealthServer(lambda method: router.handle(method, "/healthz", {}), cfg.host, cfg.health_port,
                                  port_range=cfg.port_range, cpu=self._agent.cpu)
        except OSError as exc:
            if self._health_error is None:
                self._log.error("health_port_unavailable", host=cfg.host, error=str(exc),
                                port_range=f"{cfg.health_port}..{cfg.health_port + cfg.port_range - 1}",
                                note="/healthz is still served on the agent's port; retried every 5 s")
            self._health_error = str(exc)
            self._health_retry_ns = perf_counter_ns() + int(HEALTH_RETRY_SECONDS * 1e9)
            return False
        server.start()
        self.health_server, self._health_error, self._health_retry_ns = server, None, None
        return True

    def due(self, now_ns: int) -> bool:
        """A failed bind's back-off has passed."""
        due = self.due_ns()
        return due is not None and now_ns >= due

    def due_ns(self) -> int | None:
        """perf_counter_ns when a failed bind is next retried (None: nothing to retry)."""
        due = [t for t in (self._retry_ns, self._health_retry_ns) if t is not None]
        return min(due) if due else None

    def retry(self, now_ns: int) -> None:
        """Try the ports whose back-off has passed again."""
        if self.server is None and self.config.port is not None and self._retry_ns is not None \
                and now_ns >= self._retry_ns:
            self.bind()
        if self.health_server is None and self.config.health_port is not None \
                and self._health_retry_ns is not None and now_ns >= self._health_retry_ns:
            self.bind_health()

    def stop(self, timeout_seconds: float) -> None:
        """Close both ports (bounded joins); nothing is retried afterwards."""
        self._reset()
        if self.health_server is not None:
            self.health_server.stop(timeout_seconds)
            self.health_server = None
        if self.server is not None:
            self.server.stop(timeout_seconds)
            self.server = None
            self._set_port(None)

    def abandon(self) -> None:
        """In a forked child: forget the inherited sockets (the parent keeps serving on them)."""
        self._reset()
        if self.server is not None:
            self.server.abandon()
            self.server = None
        if self.health_server is not None:
            self.health_server.abandon()
            self.health_server = None

    def listening(self, running: bool) -> int | None:
        """1 while the agent's port is bound, 0 while it is not (retrying); None when it serves none."""
        if self.config.port is None or not running:
            return None
        return 1 if self.server is not None else 0

    def detail(self) -> dict[str, Any]:
        """``/healthz``'s ``http`` (and ``port``/``error``, ``health_port``) fields.

        ``http`` says whether the agent's own port is bound: "listening", "unbound" (no free port in
        the range; timing goes on and the bind is retried, ``error`` says why) or "off" (``port=None``).
        """
        detail: dict[str, Any] = {}
        server, error = self.server, self.error
        if self.config.port is None:
            detail["http"] = "off"
        elif server is not None:
            detail["http"], detail["port"] = "listening", server.port
        elif error is not None:
            detail["http"], detail["error"] = "unbound", error
        else:
            detail["http"] = "stopped"
        if self.config.health_port is not None:
            health = self.health_server
            detail["health_port"] = health.port if health is not None else None
        return detail

    @property
    def url(self) -> str | None:
        server = self.server
        return server.url if server is not None else None

    @property
    def health_url(self) -> str | None:
        health = self.health_server
        if health is None:
            return None
        host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
        return f"http://{host}:{health.port}/healthz"
