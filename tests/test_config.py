"""Configuration: keyword arguments, PERFMON_* variables, validation."""

from __future__ import annotations

import itertools

import pytest

import perfmon
from perfmon.config import Config


def test_env_is_read_and_keywords_win() -> None:
    """PERFMON_* variables set settings, and keyword arguments override them."""
    env = {"PERFMON_SAMPLE_RATE": "0.05", "PERFMON_PORT": "0", "PERFMON_HOST": "0.0.0.0",
           "PERFMON_TRACK_SIGNATURES": "false", "PERFMON_BUCKETS": "0.001,0.01,0.1"}
    cfg = Config.from_env(env)
    assert cfg.sample_rate == 0.05 and cfg.port == 0 and cfg.host == "0.0.0.0"
    assert cfg.track_signatures is False and cfg.buckets == (0.001, 0.01, 0.1)
    cfg = Config.from_env(env, sample_rate=0.02, host="127.0.0.1")
    assert cfg.sample_rate == 0.02 and cfg.host == "127.0.0.1" and cfg.port == 0


def test_port_off_from_env() -> None:
    """PERFMON_PORT=off means no HTTP server."""
    assert Config.from_env({"PERFMON_PORT": "off"}).port is None


@pytest.mark.parametrize(
    ("kw", "fragment"),
    [
        ({"sample_rate": 0.0}, "sample_rate"),
        ({"sample_rate": 1.5}, "sample_rate"),
        ({"http_cpu_budget": 0}, "http_cpu_budget"),
        ({"http_cpu_budget": 2.0}, "http_cpu_budget"),
        ({"http_cpu_budget": float("nan")}, "http_cpu_budget"),
        ({"port": 70000}, "port"),
        ({"port": True}, "port"),
        ({"warmup_calls": -1}, "warmup_calls"),
        ({"queue_size": 0}, "queue_size"),
        ({"buckets": (0.1, 0.01)}, "buckets"),
        ({"buckets": ()}, "buckets"),
        ({"log_format": "xml"}, "log_format"),
        ({"sample_floor_seconds": 0}, "sample_floor_seconds"),
        ({"track_signatures": "yes"}, "track_signatures"),
        ({"no_such_setting": 1}, "unknown setting"),
    ],
)
def test_bad_settings_raise_config_error(kw: dict[str, object], fragment: str) -> None:
    """Out-of-range or mistyped settings raise ConfigError naming the setting."""
    with pytest.raises(perfmon.ConfigError, match=fragment):
        Config.from_env({}, **kw)


def test_bad_env_names_the_variable() -> None:
    """A malformed environment variable's error names the variable."""
    with pytest.raises(perfmon.ConfigError, match="PERFMON_QUEUE_SIZE"):
        Config.from_env({"PERFMON_QUEUE_SIZE": "lots"})


def test_harmful_sample_rate_warns_at_the_callers_line() -> None:
    """A legal but costly sample rate warns, attributed to the user's code."""
    with pytest.warns(UserWarning, match="sample_rate") as record:
        perfmon.Monitor(port=None, sample_rate=1.0)
    assert record[0].filename == __file__


def test_default_port_avoids_well_known_exporters() -> None:
    """The default port is none of node_exporter's, dcgm-exporter's or OpenTelemetry's."""
    assert perfmon.DEFAULT_PORT not in (9100, 9400, 9464)
    assert Config.from_env({}).port == perfmon.DEFAULT_PORT


def test_default_buckets_resolve_within_eleven_percent_from_one_ms_to_one_s() -> None:
    """Adjacent default bounds differ by at most ~21% from 1 ms to 1 s (half a bucket: ~10%); FINE_BUCKETS by ~10%."""
    b = [x for x in perfmon.DEFAULT_BUCKETS if 0.001 <= x <= 1.0]
    assert max(hi / lo for lo, hi in itertools.pairwise(b)) < 1.22
    assert perfmon.DEFAULT_BUCKETS[0] <= 0.0001 and perfmon.DEFAULT_BUCKETS[-1] >= 60
    fine = [x for x in perfmon.FINE_BUCKETS if 0.0005 <= x <= 1.0]
    assert max(hi / lo for lo, hi in itertools.pairwise(fine)) < 1.11
    # the default's 12-a-decade bounds are FINE_BUCKETS' every other one: the two grids share those le values
    assert set(b) <= set(perfmon.FINE_BUCKETS)
    assert Config.from_env({"PERFMON_BUCKETS": "fine"}).buckets == perfmon.FINE_BUCKETS


def test_perfmon_regression_off_on_or_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """PERFMON_REGRESSION switches the default policy off or on, and a value it does not know is refused with the
    variable named (``disabled`` used to leave detection on, silently), as every other PERFMON_* setting is."""
    from perfmon import RegressionPolicy
    from perfmon.captures.policy import FROM_ENV, resolve_policy

    for off in ("off", "0", "False", " none "):
        assert resolve_policy(FROM_ENV, {"PERFMON_REGRESSION": off}) is None
    for on in ("on", "1", "true", ""):
        assert isinstance(resolve_policy(FROM_ENV, {"PERFMON_REGRESSION": on}), RegressionPolicy)
    assert isinstance(resolve_policy(FROM_ENV, {}), RegressionPolicy)
    monkeypatch.setenv("PERFMON_REGRESSION", "disabled")
    with pytest.raises(perfmon.ConfigError, match="PERFMON_REGRESSION='disabled'"):
        perfmon.Monitor(port=None)


def test_a_misspelt_perfmon_variable_is_a_warning_naming_the_nearest_setting() -> None:
    """PERFMON_SAMPLE_RAT was ignored without a word, where a misspelt keyword is a ConfigError: it warns now, with
    the nearest variable; the regression switch (read outside Config) is no unknown, nor is any setting's."""
    import warnings

    with pytest.warns(UserWarning, match=r"PERFMON_SAMPLE_RAT is not a perfmon setting .*PERFMON_SAMPLE_RATE\?"):
        cfg = perfmon.Config.from_env({"PERFMON_SAMPLE_RAT": "0.5", "PERFMON_SAMPLE_RATE": "0.02"})
    assert cfg.sample_rate == 0.02
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        perfmon.Config.from_env({"PERFMON_REGRESSION": "off", "PERFMON_TRACE_DIR": "/tmp/x", "OTHER_TOOL": "1",
                                 "PERFMON_ENABLED": "1"})  # examples/server.py's own switch, which users copy
