"""perfmon: an in-process performance monitor for PyTorch inference.

    import perfmon
    monitor = perfmon.Monitor(port=0).start()
    model = monitor.wrap(model, name="encoder")
    app.add_middleware(perfmon.RequestMiddleware, monitor=monitor)  # queue / model / rest per request
"""

from __future__ import annotations

from ._version import __version__
from .agent.clocks import CudaBackend, TimingEvent
from .agent.requests import RequestBatch, RequestSpan
from .agent.span import Span
from .agent.wrap import MonitoredFunction, MonitoredModule
from .captures.detector import RegressionPolicy
from .config import DEFAULT_BUCKETS, DEFAULT_HOST_BUCKETS, DEFAULT_PORT, FINE_BUCKETS, Config, log_buckets
from .exceptions import CaptureBusy, CaptureRateLimited, ConfigError, PerfmonError, PortUnavailable, WrapError
from .http.apps import make_asgi_app, make_wsgi_app
from .http.middleware import RequestMiddleware, WSGIRequestMiddleware
from .monitor import Monitor

__all__ = [
    "DEFAULT_BUCKETS",
    "DEFAULT_HOST_BUCKETS",
    "DEFAULT_PORT",
    "FINE_BUCKETS",
    "CaptureBusy",
    "CaptureRateLimited",
    "Config",
    "ConfigError",
    "CudaBackend",
    "Monitor",
    "MonitoredFunction",
    "MonitoredModule",
    "PerfmonError",
    "PortUnavailable",
    "RegressionPolicy",
    "RequestBatch",
    "RequestMiddleware",
    "RequestSpan",
    "Span",
    "TimingEvent",
    "WSGIRequestMiddleware",
    "WrapError",
    "__version__",
    "log_buckets",
    "make_asgi_app",
    "make_wsgi_app",
]
