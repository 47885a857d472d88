"""Object stores on 127.0.0.1 for the trace-store tests: one that accepts connections and never answers, and
moto's S3 API served from a thread of the test process. Helpers, not tests."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from perfmon.store.files import new_id, worker_name
from perfmon.store.traces import TraceStore

#: Credentials moto accepts; the region s3fs signs for.
AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def save_capture(store: TraceStore, *, model: str = "enc", size: int = 2000) -> str:
    """Store one finished capture with a ``size``-byte trace, as the capture export does; returns its id."""
    cid = new_id()
    store.save({"id": cid, "model": model, "trigger": "manual", "status": "done", "outcome": "ok"},
               os.urandom(size), f"{worker_name()}.{time.time_ns()}.pt.trace.json.gz")
    return cid


class SilentServer:
    """A TCP listener on 127.0.0.1 that accepts every connection and never sends a byte: a store that hangs.

    Nothing runs in the background: the kernel completes each handshake (the listen backlog), and
    ``open_connections`` accepts what is queued and says how many the clients still hold open."""

    def __init__(self, port: int = 0) -> None:
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", port))
        self._listener.listen(64)
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._conns: list[socket.socket] = []

    def open_connections(self) -> int:
        """Connections the clients have not closed (a client's FIN or reset drops one); requests are read and
        dropped unanswered."""
        for _ in range(1000):  # what the backlog holds, at most
            try:
                conn, _ = self._listener.accept()
            except BlockingIOError:
                break
            conn.setblocking(False)
            self._conns.append(conn)
        still = []
        for conn in self._conns:
            closed = False
            for _ in range(64):  # what was sent is read first; the client's FIN is the empty read after it
                try:
                    if conn.recv(1 << 16) == b"":
                        closed = True
                        break
                except BlockingIOError:
                    break
                except OSError:
                    closed = True
                    break
            if closed:
                conn.close()
            else:
                still.append(conn)
        self._conns = still
        return len(still)

    def close(self) -> None:
        for conn in self._conns:
            conn.close()
        self._conns = []
        self._listener.close()


@contextmanager
def s3_server(port: int) -> Iterator[str]:
    """moto's S3 API on 127.0.0.1:``port`` from a thread of this process (state in memory); yields its URL.
    The port may have just been another listener's: werkzeug binds with SO_REUSEADDR, as a restarted store would."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    server = make_server("127.0.0.1", port, DomainDispatcherApplication(create_backend_app), threaded=True,
                         request_handler=MotoRequestHandler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="moto-s3", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
