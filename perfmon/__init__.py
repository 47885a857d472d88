"""perfmon: an in-process performance monitor for PyTorch inference.

    import perfmon
    monitor = perfmon.Monitor(port=0).start()
    model = monitor.wrap(model, name="encoder")
    app.add_middleware(perfmon.RequestMiddleware, monitor=monitor)  # queue / model / rest per request
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__
from .config import DEFAULT_BUCKETS, DEFAULT_HOST_BUCKETS, DEFAULT_PORT, FINE_BUCKETS, Config, log_buckets
from .exceptions import CaptureBusy, CaptureRateLimited, ConfigError, PerfmonError, PortUnavailable, WrapError

if TYPE_CHECKING:
    from . import testing as testing
    from .agent.clocks import CudaBackend, TimingEvent
    from .agent.requests import RequestBatch, RequestSpan
    from .agent.span import Span
    from .agent.wrap import MonitoredFunction, MonitoredModule
    from .captures.detector import RegressionPolicy
    from .http.apps import make_asgi_app, make_wsgi_app
    from .http.middleware import RequestMiddleware, WSGIRequestMiddleware
    from .monitor import Monitor

#: The names that import torch, imported at their first use: ``perfmon``'s command line, which drives an agent over
#: HTTP and needs none of them, starts without loading torch (~1-3 s and ~200 MB before it can say a word).
_LAZY = {
    "CudaBackend": "agent.clocks", "TimingEvent": "agent.clocks",
    "RequestBatch": "agent.requests", "RequestSpan": "agent.requests",
    "Span": "agent.span",
    "MonitoredFunction": "agent.wrap", "MonitoredModule": "agent.wrap",
    "RegressionPolicy": "captures.detector",
    "make_asgi_app": "http.apps", "make_wsgi_app": "http.apps",
    "RequestMiddleware": "http.middleware", "WSGIRequestMiddleware": "http.middleware",
    "Monitor": "monitor",
}

#: Public submodules reached as attributes (``perfmon.testing.FakeCuda()`` after a bare ``import perfmon``, as the
#: README writes it): imported at first use like the names above, since ``testing`` imports torch. Not in
#: ``__all__``: ``from perfmon import *`` stays the curated names.
_SUBMODULES = frozenset({"testing"})


if not TYPE_CHECKING:  # a type checker reads the imports above: a misspelled name stays an error there

    def __getattr__(name: str) -> Any:
        if name in _SUBMODULES:  # import_module binds it in globals(): found directly from now on
            return importlib.import_module(f".{name}", __name__)
        module = _LAZY.get(name)
        if module is None:
            raise AttributeError(f"module 'perfmon' has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{module}", __name__), name)
        globals()[name] = value  # found directly from now on
        return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, *_SUBMODULES})


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
