"""The odd replica out, live: three agents scraped by a real Prometheus that runs the shipped rules; one replica
is slowed, and the fleet rules, the alert and the dashboard's Fleet row name it and only it; stopped, its series
go stale and it leaves the ranking."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from .conftest import http, wait_until
from .prom import Prometheus, running_prometheus
from .test_dashboards import DASHBOARDS, RULES, _load, _substitute, _targets

pytestmark = pytest.mark.prometheus

ALERT = "PerfmonReplicaSlowerThanPeers"
P50_RATIO = "instance_model:perfmon_forward_duration_seconds_steady:p50_5m_ratio_to_fleet_median"
TOKEN = "fleet-test-token-0123456789abcdef"


def fast_rules(text: str) -> str:
    """The shipped rules at test speed, by substitution rather than a copy: every group evaluates each second,
    5-minute windows are 20 seconds and a 10-minute ``for:`` is 10 seconds. Expressions, thresholds (1.5x),
    guards (0.2 timed calls/s, 3 peers, ``up == 1``) and annotations are the shipped ones."""
    return text.replace("interval: 30s", "interval: 1s").replace("[5m]", "[20s]").replace("for: 10m", "for: 10s")


class Sleep(torch.nn.Module):
    """A forward of ``seconds`` of wall time spent off the CPU: ``time.sleep`` releases the GIL, so three replicas
    in one test process do not slow each other (three pods would not), and the slowed one stays the slowest on a
    loaded machine. The sleep is the workload, not synchronisation."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: Any) -> Any:
        time.sleep(self.seconds)
        return x


def _values(result: list[dict[str, Any]]) -> dict[str, float]:
    return {r["metric"]["instance"]: float(r["value"][1]) for r in result}


def test_fast_rules_shorten_the_fleet_rules_and_nothing_else() -> None:
    """The substitution reaches the fleet group and alert (a renamed one would leave a 10-minute wait in the live
    test) and changes only intervals, windows and ``for:``."""
    shipped, fast = yaml.safe_load(RULES.read_text()), yaml.safe_load(fast_rules(RULES.read_text()))
    group = next(g for g in fast["groups"] if g["name"] == "perfmon.fleet")
    alert = next(r for g in fast["groups"] for r in g["rules"] if r.get("alert") == ALERT)
    assert group["interval"] == "1s" and alert["for"] == "10s"
    assert all("[5m]" not in r["expr"] for r in group["rules"]) and any("[20s]" in r["expr"] for r in group["rules"])
    for before, after in zip(shipped["groups"], fast["groups"], strict=True):
        for a, b in zip(before["rules"], after["rules"], strict=True):
            assert a["expr"].replace("[5m]", "[20s]") == b["expr"] and a.get("annotations") == b.get("annotations")


def test_three_live_replicas_one_slowed(make_monitor, tmp_path: Path) -> None:
    """Three agents serve the same model, the third 6x slower: its ratio to the fleet median alone is above 1.5, the
    alert goes pending then firing for it only, its links answer; stopped, its series go stale and the rest,
    now 2, are no peer group."""
    mons = [make_monitor(port=0, sample_rate=0.25, token=TOKEN).start() for _ in range(3)]
    models = [mon.wrap(Sleep(seconds), name="m") for mon, seconds in zip(mons, (0.002, 0.002, 0.012), strict=True)]
    stops = [threading.Event() for _ in mons]

    def drive(model: Any, stop: threading.Event) -> None:
        x = torch.zeros(1)
        deadline = time.monotonic() + 150
        while not stop.is_set() and time.monotonic() < deadline:
            model(x)

    threads = [threading.Thread(target=drive, args=(m, s)) for m, s in zip(models, stops, strict=True)]
    for t in threads:
        t.start()
    instances = [str(mon.url).removeprefix("http://") for mon in mons]
    slow = instances[2]
    rules = tmp_path / "perfmon.rules.yml"
    rules.write_text(fast_rules(RULES.read_text()))
    try:
        with running_prometheus(tmp_path, instances, rule_files=[str(rules)]) as prom:
            _slow_replica_is_named(prom, instances, slow)
            _alert_fires_for_it_alone(prom, slow)
            _fleet_panels_and_rules_have_data(prom, instances)
            _fleet_panel_links_open_the_replica(slow)
            stops[2].set()
            threads[2].join(10)
            mons[2].stop()
            _its_series_go_stale(prom, instances, slow)
    finally:
        for s in stops:
            s.set()
        for t in threads:
            t.join(10)


def _slow_replica_is_named(prom: Prometheus, instances: list[str], slow: str) -> None:
    def ranked() -> list[dict[str, Any]] | None:
        result = prom.query(f'sort_desc({P50_RATIO}{{model="m"}})')
        if len(result) == 3 and result[0]["metric"]["instance"] == slow and float(result[0]["value"][1]) > 1.5:
            return result
        return None

    result = wait_until(ranked, timeout=60, what="the slowed replica at the top of the ranking")
    # the median of 3 is a healthy replica's: the others are at most 1
    assert sorted(r["metric"]["instance"] for r in result) == sorted(instances)
    assert all(float(r["value"][1]) <= 1.0 for r in result[1:]), result
    assert list(_values(prom.query(f"{P50_RATIO} > 1.5"))) == [slow]


def _alert_fires_for_it_alone(prom: Prometheus, slow: str) -> None:
    seen: list[tuple[str, str, str]] = []

    def firing() -> dict[str, Any] | None:
        alerts = [a for a in prom.alerts() if a["labels"]["alertname"] == ALERT]
        seen.extend((a["labels"]["instance"], a["labels"]["quantile"], a["state"]) for a in alerts)
        return next((a for a in alerts if a["state"] == "firing" and a["labels"]["quantile"] == "0.5"), None)

    alert = wait_until(firing, timeout=60, what=f"{ALERT} firing for the slowed replica")
    # The median's alert (the systematic one) names the slowed replica alone. The 0.99 one is left out: the three
    # replicas share this test's process, and a healthy one's tail waits for the GIL behind the others' threads on a
    # loaded box (a fresh clone's run saw one pending at 0.99); three pods do not share a GIL.
    assert {instance for instance, q, _ in seen if q == "0.5"} == {slow}, seen
    states = [state for _, q, state in seen if q == "0.5"]
    assert states[0] == "pending" and states[-1] == "firing", states
    assert alert["labels"]["model"] == "m" and alert["annotations"]["runbook"].endswith("#replica-slower-than-peers")
    # the links the alert carries are the slow replica's own status page and captures, and they answer
    status, headers, body = http(alert["annotations"]["status_page"])
    assert alert["annotations"]["status_page"] == f"http://{slow}/" and status == 200, status
    assert headers["content-type"].startswith("text/html") and b"Profiler captures" in body
    assert alert["annotations"]["captures"] == f"http://{slow}/profiles"
    assert http(alert["annotations"]["captures"])[0] == 401  # "token required", as the description says
    status, _, body = http(alert["annotations"]["captures"], token=TOKEN)
    assert status == 200 and json.loads(body) == {"profiles": []}, (status, body)


def _fleet_panels_and_rules_have_data(prom: Prometheus, instances: list[str]) -> None:
    """Every Fleet-row panel query and every fleet rule (those a single agent cannot feed) has data."""
    values = {"$job": "perfmon", "$instance": "|".join(instances), "$model": "m"}
    queries = [(f"{p.name}: {title}", _substitute(e, values)) for p in DASHBOARDS for title, e in _targets(_load(p))
               if "instance_model:" in e]
    assert len(queries) >= 4, queries
    groups = yaml.safe_load(RULES.read_text())["groups"]
    queries += [(f"recorded {r['record']}", r["record"]) for g in groups if g["name"] == "perfmon.fleet"
                for r in g["rules"]]
    # Occupancy exists only for CUDA models (a capture's kernels): these CPU agents have none, so the occupancy rules
    # and panel are proven by promtool's synthetic series (perfmon.rules.test.yml) and tests/test_dashboards.py's
    # fake-GPU agent instead.
    missing = [(n, q) for n, q in queries if "occupancy" not in q]

    def all_have_data() -> bool:
        nonlocal missing
        missing = [(n, q) for n, q in missing if not prom.query(q)]
        return not missing

    try:
        wait_until(all_have_data, timeout=30, what="data for every fleet query")
    except AssertionError:
        raise AssertionError("queries without data:\n" + "\n".join(f"{n}\n  {q}" for n, q in missing)) from None


def _fleet_panel_links_open_the_replica(slow: str) -> None:
    """Every data link of the Fleet row, filled in for the slow replica as Grafana would, opens its status page or
    its captures (behind the token)."""
    panels = [p for d in DASHBOARDS for p in _load(d)["panels"] if p["type"] != "row"
              and any("instance_model:" in t["expr"] for t in p["targets"])]
    fc = [p["fieldConfig"] for p in panels]
    links = [link for c in fc for link in c["defaults"].get("links", [])]
    links += [link for c in fc for o in c["overrides"] for prop in o["properties"] if prop["id"] == "links"
              for link in prop["value"]]
    urls = {link["url"].replace("${__data.fields.instance}", slow).replace("${__field.labels.instance}", slow)
            for link in links}
    assert urls == {f"http://{slow}/", f"http://{slow}/profiles"}, urls
    assert http(f"http://{slow}/")[0] == 200
    assert http(f"http://{slow}/profiles", token=TOKEN)[0] == 200


def _its_series_go_stale(prom: Prometheus, instances: list[str], slow: str) -> None:
    def gone() -> bool:
        up = _values(prom.query('up{job="perfmon"}'))
        return (up.get(slow) == 0.0 and not prom.query(f'perfmon_forward_calls_total{{instance="{slow}"}}')
                and not prom.query(f'{{__name__=~"instance_model:.+", instance="{slow}"}}')
                and not [a for a in prom.alerts() if a["labels"]["alertname"] == ALERT])

    # Prometheus writes staleness markers for a target's series at its first failed scrape (1 s here).
    wait_until(gone, timeout=10, what="the stopped replica's series to go stale and its alert to resolve")
    # The two left are no peer group: no median, no ratio, no alert; their own series stay.
    wait_until(lambda: not prom.query('{__name__=~".+_fleet_median|.+_ratio_to_fleet_median"}'), timeout=20,
               what="the fleet median to go with fewer than 3 replicas")
    alive = _values(prom.query('instance_model:perfmon_forward_duration_seconds_steady:p50_5m{model="m"}'))
    assert sorted(alive) == sorted(instances[:2]), alive
