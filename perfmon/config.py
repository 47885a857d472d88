"""Validated, keyword-only configuration.

Every setting has a ``PERFMON_<NAME>`` environment variable; keyword arguments win over the
environment, and the environment wins over the defaults. Invalid values raise ``ConfigError``
naming the setting and where it came from.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import os
import re
import types
import typing
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .exceptions import ConfigError

__all__ = [
    "DEFAULT_BUCKETS",
    "DEFAULT_HOST_BUCKETS",
    "DEFAULT_PORT",
    "FINE_BUCKETS",
    "OTHER_VARIABLES",
    "REGRESSION_VARIABLE",
    "SENDABLE_TOKEN",
    "TOKEN_ENDS",
    "Config",
    "log_buckets",
]

#: No well-known exporter uses it (node_exporter 9100, dcgm-exporter 9400, OpenTelemetry 9464).
DEFAULT_PORT = 9478


def log_buckets(start: float, stop: float, per_decade: int) -> tuple[float, ...]:
    """Bucket bounds in seconds, ``per_decade`` log-spaced steps from ``start`` up to ``stop``."""
    out = []
    k0 = round(math.log10(start) * per_decade)
    k1 = round(math.log10(stop) * per_decade)
    for k in range(k0, k1 + 1):
        out.append(float(f"{10 ** (k / per_decade):.4g}"))
    return tuple(out)


# Forward duration buckets, in seconds. Prometheus' histogram_quantile interpolates linearly inside a
# bucket, so a narrow latency distribution is reported at its bucket's midpoint: the error is up to
# half the bucket's relative width. Every bound is a series per (model, device, phase, stage) on every
# scrape, so the default is held to a budget (docs/metrics.md, "Series budget"): 12 steps a decade
# (ratio 1.21, error <= ~10%, ~5% typical) over 1 ms .. 1 s, where inference forwards live, coarse
# tails from 0.1 ms and up to 60 s: 43 bounds, 44 bucket series per histogram, 88 for a model's cold
# and steady phases (half of FINE_BUCKETS' 178). The 12-a-decade bounds are every other bound of
# FINE_BUCKETS, so the two grids share their le values there. Error figures: benchmarks/BENCHMARKS.md.
DEFAULT_BUCKETS: tuple[float, ...] = (
    (0.0001, 0.00025, 0.0005)
    + log_buckets(0.001, 1.0, 12)
    + (2.5, 10.0, 60.0)
)

# The previous default, for those who want ~5% resolution and can pay its series: ``buckets=
# perfmon.FINE_BUCKETS`` (or PERFMON_BUCKETS=fine). 24 steps a decade (ratio 1.10, error <= ~5%) over
# 0.5 ms .. 1 s, coarse tails from 0.1 ms and up to 60 s: 88 bounds, 178 bucket series per model.
FINE_BUCKETS: tuple[float, ...] = (
    (0.0001, 0.0002, 0.0003)
    + log_buckets(0.0005, 1.0, 24)
    + (2.0, 5.0, 10.0, 20.0, 60.0)
)

# Host-side duration buckets: coarse on purpose (1-2-5), since host time is read against device time
# ("is this call launch-bound?"), not for percentiles, and every bucket is a series on every scrape.
DEFAULT_HOST_BUCKETS: tuple[float, ...] = tuple(
    float(f"{m * 10.0**e:.4g}") for e in range(-5, 2) for m in (1, 2, 5)
) + (60.0,)

_LOG_FORMATS = ("auto", "json", "console", "app")
_LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

#: A ``ConfigError`` names the setting, then its value unless the field hides it from ``repr`` (the token and
#: the store URL, which may carry credentials), then why: ``expected <type>``, or the field's own phrase.
_REFUSAL = "perfmon_refusal"
_BUCKETS_REFUSAL = "must be a non-empty, strictly increasing sequence of seconds > 0"


#: What a bearer token may hold: printable ASCII, no space at either end. An HTTP header cannot carry CR/LF (they would
#: end it) and http.client refuses them; other characters would go out in Latin-1, and end spaces are trimmed by
#: HTTP (and by ``http/security.py``): neither could ever match. The agent's ``token`` and the CLI's follow it.
SENDABLE_TOKEN = re.compile(r"[!-~](?:[ -~]*[!-~])?")
#: What is dropped from a token's ends (a secret file's newline): ASCII whitespace only, other spaces are refused.
TOKEN_ENDS = " \t\r\n\f\v"


def _refusal(why: str) -> dict[str, str]:
    """Field metadata: the phrase a ``ConfigError`` gives when this setting's value is refused (type or range)."""
    return {_REFUSAL: why}


@dataclass(frozen=True, kw_only=True)
class Config:
    """Every perfmon setting. Build it with ``Config.from_env(**overrides)``; units are in the names."""

    host: str = "127.0.0.1"
    #: HTTP port; 0 picks a free one; None serves nothing (mount ``wsgi_app``/``asgi_app`` yourself).
    port: int | None = field(default=DEFAULT_PORT, metadata=_refusal(
        "expected an integer 0..65535 (0 = any free port) or None (no server)"))
    #: Multi-process servers: bind the first free port of port .. port + port_range - 1 (one per worker).
    port_range: int = 1
    #: /healthz alone on a port of its own (None: only on ``port``): point the liveness probe at it, so a
    #: flood of connections to the agent's port cannot fill the probe's accept queue. With
    #: ``port_range`` each process takes the first free port of health_port .. health_port + range - 1.
    health_port: int | None = field(default=None, metadata=_refusal(
        "expected an integer 0..65535 (0 = any free port) or None (none)"))
    #: When no port of the range can be bound, raise ``PortUnavailable`` from start(). By default perfmon
    #: never fails the application's start: it logs an error naming the range, keeps counting and timing
    #: (the routes stay mountable) and retries the bind in the background.
    require_port: bool = False
    #: An HTTP connection to the agent lasts at most this long (slow or stuck clients are cut off).
    http_connection_timeout_seconds: float = 30.0
    #: Fraction of one CPU core the agent's own HTTP server may spend, on average (a flood of scrapes or
    #: bad requests is held in the kernel's queue beyond it, so it cannot take the model's time). At the
    #: limits (max_models models and as many generation names) two scrapers every 15 s take about half of
    #: the default (docs/reliability.md, "Scrapes at the documented limits").
    http_cpu_budget: float = 0.01
    #: Fraction of steady-state calls timed, in (0, 1]. Cold calls are always timed.
    sample_rate: float = 0.01
    #: A model with traffic gets at least one timed call per this many seconds.
    sample_floor_seconds: float = 1.0
    #: Fraction of a monitored model's own ``generate()`` calls whose tokens are timed (TTFT, inter-token
    #: latency), in (0, 1]; None: ``sample_rate``. The first call of each model is timed, and at least one per
    #: ``sample_floor_seconds``; so is every call given a streamer of the caller's and every assisted one. Every
    #: call's requests, tokens, prompt tokens, outcomes and durations are counted exactly either way. A timed call
    #: gets perfmon's streamer, for which Hugging Face copies each step's tokens to the host (measured +43.5 µs a
    #: token on an H100, +3..+6 on a CPU): 1.0 times every call at that price.
    generation_sample_rate: float | None = None
    #: The first calls of each model are cold (warm-up) and always timed.
    warmup_calls: int = 3
    #: Treat the first calls of a new input signature (tensor shapes and dtypes) as cold.
    track_signatures: bool = True
    #: How many first calls of each new signature are cold.
    signature_warmup_calls: int = 1
    #: Signatures remembered per model (oldest forgotten first).
    signature_cache_size: int = 256
    buckets: tuple[float, ...] = field(default=DEFAULT_BUCKETS, metadata=_refusal(_BUCKETS_REFUSAL))
    host_buckets: tuple[float, ...] = field(default=DEFAULT_HOST_BUCKETS, metadata=_refusal(_BUCKETS_REFUSAL))
    #: Timed samples waiting for the resolver; when full, samples are dropped (reason queue_full).
    queue_size: int = 8192
    #: CUDA event pairs preallocated per device; when all are in flight, samples are dropped.
    event_pool_size: int = 256
    #: How often the resolver polls CUDA events while some are in flight. With none in flight it sleeps a
    #: second (housekeeping) unless a quarter of the queue or event pool waits: an idle agent stays quiet.
    resolve_interval_seconds: float = 0.05
    #: The span of the exact percentiles reported by /stats.
    stats_window_seconds: float = 60.0
    #: Samples kept per model and phase for /stats (the oldest go first).
    stats_max_samples: int = 10_000
    #: Distinct exception class names per model before the rest are labelled "other".
    max_exception_labels: int = 16
    #: Distinct model names per monitor (each is a label value on every forward metric); the same cap
    #: applies separately to generation names (monitor.generation / monitor.stream).
    max_models: int = 64
    #: Generation records (tokens, request ends) waiting for the resolver; when full, they are dropped
    #: (perfmon_generation_dropped_total{reason="queue_full"}); counts stay exact. Request spans' records
    #: (agent/requests.py) have a queue of their own of the same size (/stats requests.models[m].dropped).
    generation_queue_size: int = 65_536
    #: Generation requests timed at once; beyond, a request is counted but not timed (reason="live_limit").
    max_live_generations: int = 10_000
    #: How long stop() waits for in-flight CUDA samples and threads.
    stop_timeout_seconds: float = 2.0
    #: Poll NVML for GPU telemetry (a no-op where NVML is absent).
    nvml: bool = True
    #: The shortest time between NVML polls (seconds), and the oldest reading a reader gets when its reads have no
    #: steady period. A poll is 9 NVML reads per GPU and a device count, and each read that hands the GIL over
    #: stalls a GIL-bound serving thread (~2.6 ms a poll of ~16 calls on a lent H200 host), so the poller polls for
    #: its readers: one poll 1.5 s before each scrape of a steady Prometheus slower than this, one a minute
    #: when nobody reads (telemetry/nvml.py).
    nvml_interval_seconds: float = 5.0
    #: Time the process's garbage-collection pauses (a ``gc.callbacks`` hook, ~1 µs a collection) and mark the
    #: timed calls and generation requests they overlapped (telemetry/gcpauses.py). Off, the hook still sums the full
    #: collections that run on the agent's HTTP thread, which its CPU budget leaves out (they are the heap's work).
    gc_pauses: bool = True
    #: Where captures and allocator snapshots go (created 0700).
    trace_dir: str = "./perfmon-traces"
    #: On a CUDA out-of-memory error in a monitored call, write one allocator snapshot to trace_dir.
    oom_snapshot: bool = False
    #: At most one OOM snapshot per this many seconds.
    oom_snapshot_cooldown_seconds: float = 600.0
    #: Bearer token required on the control and trace routes (/profile, /profiles...); never logged.
    token: str | None = field(default=None, repr=False, metadata=_refusal(
        "expected a string of at least 8 printable ASCII characters, its surrounding whitespace dropped (or None)"))
    #: Extra host names a request to the control and trace routes may name in its Host header (besides
    #: localhost, IP addresses of the agent and its bound address): e.g. a Service name. Refusing other
    #: names stops DNS rebinding. "*" allows any. PERFMON_ALLOWED_HOSTS is comma-separated.
    allowed_hosts: tuple[str, ...] = ()
    #: Captures kept in trace_dir (oldest removed first), and their total size.
    trace_max_files: int = 20
    trace_max_bytes: int = 512 * 2**20
    #: Upload every finished capture to this fsspec URL (s3://bucket/prefix, gs://, az://, file://...) off the
    #: serving thread; trace_dir becomes the bounded spool (perfmon.store.uploader). None: captures stay local.
    #: Credentials and endpoint come from the SDK's chain (AWS_ENDPOINT_URL...); the URL is never logged whole.
    trace_store: str | None = field(default=None, repr=False, metadata=_refusal(
        "expected an fsspec URL such as s3://bucket/prefix (or None)"))
    #: One upload request may take this long to connect, and to read, before the attempt counts as failed.
    trace_upload_timeout_seconds: float = 30.0
    #: Failed uploads are retried after 1 s, 2 s, 4 s ... at most this long apart.
    trace_upload_max_backoff_seconds: float = 300.0
    #: Manual (HTTP/API) captures allowed per hour; beyond, 429.
    manual_captures_per_hour: int = 30
    #: An armed capture whose model is not called within this many seconds is aborted.
    capture_arm_timeout_seconds: float = 60.0
    #: Memory one capture may add to this process, bytes: the recording ends early once its RSS growth,
    #: plus what the profiler's stop() adds (estimated, see capture.STOP_GROWTH_FACTOR), would pass it.
    capture_max_bytes: int = 256 * 2**20
    #: The export child (trace summary + gzip) is killed after this long and the capture fails.
    capture_export_timeout_seconds: float = 120.0
    #: Initialise the profiler (~1 s, once per process) in start(), before traffic, so the first
    #: capture does not stall a request. Never in a process that is about to fork workers (a
    #: pre-fork server's master, e.g. gunicorn --preload): a child forked from a process whose
    #: profiler ran hangs or aborts at exit; there each worker prepares its own after the fork.
    prepare_profiler: bool = True
    #: A capture's device occupancy decides a CUDA model's host-bound verdict while it is younger than this;
    #: then the live host/device ratio does until the next capture (stats/occupancy.py). Baseline captures are
    #: retaken every 6 h by default.
    occupancy_capture_max_age_seconds: float = 12 * 3600.0
    #: Override the device peaks used by the capture roofline (FLOP/s and memory bytes/s); both or neither.
    peak_flops: float | None = field(default=None, metadata=_refusal("must be a positive number (or None)"))
    peak_bandwidth: float | None = field(default=None, metadata=_refusal("must be a positive number (or None)"))
    #: Count each input signature's FLOPs and bytes once, off the request path (a counting thread), by running the
    #: wrapped module's forward on a fake copy of it (torch's FakeTensorMode: no memory, no compute), for live FLOP/s,
    #: bytes/s, MFU and MBU (perfmon/agent/flopcount.py). start() pays torch's one-time import (~1 s). The forward's
    #: Python runs once more per counted signature, on the copy: side effects outside the module (logging) repeat.
    count_flops: bool = True
    #: At most this many signature counts a minute (a model whose signatures churn is counted as far as this
    #: goes; its other calls are "unknown").
    flop_counts_per_minute: int = 20
    #: The share of wall time the counting thread may spend counting, after a first burst of
    #: ``FLOP_COUNT_BURST_SECONDS``: a count holds the GIL (a GPT-2 prefill's ~50 ms), which the serving thread
    #: waits for, so a model whose signatures keep coming is counted at this pace, not flop_counts_per_minute's.
    flop_count_share: float = 0.001
    #: A fake copy or fake forward still working after this long (seconds of work: a count pauses nine tenths of
    #: its time, flopcount.FLOP_COUNT_DUTY) is abandoned and its signature is "unknown".
    flop_count_timeout_seconds: float = 2.0
    #: "auto" (console on a TTY, JSON lines otherwise), "json", "console", or "app" (use the
    #: application's own structlog configuration).
    log_format: str = "auto"
    log_level: str = "info"
    #: Free-form, for the application: not a setting (no PERFMON_ variable, no check).
    extra: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._check()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Config:
        """Defaults, then ``PERFMON_*`` variables from ``environ``, then ``overrides``."""
        environ = os.environ if environ is None else environ
        kinds = _kinds()
        unknown = sorted(set(overrides) - set(kinds))
        if unknown:
            raise ConfigError(f"unknown setting(s): {', '.join(unknown)}; known: {', '.join(sorted(kinds))}")
        values: dict[str, Any] = {}
        for name, kind in kinds.items():
            var = "PERFMON_" + name.upper()
            if name in overrides:
                values[name] = overrides[name]
            elif var in environ:
                values[name] = _parse(var, environ[var], kind)
        _warn_unknown(environ, {"PERFMON_" + name.upper() for name in kinds} | set(OTHER_VARIABLES))
        return cls(**values)

    def _check(self) -> None:
        def bad(name: str, why: str | None = None) -> ConfigError:
            return _refused(name, getattr(self, name), why)

        for name in ("buckets", "host_buckets"):
            # First: bounds are often written as a list; any sequence of numbers is taken, stored as floats.
            b = getattr(self, name)
            try:
                ok = (len(b) >= 1 and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in b)
                      and all(x < y for x, y in itertools.pairwise(b)) and b[0] > 0)
            except TypeError:
                ok = False
            if not ok:
                raise bad(name)
            object.__setattr__(self, name, tuple(float(v) for v in b if not math.isinf(v)))
        for name, kind in _kinds().items():
            if not kind.accepts(getattr(self, name)):
                raise bad(name)
        for name in ("port", "health_port"):
            if getattr(self, name) is not None and not 0 <= getattr(self, name) <= 65535:
                raise bad(name)
        if not self.host:
            raise bad("host", "must not be empty")
        if not self.trace_dir:
            raise bad("trace_dir", "must not be empty")
        for name in ("sample_rate", "generation_sample_rate"):
            rate = getattr(self, name)
            if rate is not None and (not 0.0 < rate <= 1.0 or math.isnan(rate)):
                raise bad(name, "must be in (0, 1]")
        if not 0.0 < self.http_cpu_budget <= 1.0 or math.isnan(self.http_cpu_budget):
            raise bad("http_cpu_budget", "must be a fraction of one core in (0, 1]")
        if not 0.0 < self.flop_count_share <= 1.0 or math.isnan(self.flop_count_share):
            raise bad("flop_count_share", "must be a share of wall time in (0, 1]")
        positive = ("sample_floor_seconds", "resolve_interval_seconds", "stats_window_seconds",
                    "stop_timeout_seconds", "nvml_interval_seconds", "oom_snapshot_cooldown_seconds",
                    "capture_arm_timeout_seconds", "http_connection_timeout_seconds",
                    "capture_export_timeout_seconds", "trace_upload_timeout_seconds",
                    "trace_upload_max_backoff_seconds", "occupancy_capture_max_age_seconds",
                    "flop_count_timeout_seconds")
        for name in positive:
            if not getattr(self, name) > 0 or math.isinf(getattr(self, name)):
                raise bad(name, "must be a finite number of seconds > 0")
        for name in ("peak_flops", "peak_bandwidth"):
            v = getattr(self, name)
            if v is not None and not 0 < v < math.inf:
                raise bad(name)
        if (self.peak_flops is None) != (self.peak_bandwidth is None):
            raise ConfigError("peak_flops and peak_bandwidth: set both or neither")
        if not all(isinstance(h, str) and h.strip() for h in self.allowed_hosts):
            raise bad("allowed_hosts", "expected host names (strings)")
        if self.trace_store is not None and "://" not in self.trace_store:
            raise bad("trace_store")
        if self.token is not None:
            # A token read from a secret file ends in a newline: the ends of a header value never arrive (HTTP trims
            # them), so as given such a token could never be matched. PERFMON_TOKEN is stripped the same way.
            object.__setattr__(self, "token", self.token.strip(TOKEN_ENDS))
            if len(self.token) < 8 or not SENDABLE_TOKEN.fullmatch(self.token):
                raise bad("token")
        for name in ("port_range", "signature_cache_size", "queue_size", "event_pool_size", "stats_max_samples",
                     "max_exception_labels", "max_models", "signature_warmup_calls", "trace_max_files",
                     "generation_queue_size", "max_live_generations",
                     "trace_max_bytes", "manual_captures_per_hour", "capture_max_bytes", "flop_counts_per_minute"):
            if getattr(self, name) < 1:
                raise bad(name, "must be >= 1")
        if self.warmup_calls < 0:
            raise bad("warmup_calls", "must be >= 0")
        if self.log_format not in _LOG_FORMATS:
            raise bad("log_format", f"must be one of {', '.join(_LOG_FORMATS)}")
        if self.log_level.lower() not in _LOG_LEVELS:
            raise bad("log_level", f"must be one of {', '.join(_LOG_LEVELS)}")
        if self.sample_rate > 0.1:
            # Legal, and right for tests and benchmarks; in production it multiplies the agent's cost.
            warnings.warn(
                f"perfmon sample_rate={self.sample_rate} times more than 10% of calls; "
                "production serving normally uses 0.01-0.05",
                stacklevel=_caller_stacklevel(),
            )


#: The regression policy's switch, read by captures/policy.py, not by ``Config``.
REGRESSION_VARIABLE = "PERFMON_REGRESSION"
#: ``PERFMON_*`` variables read outside ``Config``: not unknown. ``PERFMON_ENABLED`` is an application's switch
#: (examples/server.py's: whether to embed perfmon at all), which users copy.
OTHER_VARIABLES = (REGRESSION_VARIABLE, "PERFMON_ENABLED")


def _warn_unknown(environ: Mapping[str, str], known: set[str]) -> None:
    """Warn once per ``PERFMON_*`` variable no setting reads, naming the nearest one: a misspelt variable was
    ignored without a word (``PERFMON_SAMPLE_RAT``), where a misspelt keyword is a ``ConfigError``. A warning, not
    an error: another tool may share the prefix."""
    import difflib

    for var in sorted(v for v in environ if v.startswith("PERFMON_") and v not in known):
        near = difflib.get_close_matches(var, sorted(known), n=1, cutoff=0.8)  # a misspelling, not a guess
        hint = f"; did you mean {near[0]}?" if near else ""
        # Python's default warning filter shows each message once per place: a monitor per worker says it once.
        warnings.warn(f"{var[:80]} is not a perfmon setting and is ignored{hint}", stacklevel=_caller_stacklevel())


def _caller_stacklevel() -> int:
    """The warnings stack level of the first frame outside perfmon (the user's call)."""
    import sys

    frame = sys._getframe(1)
    level = 1
    package = __name__.rpartition(".")[0]
    while frame is not None and frame.f_globals.get("__name__", "").startswith(package + "."):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    # dataclass-generated __init__ reports the dataclass module's name: skip it too
    while frame is not None and frame.f_code.co_name == "__init__" and frame.f_code.co_filename.startswith("<"):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level


def _refused(name: str, value: Any, why: str | None = None) -> ConfigError:
    """The ``ConfigError`` refusing ``value`` for setting ``name`` (the message's shape: ``_REFUSAL``)."""
    f = Config.__dataclass_fields__[name]
    why = why or f.metadata.get(_REFUSAL) or f"expected {_kinds()[name].name}"
    return ConfigError(f"{name}={value!r}: {why}" if f.repr else f"{name}: {why}")


@dataclass(frozen=True)
class _Kind:
    """A setting's type, read from its annotation: the classes a value may be, and whether it may be None."""

    #: The annotation without ``| None``: str, int, float, bool or a tuple[...] (what ``_parse`` reads).
    base: Any
    classes: tuple[type, ...]
    optional: bool

    @property
    def name(self) -> str:
        """``int``, ``int or float``, ``str or None``...: what the value should have been."""
        return " or ".join([c.__name__ for c in self.classes] + (["None"] if self.optional else []))

    def accepts(self, value: Any) -> bool:
        """Whether ``value`` is of this type (``None`` only where the annotation allows it)."""
        if value is None:
            return self.optional
        # bool is an int subclass: True is not a valid count, nor a number of seconds.
        return isinstance(value, self.classes) and (self.classes == (bool,) or not isinstance(value, bool))


#: The runtime classes of each annotation a setting may have; a float setting takes an int too (``sample_rate=1``,
#: ``stop_timeout_seconds=5``). Any other annotation fails when the types are first read (``TypeError``), so no
#: setting goes unchecked.
_CLASSES: dict[Any, tuple[type, ...]] = {str: (str,), int: (int,), float: (int, float), bool: (bool,),
                                         tuple: (tuple,)}


@functools.cache
def _kinds() -> dict[str, _Kind]:
    """Every setting's type, from ``Config``'s annotations (``extra`` is not a setting)."""
    hints = typing.get_type_hints(Config)
    out: dict[str, _Kind] = {}
    for f in dataclasses.fields(Config):
        if f.name == "extra":
            continue
        hint = hints[f.name]
        args = typing.get_args(hint)
        optional = typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args
        if optional:
            rest = [a for a in args if a is not type(None)]
            if len(rest) != 1:
                raise TypeError(f"Config.{f.name}: {hint} is not one type or None")
            hint = rest[0]
        classes = _CLASSES.get(typing.get_origin(hint) or hint)
        if classes is None:
            raise TypeError(f"Config.{f.name}: no check for a {hint} setting; add its classes to _CLASSES")
        out[f.name] = _Kind(hint, classes, optional)
    return out


def _parse(var: str, raw: str, kind: _Kind) -> Any:
    """Parse one environment variable by its setting's type."""
    text = raw.strip()
    base = typing.get_origin(kind.base) or kind.base
    try:
        if base is bool:
            low = text.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError("expected true/false")
        # Empty is None; a port may also be switched off by name (PERFMON_PORT=off serves nothing).
        if kind.optional and (not text or (base is int and text.lower() in ("none", "off"))):
            return None
        if var == "PERFMON_BUCKETS" and text.lower() == "fine":
            return FINE_BUCKETS
        if base is int:
            return int(text)
        if base is float:
            return float(text)
        if base is tuple:
            (item, *_) = typing.get_args(kind.base)
            return tuple(item(p.strip()) for p in text.split(",") if p.strip())
        return text
    except ValueError as exc:
        raise ConfigError(f"{var}={raw!r}: {exc}") from None
