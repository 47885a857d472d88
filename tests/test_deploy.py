"""Deploy files parse, reference what exists, and fit together; the example server works."""

from __future__ import annotations

import configparser
import importlib
import json
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"


def _yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def _k8s() -> dict[str, dict[str, Any]]:
    docs = {}
    for p in sorted(K8S.glob("*.yaml")):
        doc = _yaml(p)
        if doc.get("kind") and doc["kind"] != "Kustomization":
            docs[doc["kind"]] = doc
    return docs


def test_compose_parses_and_every_referenced_file_exists() -> None:
    """docker-compose.yml: build context, Dockerfile and every mounted host path exist."""
    compose = _yaml(DEPLOY / "docker-compose.yml")
    services = compose["services"]
    assert set(services) == {"app", "prometheus", "grafana"}
    build = services["app"]["build"]
    context = (DEPLOY / build["context"]).resolve()
    assert (context / build["dockerfile"]).is_file() and context == ROOT
    for name, svc in services.items():
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), (name, source)
    assert "PERFMON_TOKEN" in services["app"]["environment"]
    prom = _yaml(DEPLOY / "prometheus" / "prometheus.yml")
    app_port = services["app"]["environment"]["PERFMON_PORT"]
    assert prom["scrape_configs"][0]["static_configs"][0]["targets"] == [f"app:{app_port}"]
    for rule_file in prom["rule_files"]:
        assert (DEPLOY / "prometheus" / rule_file).is_file()


def test_dockerfile_copies_what_exists_and_runs_the_example() -> None:
    """The example Dockerfile copies existing paths and starts examples.server:app."""
    text = (ROOT / "examples" / "Dockerfile").read_text()
    for line in text.splitlines():
        if line.startswith("COPY "):
            for src in line.split()[1:-1]:
                assert (ROOT / src).exists(), src
    assert "examples.server:app" in text and "USER perfmon" in text


def test_grafana_provisioning_points_at_the_dashboards() -> None:
    """The provisioned dashboard path is where compose mounts grafana/dashboards; the datasource is Prometheus."""
    compose = _yaml(DEPLOY / "docker-compose.yml")
    mounts = dict(v.split(":")[:2] for v in compose["services"]["grafana"]["volumes"])
    provider = _yaml(ROOT / "grafana" / "provisioning" / "dashboards" / "perfmon.yaml")["providers"][0]
    assert provider["options"]["path"] == mounts["../grafana/dashboards"]
    ds = _yaml(ROOT / "grafana" / "provisioning" / "datasources" / "perfmon.yaml")["datasources"][0]
    assert ds["type"] == "prometheus" and ds["url"].startswith("http://prometheus:")


def test_kubernetes_objects_fit_together() -> None:
    """Selectors match pod labels, port names match, the token comes from the Secret, rules equal the rules file."""
    docs = _k8s()
    assert {"Deployment", "Service", "PodMonitor", "PrometheusRule", "NetworkPolicy", "Secret"} <= set(docs)
    dep = docs["Deployment"]
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    container = dep["spec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    env = {e["name"]: e for e in container["env"]}
    assert ports["perfmon"] == int(env["PERFMON_PORT"]["value"])
    assert ports["perfmon-health"] == int(env["PERFMON_HEALTH_PORT"]["value"])
    assert container["livenessProbe"]["httpGet"]["port"] == "perfmon-health"
    assert env["PERFMON_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == docs["Secret"]["metadata"]["name"]
    assert docs["Service"]["spec"]["selector"].items() <= pod_labels.items()
    assert all(p["targetPort"] in ports for p in docs["Service"]["spec"]["ports"])
    pm = docs["PodMonitor"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert all(e["port"] in ports for e in pm["spec"]["podMetricsEndpoints"])
    np = docs["NetworkPolicy"]
    assert np["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert {p["port"] for rule in np["spec"]["ingress"] for p in rule["ports"]} <= set(ports)
    rules = _yaml(DEPLOY / "prometheus" / "rules" / "perfmon.rules.yml")
    assert docs["PrometheusRule"]["spec"]["groups"] == rules["groups"]
    kustomize = _yaml(K8S / "kustomization.yaml")
    assert all((K8S / r).is_file() for r in kustomize["resources"])


def _operator_job(monitor: dict[str, Any], endpoint: dict[str, Any], namespace: str,
                  pod_labels: dict[str, str]) -> str:
    """The job label the Prometheus Operator gives a PodMonitor endpoint's targets: ``<namespace>/<name>``, or
    the pod label that ``jobLabel`` names, then the endpoint's relabelings (only the ``replace`` form that sets
    ``job`` from a fixed replacement is modelled; anything else touching ``job`` fails the test)."""
    job = pod_labels.get(monitor["spec"]["jobLabel"], "") if "jobLabel" in monitor["spec"] else \
        f"{namespace}/{monitor['metadata']['name']}"
    for r in endpoint.get("relabelings", []):
        if r.get("targetLabel") != "job":
            continue
        assert r.get("action", "replace") == "replace" and not r.get("sourceLabels"), r
        job = r["replacement"]
    return job


def test_podmonitor_gives_the_job_the_rules_select() -> None:
    """Under the Prometheus Operator the PodMonitor's targets get the job PerfmonAgentDown selects, and the one
    deploy/prometheus/prometheus.yml names (without a relabeling it is <namespace>/perfmon-example: no alert)."""
    import re

    docs = _k8s()
    pm = docs["PodMonitor"]
    pod_labels = docs["Deployment"]["spec"]["template"]["metadata"]["labels"]
    rules = _yaml(DEPLOY / "prometheus" / "rules" / "perfmon.rules.yml")
    down = next(r for g in rules["groups"] for r in g["rules"] if r.get("alert") == "PerfmonAgentDown")
    selected = set(re.findall(r'\bup\{job="([^"]+)"\}', down["expr"]))
    assert len(selected) == 1, down["expr"]
    compose_job = _yaml(DEPLOY / "prometheus" / "prometheus.yml")["scrape_configs"][0]["job_name"]
    for endpoint in pm["spec"]["podMetricsEndpoints"]:
        assert {_operator_job(pm, endpoint, ns, pod_labels) for ns in ("default", "serving")} == selected
    assert selected == {compose_job}


def test_systemd_unit_is_hardened() -> None:
    """The unit runs as a user with NoNewPrivileges, ProtectSystem and a restart policy; its env file exists."""
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read(DEPLOY / "systemd" / "perfmon-example.service")
    svc = unit["Service"]
    assert svc["User"] == "perfmon" and svc["NoNewPrivileges"] == "yes" and svc["ProtectSystem"] == "strict"
    assert svc["Restart"] == "on-failure"
    env = (DEPLOY / "systemd" / "perfmon-example.env").read_text()
    assert "PERFMON_TOKEN=" in env and "PERFMON_HOST=127.0.0.1" in env


def test_example_server_serves_predictions_and_mounted_metrics(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """The FastAPI example under uvicorn answers /predict and exposes perfmon's routes under /perfmon."""
    pytest.importorskip("fastapi")  # the dev extras install both; a bare Python (the GPU machines) may not
    uvicorn = pytest.importorskip("uvicorn")

    from .conftest import wait_until
    from .prom import free_port

    monkeypatch.setenv("PERFMON_PORT", "off")
    monkeypatch.setenv("PERFMON_TRACE_DIR", str(tmp_path))
    monkeypatch.setenv("PERFMON_PREPARE_PROFILER", "false")
    monkeypatch.setenv("PERFMON_LOG_LEVEL", "error")
    monkeypatch.setenv("PERFMON_TOKEN", "example-token-123")
    monkeypatch.syspath_prepend(str(ROOT))
    sys.modules.pop("examples.server", None)
    server = importlib.import_module("examples.server")
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(server.app, host="127.0.0.1", port=port, log_level="error", lifespan="on"))
    thread = threading.Thread(target=uv.run)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: uv.started, what="uvicorn to start")
        for n in (3, 5, 5):
            status, body = _http(base + "/predict", {"tokens": [[0.1] * server.D_MODEL] * n})
            assert status == 200 and len(json.loads(body)["embedding"]) == server.D_MODEL
        assert _http(base + "/predict", {"tokens": [[0.1] * 3]})[0] == 400
        status, body = _http(base + "/perfmon/metrics")
        assert status == 200 and b'perfmon_forward_calls_total{model="encoder",stage=""} 3.0' in body
        assert _http(base + "/perfmon/profiles")[0] == 401  # mounted: the token is required
        status, body = _http(base + "/perfmon/profiles", headers={"Authorization": "Bearer example-token-123"})
        assert status == 200 and json.loads(body) == {"profiles": []}
    finally:
        uv.should_exit = True
        thread.join(30)
    assert not server.monitor.running


def _http(url: str, payload: Any = None, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    from .conftest import http

    data = None if payload is None else json.dumps(payload).encode()
    status, _, body = http(url, data, headers={"Content-Type": "application/json", **(headers or {})}, timeout=30)
    return status, body


def test_streaming_example_counts_requests_tokens_and_a_client_that_leaves(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: Path) -> None:
    """The FastAPI streaming example under uvicorn: a full stream is one ok request with its TTFT and tokens,
    prefill and decode forwards apart; a client that disconnects mid-stream is counted cancelled."""
    import http.client
    import re

    from .conftest import wait_until
    from .prom import free_port

    pytest.importorskip("transformers")
    pytest.importorskip("fastapi")
    uvicorn = pytest.importorskip("uvicorn")
    monkeypatch.setenv("PERFMON_PORT", "off")
    monkeypatch.setenv("PERFMON_TRACE_DIR", str(tmp_path))
    monkeypatch.setenv("PERFMON_PREPARE_PROFILER", "false")
    monkeypatch.setenv("PERFMON_LOG_LEVEL", "error")
    monkeypatch.syspath_prepend(str(ROOT))
    sys.modules.pop("examples.streaming", None)
    example = importlib.import_module("examples.streaming")
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(example.app, host="127.0.0.1", port=port, log_level="error", lifespan="on"))
    thread = threading.Thread(target=uv.run)
    thread.start()
    base = f"http://127.0.0.1:{port}"

    def sample(name: str) -> float | None:
        status, body = _http(base + "/perfmon/metrics")
        assert status == 200
        found = re.search(rf"^{re.escape(name)} (\S+)$", body.decode(), flags=re.M)
        return float(found.group(1)) if found else None

    try:
        wait_until(lambda: uv.started, what="uvicorn to start")
        status, body = _http(base + "/generate?prompt_tokens=12&max_new_tokens=8")
        assert status == 200 and len(body.decode().split()) == 8
        assert sample('perfmon_generation_requests_total{model="gpt2",outcome="ok"}') == 1
        assert sample('perfmon_generated_tokens_total{model="gpt2"}') == 8
        assert sample('perfmon_prompt_tokens_total{model="gpt2"}') == 12
        assert sample('perfmon_forward_calls_total{model="gpt2",stage="prefill"}') == 1
        assert sample('perfmon_forward_calls_total{model="gpt2",stage="decode"}') == 7
        # Histograms lag by a resolver tick, and the first token's TTFT can be drained a tick before the
        # last tokens' gaps: wait for each (a loaded box once read the ITL count one short).
        wait_until(lambda: sample('perfmon_time_to_first_token_seconds_count{model="gpt2"}') == 1,
                   what="the TTFT observation")
        wait_until(lambda: sample('perfmon_inter_token_latency_seconds_count{model="gpt2"}') == 7,
                   what="all seven inter-token gaps")
        assert sample('perfmon_inter_token_latency_seconds_count{model="gpt2"}') == 7  # and no more

        # A client that reads the first token of a long stream, then goes away.
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/generate?prompt_tokens=4&max_new_tokens=380")
        response = conn.getresponse()
        assert response.status == 200 and response.readline().strip().isdigit()
        response.close()
        conn.close()
        wait_until(lambda: sample('perfmon_generation_requests_total{model="gpt2",outcome="cancelled"}') == 1,
                   what="the abandoned stream counted cancelled")
        assert sample('perfmon_generation_requests_total{model="gpt2",outcome="ok"}') == 1
        assert sample('perfmon_generated_tokens_total{model="gpt2"}') < 8 + 380  # it stopped early
    finally:
        uv.should_exit = True
        thread.join(30)
    assert not example.monitor.running
