"""Dashboards and rules: structure, and every query proven against a real Prometheus scraping a live agent."""

from __future__ import annotations

import gc
import json
import math
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import perfmon
from perfmon.metrics.catalog import METRICS
from perfmon.testing import FakeCuda, FakeGpu, FakeNvml, FakeProfiler, FakeTorchMemory, GpuWork

from .conftest import promtool, wait_capture, wait_until
from .prom import running_prometheus

ROOT = Path(__file__).resolve().parents[1]
DASHBOARDS = sorted((ROOT / "grafana" / "dashboards").glob("*.json"))
RULES = ROOT / "deploy" / "prometheus" / "rules" / "perfmon.rules.yml"
METRIC_NAME = re.compile(r"(?<![:\w])(perfmon_[a-z0-9_]+|process_[a-z_]+)")


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def _targets(dash: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expr) for every panel target and annotation query."""
    out = [(p["title"], t["expr"]) for p in dash["panels"] if p["type"] != "row" for t in p["targets"]]
    out += [(a["name"], a["expr"]) for a in dash["annotations"]["list"] if "expr" in a]
    return out


def _rule_exprs() -> list[tuple[str, str]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [(r.get("record") or r["alert"], r["expr"]) for g in groups for r in g["rules"]]


def _registered(name: str) -> bool:
    if name in METRICS or name.startswith("process_"):
        return True
    for suffix in ("_bucket", "_sum", "_count"):
        base = name.removesuffix(suffix)
        if base != name and METRICS.get(base, ("",))[0] == "histogram":
            return True
    return False


def test_committed_dashboards_are_what_the_generator_makes() -> None:
    """grafana/dashboards/*.json equal the output of grafana/generate.py (edit the script, then run it)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("generate", ROOT / "grafana" / "generate.py")
    assert spec and spec.loader
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert {p.name: p.read_text() for p in DASHBOARDS} == gen.render()


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_structure(path: Path) -> None:
    """Valid JSON; unique uid and panel ids; every panel on the datasource variable; units; the four variables."""
    dash = _load(path)
    assert dash["schemaVersion"] >= 39 and dash["uid"].startswith("perfmon-")
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    names = [v["name"] for v in dash["templating"]["list"]]
    assert names == ["datasource", "job", "instance", "model", "gpu"]
    for p in dash["panels"]:
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"]), p["title"]
        assert p["fieldConfig"]["defaults"]["unit"], p["title"]
        for t in p["targets"]:
            assert "$job" in t["expr"] and "$instance" in t["expr"], (p["title"], t["expr"])
            if "rate(" in t["expr"] and "[1h]" not in t["expr"]:
                assert "$__rate_interval" in t["expr"], (p["title"], t["expr"])
    uids = [_load(p)["uid"] for p in DASHBOARDS]
    assert len(uids) == len(set(uids))


def _panels(name: str) -> list[dict[str, Any]]:
    return [p for p in _load(ROOT / "grafana" / "dashboards" / name)["panels"] if p["type"] != "row"]


def _unit(panel: dict[str, Any], ref: str) -> str:
    """The unit a target is drawn in: the panel's, or an override by its refId."""
    for o in panel["fieldConfig"]["overrides"]:
        if o["matcher"] == {"id": "byFrameRefID", "options": ref}:
            for prop in o["properties"]:
                if prop["id"] == "unit":
                    return str(prop["value"])
    return str(panel["fieldConfig"]["defaults"]["unit"])


def test_forward_calls_are_not_shown_as_requests_and_requests_are() -> None:
    """No target counting forward calls is drawn in requests/s (a generate() request is a prefill and a decode
    call per token); the Traffic row has a requests-per-second panel from generation requests and request spans."""
    for path in DASHBOARDS:
        for panel in (p for p in _load(path)["panels"] if p["type"] != "row"):
            for t in panel["targets"]:
                if "forward_calls" in t["expr"] and " / " not in t["expr"]:
                    assert _unit(panel, t["refId"]) != "reqps", (panel["title"], t["expr"])
                    assert "request" not in panel["title"].lower(), panel["title"]
    requests = next(p for p in _panels("perfmon-overview.json") if p["title"] == "Requests per second")
    exprs = " ".join(t["expr"] for t in requests["targets"])
    assert requests["fieldConfig"]["defaults"]["unit"] == "reqps"
    assert "rate(perfmon_generation_requests_total{" in exprs and "rate(perfmon_requests_total{" in exprs
    assert "forward_calls" not in exprs


def test_counters_are_read_over_a_range_and_shares_are_per_process() -> None:
    """Every perfmon counter a panel reads goes through rate() or increase() over a range (a raw counter counts
    since each process started and drops at a restart); the regression count is over the dashboard's range; no
    share (percentunit) sums across instances (N replicas would read N times the share)."""
    counter = re.compile(r"(perfmon_[a-z0-9_]+_total)\{[^}]*\}(\[)?")
    for path in DASHBOARDS:
        for title, expr in _targets(_load(path)):
            for name, ranged in counter.findall(expr):
                assert ranged, (title, name, expr)
    regression = next(p for p in _panels("perfmon-overview.json") if p["title"] == "Regression")
    detected = next(t for t in regression["targets"] if "perfmon_regressions_total" in t["expr"])
    assert "increase(perfmon_regressions_total{" in detected["expr"] and "[$__range]" in detected["expr"]
    assert detected["instant"] is True
    for path in DASHBOARDS:
        for panel in (p for p in _load(path)["panels"] if p["type"] != "row"):
            for t in panel["targets"]:
                if _unit(panel, t["refId"]) == "percentunit":
                    assert not re.search(r"\bsum\s*\(", t["expr"]), (panel["title"], t["expr"])
    gc_share = [t["expr"] for p in _panels("perfmon-overview.json") for t in p["targets"]
                if "perfmon_gc_pause_seconds_sum" in t["expr"]]
    assert gc_share and all("sum by (instance)" in e for e in gc_share), gc_share


def test_model_variable_lists_every_name_the_model_label_takes() -> None:
    """The $model variable reads forward models, generation names and request-span names (perfmon_requests_total's
    model label), so selecting a span's name keeps the Requests row."""
    for path in DASHBOARDS:
        var = next(v for v in _load(path)["templating"]["list"] if v["name"] == "model")
        names = re.search(r'__name__=~"([^"]+)"', var["query"]["query"])
        assert names, var["query"]
        assert {"perfmon_forward_calls_total", "perfmon_generation_requests_total",
                "perfmon_requests_total"} <= set(names.group(1).split("|"))


def test_latency_panels_show_exemplars_and_read_classic_or_native_histograms() -> None:
    """Forward-latency percentile targets enable exemplars; every latency query has a native-histogram branch."""
    latency = [t for p in DASHBOARDS for panel in _load(p)["panels"] if panel["type"] != "row"
               for t in panel["targets"] if re.search(r"(?<![:\w])perfmon_forward_duration_seconds", t["expr"])]
    assert latency
    for t in latency:
        if "histogram_quantile" in t["expr"]:
            assert t.get("exemplar") is True, t["expr"]
        # classic (_bucket or _sum/_count) or native (the bare histogram name): one side has data
        assert " or " in t["expr"] and re.search(r"perfmon_forward_duration_seconds\{", t["expr"]), t["expr"]


def test_every_metric_a_dashboard_or_rule_names_is_registered() -> None:
    """Each perfmon_* name in a dashboard or rule is one the package declares (read from the code)."""
    exprs = [e for p in DASHBOARDS for _, e in _targets(_load(p))] + [e for _, e in _rule_exprs()]
    names = {m for e in exprs for m in METRIC_NAME.findall(e)}
    assert names and not [n for n in sorted(names) if not _registered(n)]
    used = {n.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count") for n in names}
    # and the dashboards cover the serving, GPU and capture metrics the issue lists
    for required in ("perfmon_forward_calls_total", "perfmon_forward_errors_total", "perfmon_samples_dropped_total",
                     "perfmon_forward_items_total", "perfmon_forward_padded_items_total", "perfmon_forward_batch_size",
                     "perfmon_internal_errors_total", "perfmon_torch_memory_fragmentation_ratio",
                     "perfmon_gpu_process_memory_used_bytes", "perfmon_gpu_clocks_event_reasons",
                     "perfmon_captures_suppressed_total", "perfmon_capture_in_progress",
                     "perfmon_latency_baseline_seconds", "perfmon_regression_active",
                     "perfmon_time_to_first_token_seconds", "perfmon_inter_token_latency_seconds",
                     "perfmon_generated_tokens_total", "perfmon_prompt_tokens_total",
                     "perfmon_generation_requests_total", "perfmon_gc_pause_seconds",
                     "perfmon_samples_gc_overlap_total", "perfmon_request_seconds",
                     "perfmon_request_duration_seconds", "perfmon_requests_total",
                     "perfmon_model_occupancy_ratio", "perfmon_model_host_bound", "perfmon_model_host_device_ratio",
                     "perfmon_model_flops_per_second", "perfmon_model_bytes_per_second", "perfmon_model_mfu_ratio",
                     "perfmon_model_mbu_ratio", "perfmon_model_flops_unknown_ratio"):
        assert required in used, required


def test_promtool_checks_and_unit_tests_the_rules() -> None:
    """`promtool check rules` and `promtool test rules` pass on the shipped rules."""
    check = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, timeout=60)
    assert check.returncode == 0, check.stdout.decode() + check.stderr.decode()
    test = subprocess.run([promtool(), "test", "rules", "perfmon.rules.test.yml"], cwd=RULES.parent,
                          capture_output=True, timeout=120)
    assert test.returncode == 0, test.stdout.decode() + test.stderr.decode()


def test_every_alert_links_a_runbook_section() -> None:
    """Each alert's runbook annotation names a section of docs/runbook.md that exists."""
    sections = set(re.findall(r"^## (\S+)$", (ROOT / "docs" / "runbook.md").read_text(), flags=re.M))
    alerts = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r]
    assert {"PerfmonTimeToFirstTokenSLO", "PerfmonInterTokenLatencyRegression"} <= {r["alert"] for r in alerts}
    for rule in alerts:
        page, _, anchor = rule["annotations"]["runbook"].partition("#")
        assert page == "docs/runbook.md" and anchor in sections, rule["alert"]


def test_readme_lists_every_shipped_alert() -> None:
    """README's "Dashboards, alerts, deployment" section names every alert of the rules file, and no other."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Dashboards, alerts, deployment", 1)[1].split("\n## ", 1)[0]
    alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r}
    assert set(re.findall(r"`(Perfmon[A-Za-z0-9]+)`", section)) == alerts


def _substitute(expr: str, values: dict[str, str]) -> str:
    for var, val in values.items():
        expr = expr.replace(var, val)
    return expr


def _either_form_terms(expr: str) -> list[str]:
    """The parenthesised `classic or native` terms of an alert expression (offsets dropped: the live agent
    has no day of history): each must have data under either scrape, as the recording rules must."""
    terms = []
    for start, ch in enumerate(expr):
        if ch != "(":
            continue
        depth = 0
        for end in range(start, len(expr)):
            depth += {"(": 1, ")": -1}.get(expr[end], 0)
            if depth == 0:
                break
        inner = expr[start + 1:end]
        top, level = [], 0
        for c in inner:  # the inner text at its own top level: where an `or` joins the two forms
            level += {"(": 1, ")": -1}.get(c, 0)
            top.append(c if level == 0 else "_")
        if " or " in "".join(top) and "histogram_" in inner:
            terms.append(inner.replace(" offset 1d", ""))
    return terms


def test_either_form_terms_finds_the_itl_alerts_four_terms() -> None:
    """The helper finds what the live test evaluates: the ITL alert's p50 and token rate, now and a day ago."""
    groups = yaml.safe_load(RULES.read_text())["groups"]
    itl = next(r["expr"] for g in groups for r in g["rules"] if r.get("alert") == "PerfmonInterTokenLatencyRegression")
    terms = _either_form_terms(itl)
    assert len(terms) == 4 and all(" offset " not in t for t in terms)
    assert sum("histogram_quantile(0.50" in t for t in terms) == 2 and sum("histogram_count" in t for t in terms) == 2


def _arm(mon: perfmon.Monitor, model: str) -> dict[str, Any] | None:
    try:
        return mon.capture(model, steps=2)
    except perfmon.CaptureBusy:
        return None


def _has_data(result: list[dict[str, Any]]) -> bool:
    return any(not math.isnan(float(r["value"][1])) for r in result)


@pytest.mark.prometheus
@pytest.mark.parametrize("features", [(), ("native-histograms",)], ids=["classic", "native"])
def test_every_panel_and_recording_rule_returns_data_from_a_live_agent(make_monitor, tmp_path: Path,
                                                                       features: tuple[str, ...]) -> None:
    """A real Prometheus scrapes a live agent (models, request spans, a decode stream, fake GPU): every panel and
    rule has data,
    scraping text (classic buckets) or protobuf (native histograms; the forward-latency rules only with text, see
    docs/metrics.md)."""
    if shutil.which("prometheus") is None:
        pytest.skip("prometheus not installed (make test installs Debian's prometheus package when it can)")
    gpu = FakeGpu()
    nvml = FakeNvml()
    nvml.failing.add((1, "nvmlDeviceGetPowerUsage"))  # an NVML error series exists
    policy = perfmon.RegressionPolicy(window_seconds=1, baseline_windows=2, min_samples=5)
    mon = make_monitor(port=0, sample_rate=0.5, regression=policy, cuda=FakeCuda(gpu), nvml=nvml,
                       memory=FakeTorchMemory(), nvml_interval_seconds=0.5, resolve_interval_seconds=0.05,
                       trace_store=(tmp_path / "store").as_uri(),  # the upload panels: file:// store
                       profiler_factory=FakeProfiler.factory(gpu),  # a fake GPU capture: occupancy panels
                       peak_flops=1e12, peak_bandwidth=1e11).start()  # a peak on CPU: the MFU and MBU panels
    enc = mon.wrap(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32)),
                   name="encoder")
    on_gpu = mon.wrap(GpuWork(gpu, ms=2.0), name="gpu_model", device="cuda:0")
    tokenize = mon.instrument(lambda n: n, name="tokenize", items=lambda args, kwargs: (args[0], 16))
    # A custom decode loop: a stage= callable labels its forwards, monitor.stream times its tokens.
    decoder = mon.wrap(torch.nn.Linear(32, 32), name="decoder",
                       stage=lambda args, kwargs: "prefill" if args[0].shape[1] > 1 else "decode")
    mon.internal.report("test", RuntimeError("one internal fault, so its panel has a series"))
    stop = threading.Event()

    def decode_loop(prompt: int, new: int) -> Iterator[int]:
        decoder(torch.randn(1, prompt, 32))
        for i in range(new):
            yield i
            decoder(torch.randn(1, 1, 32))

    def drive() -> None:
        deadline = time.monotonic() + 120
        i = 0
        while not stop.is_set() and time.monotonic() < deadline:
            i += 1
            batch = 1 + (i // 200) % 64  # a new input shape every 200 calls: cold calls keep coming
            # A served request, named as a server names its route: queued, then the encoder (the Requests row,
            # which reads the span's name, not the encoder's).
            with mon.request(name="api") as request:
                request.enqueued()
                enc(torch.randn(batch, 32))
            on_gpu(torch.zeros(1))
            tokenize(1 + i % 16)
            gpu.finish()
            if i % 10 == 0:
                for _ in mon.stream(decode_loop(8 + i % 3, 4), name="decoder", prompt_tokens=8 + i % 3):
                    pass
            if i % 50 == 0:
                try:
                    enc(torch.randn(1, 7))  # wrong width: a user error, counted by class
                except RuntimeError:
                    pass
            stop.wait(0.001)

    def collect() -> None:  # GC pauses of each generation, from another thread than the serving one
        for i in range(600):  # at most 2 minutes, like the driver
            if stop.wait(0.2):
                return
            gc.collect(i % 3)

    t = threading.Thread(target=drive)
    t.start()
    collecting = threading.Thread(target=collect)
    collecting.start()
    try:
        wait_until(lambda: mon.stats()["models"]["encoder"]["calls"] > 10, what="the driver to start")
        cap = mon.capture("encoder", steps=2)
        wait_capture(mon, cap["id"])
        # A capture of the fake GPU model (its kernels as a trace): the occupancy panels. A baseline capture may
        # hold the slot for a moment.
        gpu_cap = wait_until(lambda: _arm(mon, "gpu_model"), what="a capture of the GPU model to arm")
        assert wait_capture(mon, gpu_cap["id"])["occupancy"]
        rules = tmp_path / "perfmon.rules.yml"
        rules.write_text(RULES.read_text().replace("interval: 30s", "interval: 1s"))
        instance = mon.url.removeprefix("http://")
        with running_prometheus(tmp_path, [instance], rule_files=[str(rules)], features=features) as prom:
            values = {"$__rate_interval": "10s", "$__range": "1m", "$job": "perfmon", "$instance": instance,
                      "$gpu": "0|1"}
            # $model as Grafana fills it: the names its variable's label_values() query finds in Prometheus.
            var = next(v for v in _load(DASHBOARDS[0])["templating"]["list"] if v["name"] == "model")
            selector = re.fullmatch(r"label_values\((.+), model\)", var["query"]["query"]).group(1)  # type: ignore[union-attr]
            count_by_model = f"count by (model) ({_substitute(selector, values)})"

            def models() -> set[str]:
                found = {r["metric"].get("model", "") for r in prom.query(count_by_model)} - {""}
                # Not "api": a variable that misses span names must show as the Requests row without data.
                return found if {"encoder", "gpu_model", "tokenize", "decoder"} <= found else set()

            values["$model"] = "|".join(sorted(wait_until(models, timeout=60, what="every model name scraped")))
            queries = [(f"{p.name}: {title}", _substitute(e, values)) for p in DASHBOARDS
                       for title, e in _targets(_load(p))]
            # A fleet median needs 3 replicas: those rules and panels are proven by tests/test_fleet.py.
            queries = [(n, q) for n, q in queries if "fleet_median" not in q]
            # The forward-latency rules read classic buckets `or` the native histogram (Prometheus 2.42 keeps
            # only the native form of a histogram it scraped natively): every rule records in both runs.
            recorded = [(name, expr) for name, expr in _rule_exprs()
                        if ":" in name and "fleet_median" not in name]
            queries += [(f"rule {name}", expr) for name, expr in recorded]
            queries += [(f"recorded {name}", name) for name, _ in recorded]
            # Alerts that read histograms themselves (the ITL regression): each `classic or native` term.
            queries += [(f"alert {name} term", term) for name, expr in _rule_exprs() if ":" not in name
                        for term in _either_form_terms(expr)]
            assert mon.profile(cap["id"])
            missing = queries

            def all_have_data() -> bool:
                nonlocal missing
                missing = [(n, q) for n, q in missing if not _has_data(prom.query(q))]
                return not missing

            try:
                wait_until(all_have_data, timeout=60, what="data for every query")
            except AssertionError:
                raise AssertionError("queries without data:\n" + "\n".join(f"{n}\n  {q}" for n, q in missing)) from None
    finally:
        stop.set()
        t.join(10)
        collecting.join(10)
