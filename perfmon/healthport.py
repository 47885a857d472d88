"""``/healthz`` on a port of its own (``health_port``), for the liveness probe.

The agent's main port answers health first (its health lane, httpd.py), but a probe still shares that
port's accept queue with every other client: a flood of new idle connections from the same machine
(hundreds a second) keeps the queue full, and a probe waits there or its SYN is dropped (p50 1.1 s,
max 4.7 s measured). A listener of its own has a queue of its own, which only the kubelet uses. One
daemon thread, blocking sockets, one client at a time (a probe is one short request), each bounded by
a 1 s timeout; the answer is the same ``/healthz`` document as on the main port. Anything else is 404.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

from .httpd import AgentServer, _encode
from .selfcost import AgentCpu
from .server import Response

__all__ = ["HealthServer"]

#: How long one client may take to send its request and take the answer.
CLIENT_TIMEOUT_SECONDS = 1.0
#: accept() wakes this often to see stop() (an idle cost of a few syscalls a second).
_ACCEPT_WAKE_SECONDS = 0.25
_NOT_FOUND = Response.json(404, {"error": "not found", "detail": "this port serves /healthz only"})


class HealthServer:
    """``GET``/``HEAD /healthz`` on its own port; ``answer()`` builds the response (``Router`` does)."""

    def __init__(self, answer: Callable[[str], Response], host: str, port: int, *, port_range: int = 1,
                 cpu: AgentCpu | None = None) -> None:
        self._answer = answer
        self._cpu = cpu if cpu is not None else AgentCpu()
        self._listener = AgentServer._bind(host, port, port_range)
        self._listener.setblocking(True)
        self._listener.settimeout(_ACCEPT_WAKE_SECONDS)
        self.port = int(self._listener.getsockname()[1])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="perfmon-health", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_seconds: float) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_seconds)
        _close(self._listener)

    def abandon(self) -> None:
        """In a forked child: close the inherited listener (the parent keeps serving on it)."""
        _close(self._listener)

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                sock, _ = self._listener.accept()
            except (TimeoutError, InterruptedError):
                continue
            except OSError:  # closed by stop(), or out of descriptors: wait a moment
                if self._stop.wait(0.05):
                    return
                continue
            c0 = time.thread_time()
            try:
                self._one(sock)
            except OSError:
                pass  # a client that went away
            finally:
                _close(sock)
                self._cpu.add("http", time.thread_time() - c0)

    def _one(self, sock: socket.socket) -> None:
        sock.settimeout(CLIENT_TIMEOUT_SECONDS)
        deadline = time.monotonic() + CLIENT_TIMEOUT_SECONDS
        data = b""
        while b"\n\r\n" not in data and b"\n\n" not in data and len(data) < 4096:
            if time.monotonic() > deadline:
                return
            chunk = sock.recv(4096)
            if not chunk:
                return
            data += chunk
        method, _, rest = data.partition(b" ")
        path = rest.partition(b" ")[0].partition(b"?")[0].rstrip(b"/")
        health = method in (b"GET", b"HEAD") and path == b"/healthz"
        resp = self._answer(method.decode()) if health else _NOT_FOUND
        sock.sendall(_encode(resp, close=True))


def _close(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass
