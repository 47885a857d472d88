"""Build perfmon's Grafana dashboards: ``python grafana/generate.py`` rewrites grafana/dashboards/*.json.

The JSON files are what users import or provision; this script is how they are kept consistent
(datasource variable on every panel, unique ids, units, the same selectors everywhere).
``tests/test_dashboards.py`` checks that the committed JSON is what this script produces and then
evaluates every query against a real Prometheus scraping a live agent.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SCHEMA_VERSION = 39  # Grafana 11
DS = {"type": "prometheus", "uid": "${datasource}"}
BASE = 'job=~"$job", instance=~"$instance"'
MODEL = BASE + ', model=~"$model"'
GPU = BASE + ', gpu=~"$gpu"'
RATE = "$__rate_interval"


def target(expr: str, legend: str, ref: str) -> dict[str, Any]:
    out: dict[str, Any] = {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref, "range": True}
    if "_bucket" in expr and "histogram_quantile" not in expr:
        out["format"] = "heatmap"
    if "histogram_quantile" in expr and "perfmon_forward_duration_seconds" in expr:
        # Timed calls inside a sampled OpenTelemetry span carry its trace id as an exemplar (OpenMetrics or
        # protobuf scrapes, Prometheus with --enable-feature=exemplar-storage): dots that open the trace.
        out["exemplar"] = True
    return out


def quantile(q: str, metric: str, selector: str, by: str) -> str:
    """``histogram_quantile`` over the classic buckets or, where Prometheus scraped native histograms
    (``--enable-feature=native-histograms``: Prometheus 2.x then stores only the native form of a histogram
    that has one), over the native series: exactly one side of the ``or`` has data, so one query serves both."""
    return (f"histogram_quantile({q}, sum by ({by}, le) (rate({metric}_bucket{{{selector}}}[{RATE}])))"
            f" or histogram_quantile({q}, sum by ({by}) (rate({metric}{{{selector}}}[{RATE}])))")


def mean(metric: str, selector: str, by: str) -> str:
    """The mean of a histogram's observations from ``_sum``/``_count``, or from a native histogram's sum and count."""
    return (f"sum by ({by}) (rate({metric}_sum{{{selector}}}[{RATE}])) / "
            f"sum by ({by}) (rate({metric}_count{{{selector}}}[{RATE}]))"
            f" or sum by ({by}) (histogram_sum(rate({metric}{{{selector}}}[{RATE}]))) / "
            f"sum by ({by}) (histogram_count(rate({metric}{{{selector}}}[{RATE}])))")


class Board:
    def __init__(self) -> None:
        self.panels: list[dict[str, Any]] = []
        self._id = 0
        self._y = 0
        self._x = 0

    def row(self, title: str) -> None:
        self._flush()
        self._id += 1
        self.panels.append({"type": "row", "id": self._id, "title": title, "collapsed": False,
                            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self._y}, "panels": []})
        self._y += 1

    def _flush(self) -> None:
        if self._x:
            self._x = 0
            self._y += 8

    def panel(self, title: str, exprs: list[tuple[str, str]], unit: str, *, description: str, width: int = 12,
              kind: str = "timeseries", stack: bool = False, extra: dict[str, Any] | None = None) -> None:
        if self._x + width > 24:
            self._flush()
        self._id += 1
        refs = "ABCDEFGHIJ"
        defaults: dict[str, Any] = {"unit": unit}
        if kind == "timeseries":
            defaults["custom"] = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10 if stack else 0,
                                  "stacking": {"mode": "normal" if stack else "none"}, "spanNulls": False}
        panel: dict[str, Any] = {
            "type": kind, "id": self._id, "title": title, "description": description, "datasource": DS,
            "gridPos": {"h": 8, "w": width, "x": self._x, "y": self._y},
            "targets": [target(e, legend, refs[i]) for i, (e, legend) in enumerate(exprs)],
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": {"legend": {"displayMode": "table", "placement": "bottom", "calcs": ["lastNotNull", "max"]},
                        "tooltip": {"mode": "multi", "sort": "desc"}} if kind == "timeseries" else {},
        }
        if extra:
            panel.update(extra)
        self.panels.append(panel)
        self._x += width
        if self._x >= 24:
            self._flush()


def variables(gpu: bool) -> list[dict[str, Any]]:
    def query(name: str, q: str, label: str) -> dict[str, Any]:
        return {"name": name, "label": label, "type": "query", "datasource": DS, "query": {"query": q, "refId": name},
                "definition": q, "refresh": 2, "includeAll": True, "multi": True, "allValue": ".*",
                "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "sort": 1}

    out = [
        {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
         "current": {}, "refresh": 1, "hide": 0},
        query("job", "label_values(perfmon_info, job)", "Job"),
        query("instance", 'label_values(perfmon_info{job=~"$job"}, instance)', "Instance"),
        # Forward models, generation names (monitor.stream/generation may use a name no model has) and request
        # spans' names (monitor.request(name=...), a middleware's name=: their model label), or the Requests row
        # empties when one is selected. The counters: each name has them from its first request.
        query("model", 'label_values({__name__=~"perfmon_forward_calls_total|perfmon_generation_requests_total|'
              'perfmon_requests_total", job=~"$job", instance=~"$instance"}, model)', "Model"),
    ]
    out.append(query("gpu", 'label_values(perfmon_gpu_memory_total_bytes{job=~"$job", instance=~"$instance"}, gpu)',
                     "GPU"))
    del gpu  # both dashboards carry all four variables, so links between them keep the selection
    return out


CAPTURE_ANNOTATION = {
    "name": "perfmon captures",
    "datasource": DS,
    "enable": True,
    "iconColor": "purple",
    # The gauge holds the capture's end time: Grafana places the marker at that value. An ok capture that
    # was compared with its model's baseline capture also gets the gist of the comparison: the op that
    # changed most and how (perfmon_capture_comparison_seconds, one series per model and trigger, follows
    # the latest ok capture), joined on and written into a "vs_baseline" label; every other capture is
    # kept as it is by the "or".
    "expr": ('label_replace(label_join('
             f'perfmon_capture_timestamp_seconds{{{BASE}, outcome="ok"}} * 1000'
             ' * on(job, instance, model, trigger) group_left(op, status)'
             f' (0 * perfmon_capture_comparison_seconds{{{BASE}}} + 1),'
             ' "vs_baseline", " ", "status", "op"), "vs_baseline", "· vs baseline: $1", "vs_baseline", "(.+)")'
             f' or on(job, instance, model, trigger, outcome) perfmon_capture_timestamp_seconds{{{BASE}}} * 1000'),
    "useValueForTime": True,
    "step": "60s",
    "titleFormat": "capture: {{model}}",
    "textFormat": "{{trigger}}, {{outcome}} {{vs_baseline}}",
    "tagKeys": "trigger,outcome,status",
}


def dashboard(uid: str, title: str, description: str, board: Board, links: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "uid": uid, "title": title, "description": description, "tags": ["perfmon", "pytorch", "inference"],
        "schemaVersion": SCHEMA_VERSION, "version": 1, "editable": True, "graphTooltip": 1,
        "time": {"from": "now-1h", "to": "now"}, "refresh": "30s", "timezone": "browser",
        "templating": {"list": variables(gpu=True)},
        "annotations": {"list": [
            {"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True, "hide": True,
             "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts", "type": "dashboard"},
            CAPTURE_ANNOTATION,
        ]},
        "links": links,
        "panels": board.panels,
    }


def _quantiles(metric: str, selector: str, by: str, legend: str, qs: tuple[str, ...] = ("0.5", "0.99")) -> list[tuple[str, str]]:
    return [(quantile(q, metric, selector, by), f"{legend} p{round(float(q) * 100)}") for q in qs]


def generation(b: Board) -> None:
    """The Generation row: requests, tokens, TTFT, ITL (monitor.generation/stream, HF generate()), prefill vs decode."""
    b.row("Generation")
    b.panel("Time to first token", _quantiles("perfmon_time_to_first_token_seconds", MODEL, "model", "{{model}}"),
            "s", description="From a generation request's start to its first token handed to the caller (host "
            "time): queueing plus prefill. Buckets 21% apart from 1 ms to 56 s (9% where Prometheus scrapes native "
            "histograms).")
    b.panel("Inter-token latency", _quantiles("perfmon_inter_token_latency_seconds", MODEL, "model", "{{model}}"),
            "s", description="Gap between consecutive tokens handed to the caller (a chunk of n tokens counts n "
            "gaps of gap/n): the decode step as a user sees it. Buckets 21% apart from 0.46 ms to 1 s (9% where "
            "Prometheus scrapes native histograms).")
    b.panel("Tokens per second", [
        (f"sum by (model) (rate(perfmon_generated_tokens_total{{{MODEL}}}[{RATE}]))", "{{model}} generated"),
    ], "short", description="Tokens handed to callers per second, every token counted exactly.")
    b.panel("Prompt vs generated tokens", [
        (f"sum by (model) (rate(perfmon_prompt_tokens_total{{{MODEL}}}[{RATE}]))", "{{model}} prompt/s"),
        (f"sum by (model) (rate(perfmon_generated_tokens_total{{{MODEL}}}[{RATE}]))", "{{model}} generated/s"),
        (f"sum by (model) (rate(perfmon_generation_prompt_tokens_sum{{{MODEL}}}[{RATE}])) / "
         f"sum by (model) (rate(perfmon_generation_prompt_tokens_count{{{MODEL}}}[{RATE}]))", "{{model}} prompt/request"),
        (f"sum by (model) (rate(perfmon_generation_output_tokens_sum{{{MODEL}}}[{RATE}])) / "
         f"sum by (model) (rate(perfmon_generation_output_tokens_count{{{MODEL}}}[{RATE}]))",
         "{{model}} generated/request"),
    ], "short", description="Prompt and generated tokens per second (prefill vs decode work), and the mean per "
        "request that ended ok: a TTFT change with longer prompts is the traffic, not the model.")
    b.panel("Requests by outcome", [
        (f"sum by (model, outcome) (rate(perfmon_generation_requests_total{{{MODEL}}}[{RATE}]))",
         "{{model}} {{outcome}}"),
    ], "reqps", stack=True, description="Generation requests that ended per second: ok, error (an exception passed "
        "through), cancelled (the client went away, the stream was closed early).")
    stages = f'{MODEL}, stage=~"prefill|decode"'
    b.panel("Forward latency: prefill vs decode", [
        *_quantiles("perfmon_forward_duration_seconds", stages, "model, stage", "{{model}} {{stage}}"),
        (f"sum by (model, stage) (rate(perfmon_forward_calls_total{{{stages}}}[{RATE}]))", "{{model}} {{stage}} calls/s"),
    ], "s", description="Sampled forward duration (device time on GPU) of a generative model's prefill steps (the "
        "prompt) and decode steps (one token against the KV cache), cold and steady; forward calls per second on "
        "the right axis.", extra={"fieldConfig": {"defaults": {"unit": "s"}, "overrides": [
            {"matcher": {"id": "byFrameRefID", "options": "C"},
             "properties": [{"id": "unit", "value": "ops"}, {"id": "custom.axisPlacement", "value": "right"}]}]}})


def gc_pauses(b: Board) -> None:
    """The GC pauses row: collections per second and their p99 by generation, and the timed calls they overlapped."""
    b.row("GC pauses")
    b.panel("GC pauses per second", [
        (f"sum by (generation) (rate(perfmon_gc_pause_seconds_count{{{BASE}}}[{RATE}]))", "gen-{{generation}}"),
    ], "ops", width=8, description="Garbage collections of the serving process per second, by generation. Gen-0 "
        "runs often and costs microseconds; gen-2 traverses every tracked object and can stall every thread for "
        "tens to hundreds of ms on a large heap.")
    b.panel("GC pause p99", [
        (f"histogram_quantile(0.99, sum by (generation, le) (rate(perfmon_gc_pause_seconds_bucket{{{BASE}}}[{RATE}])))",
         "gen-{{generation}} p99"),
    ], "s", width=8, description="99th percentile of GC pause time by generation (buckets 1-2.5-5 a decade from "
        "10 µs to 1 s). Every Python thread waits for the GIL meanwhile: a gen-2 p99 near the model's latency p99 "
        "is the first suspect for a tail spike.")
    b.panel("Timed calls that overlapped a GC pause", [
        (f"sum by (model) (rate(perfmon_samples_gc_overlap_total{{{MODEL}}}[{RATE}])) / "
         f"sum by (model) (rate(perfmon_forward_sampled_total{{{MODEL}}}[{RATE}]))", "{{model}}"),
        # Per process: a sum over the selected instances would read N times the share for N replicas.
        (f"sum by (instance) (rate(perfmon_gc_pause_seconds_sum{{{BASE}}}[{RATE}]))", "{{instance}} wall time in GC"),
    ], "percentunit", width=8, description="Share of timed calls whose interval overlapped a GC pause of any "
        "generation (the status page and /stats say which generation, and whether the slowest calls did), and "
        "the share of wall time each serving process (instance) spent collecting, all generations together.")


def requests(b: Board) -> None:
    """The Requests row: each served request split into queue, model and rest (request spans: the middlewares,
    monitor.request, monitor.batch), per model."""
    b.row("Requests")
    for q, label in (("0.5", "p50"), ("0.99", "p99")):
        b.panel(f"Request latency split ({label})", [
            (quantile(q, "perfmon_request_seconds", MODEL, "model, part"), f"{{{{model}}}} {{{{part}}}} {label}"),
            (quantile(q, "perfmon_request_duration_seconds", MODEL, "model"), f"{{{{model}}}} total {label}"),
        ], "s", description=f"The {label} of each part of a served request, and of the whole: queue (from the "
            "server's enqueue mark to the model's start: dynamic batching, a busy worker), model (first model "
            "work's start to the last one's end: forward, generate, the batch's forward), rest (pre- and "
            "post-processing, serialisation, sending). Each part's own percentile: they do not add up to the "
            "total's. Requests that ended ok after model work; buckets 58% apart.")
    b.panel("Where request time goes", [
        (f"sum by (model, part) (rate(perfmon_request_seconds_sum{{{MODEL}}}[{RATE}])) / ignoring(part) group_left "
         f"sum by (model) (rate(perfmon_request_duration_seconds_sum{{{MODEL}}}[{RATE}]))", "{{model}} {{part}}"),
    ], "percentunit", stack=True, description="Share of all request time spent in each part: a growing queue "
        "share with a steady model share is a server that needs more capacity (or a larger batch), not a slower "
        "model.")
    b.panel("Requests by outcome (spans)", [
        (f"sum by (model, outcome) (rate(perfmon_requests_total{{{MODEL}}}[{RATE}]))", "{{model}} {{outcome}}"),
    ], "reqps", stack=True, description="Served requests that ended per second: ok (the whole response sent), "
        "error (the app raised), cancelled (the client went away first).")


FLEET = "instance_model:perfmon_forward_duration_seconds_steady"


def fleet_links(instance: str) -> list[dict[str, Any]]:
    """Data links to a replica's status page and captures; ``instance`` is how the panel names its address (a
    table's column, ``${__data.fields.instance}``, or a series' label, ``${__field.labels.instance}``)."""
    return [{"title": f"status page of {instance}", "url": f"http://{instance}/", "targetBlank": True},
            {"title": f"captures of {instance}", "url": f"http://{instance}/profiles", "targetBlank": True}]


def fleet(b: Board) -> None:
    """The Fleet row: each replica against the median of its peers. It reads the perfmon.fleet recording rules
    (the alert's own numbers, and a per-replica percentile is too long a query to repeat per panel): without
    the rules loaded it stays empty."""
    b.row("Fleet: the odd replica out")
    ratio = {"mode": "absolute", "steps": [{"color": "green", "value": None}, {"color": "orange", "value": 1.2},
                                           {"color": "red", "value": 1.5}]}
    columns = {"Value #A": "p99 / fleet median", "Value #B": "p50 / fleet median", "Value #C": "p99", "Value #D": "p50",
               "Value #E": "timed calls/s"}
    b.panel("Replicas ranked by p99 against their fleet median", [
        (f"sort_desc({FLEET}:p99_5m_ratio_to_fleet_median{{{MODEL}}})", "p99 / fleet median"),
        (f"{FLEET}:p50_5m_ratio_to_fleet_median{{{MODEL}}}", "p50 / fleet median"),
        (f"{FLEET}:p99_5m{{{MODEL}}}", "p99"),
        (f"{FLEET}:p50_5m{{{MODEL}}}", "p50"),
        (f"{FLEET}_count:rate5m{{{MODEL}}}", "timed calls/s"),
    ], "none", kind="table", width=24, description="Each replica (scrape target) of each model and stage, slowest "
        "first: its steady p99 and p50 over 5 minutes and their ratio to the median of its peers (the same job's "
        "replicas of the model, at least 3 timing 0.2 calls/s or more; an idle replica is not ranked). Above 1.5 "
        "for 10 minutes: PerfmonReplicaSlowerThanPeers. Click a replica for its status page or its captures "
        "(the address Prometheus scrapes: reachable from where the browser runs, or through a port-forward). "
        "Needs the perfmon.fleet recording rules.",
        extra={"fieldConfig": {"defaults": {"unit": "none", "decimals": 2}, "overrides": [
            *({"matcher": {"id": "byName", "options": name},
               "properties": [{"id": "thresholds", "value": ratio},
                              {"id": "custom.cellOptions", "value": {"type": "color-background"}}]}
              for name in ("p99 / fleet median", "p50 / fleet median")),
            *({"matcher": {"id": "byName", "options": name}, "properties": [{"id": "unit", "value": "s"}]}
              for name in ("p99", "p50")),
            {"matcher": {"id": "byName", "options": "instance"}, "properties": [{"id": "links", "value": fleet_links("${__data.fields.instance}")}]},
        ]}, "options": {"showHeader": True, "sortBy": [{"displayName": "p99 / fleet median", "desc": True}]},
            "transformations": [
                {"id": "merge", "options": {}},
                {"id": "organize", "options": {"excludeByName": {"Time": True}, "renameByName": columns}},
                {"id": "sortBy", "options": {"sort": [{"field": "p99 / fleet median", "desc": True}]}},
            ]})
    for t in b.panels[-1]["targets"]:
        t.update(range=False, instant=True, format="table")
    b.panel("p99 against the fleet median, per replica", [
        (f"{FLEET}:p99_5m_ratio_to_fleet_median{{{MODEL}}}", "{{instance}} {{model}} {{stage}}"),
    ], "none", width=8, description="Each replica's steady p99 over the median of its peers' (1 = typical); the "
        "alert's line is 1.5.", extra={"fieldConfig": {"defaults": {
            "unit": "none", "thresholds": ratio, "links": fleet_links("${__field.labels.instance}"),
            "custom": {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 0, "stacking": {"mode": "none"},
                       "spanNulls": False, "thresholdsStyle": {"mode": "line"}}}, "overrides": []}})
    b.panel("Forward calls per second, per replica", [
        ("instance_model:perfmon_forward_calls:rate5m{" + MODEL + "}", "{{instance}} {{model}}"),
    ], "ops", width=8, description="Each replica's share of the traffic in forward calls (a generate() request is "
        "a prefill and a decode call per token): a slow replica that also gets more calls than its peers is "
        "busier, not broken (sticky sessions, an unbalanced load balancer).")
    b.panel("Occupancy against the fleet median", [
        ("sort(instance_model:perfmon_model_occupancy_ratio:avg5m_ratio_to_fleet_median{" + MODEL + "})",
         "{{instance}} {{model}}"),
    ], "none", kind="bargauge", width=8, description="Each replica's occupancy (the share of its calls' device span "
        "its GPU was busy, from its newest capture) over its peers' median, least busy first. A slow replica with a lower ratio waits on its host (CPU, GC, a "
        "neighbour); with the same ratio, on its device (clocks, throttling, another process on the GPU).",
        extra={"options": {"orientation": "horizontal", "displayMode": "gradient", "showUnfilled": True,
                           "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}},
               "fieldConfig": {"defaults": {"unit": "none", "decimals": 2, "min": 0, "max": 2,
                                            "links": fleet_links("${__field.labels.instance}"),
                                            "thresholds": {"mode": "absolute", "steps": [
                                                {"color": "red", "value": None}, {"color": "orange", "value": 0.67},
                                                {"color": "green", "value": 0.83}]}}, "overrides": []}})
    b.panels[-1]["targets"][0].update(range=False, instant=True)


def occupancy(b: Board) -> None:
    """The GPU occupancy row: how busy the device is inside each model's calls, which models the host (not the
    GPU) holds back, and the device time the model's forwards take per wall-clock second."""
    b.row("GPU occupancy")
    b.panel("Device occupancy and host/device time", [
        (f"max by (model) (perfmon_model_occupancy_ratio{{{MODEL}}})", "{{model}} busy / span (capture)"),
        (f"max by (model) (perfmon_model_host_device_ratio{{{MODEL}}})", "{{model}} host / span (live)"),
    ], "percentunit", width=8, description="Busy over span: the share of each call's device span the GPU ran "
        "kernels, from the model's newest CUDA capture (exact; baseline captures keep it fresh). Host over span: "
        "the median of each timed call's host time over its device span, live; near 100% the device finished right "
        "after the host's last launch (launch-bound, or a forward that synchronises: the capture tells which).")
    b.panel("Launch-bound (host-bound) models", [
        (f"max by (model) (perfmon_model_host_bound{{{MODEL}}})", "{{model}}"),
        (f"time() - max by (model) (perfmon_model_occupancy_timestamp_seconds{{{MODEL}}})",
         "{{model}} capture age (s)"),
    ], "short", width=8, description="1 while the host, not the GPU, sets a model's pace: its capture's occupancy "
        "under 50% (or, without a capture, host time at 90% of the device span or more). A faster GPU buys "
        "nothing there: cut launches (CUDA graphs, torch.compile mode='reduce-overhead', bigger batches); "
        "runbook: launch-bound. The capture age says how old the measurement behind it is (absent: live ratio).",
        extra={"fieldConfig": {"defaults": {"unit": "short"}, "overrides": [
            {"matcher": {"id": "byFrameRefID", "options": "B"},
             "properties": [{"id": "unit", "value": "s"}, {"id": "custom.axisPlacement", "value": "right"}]}]}})
    cuda = f'{MODEL}, phase="steady", device=~"cuda.*"'
    b.panel("Device time per second (forwards)", [
        (f"({mean('perfmon_forward_duration_seconds', cuda, 'instance, model')}) * "
         f"sum by (instance, model) (rate(perfmon_forward_calls_total{{{MODEL}}}[{RATE}]))", "{{model}} {{instance}}"),
    ], "percentunit", width=8, description="Seconds of device span per wall-clock second spent on each model's "
        "forwards on each replica (SGLang's fwd_occupancy; one GPU's share, so per instance: summed over replicas it "
        "read N times a GPU): the sampled mean span times the exact call rate. Low with high latency: "
        "the GPU waits between requests (batching, the server); it counts the gaps inside calls, so it is an upper "
        "bound of busy time.")


def efficiency(b: Board) -> None:
    """The Efficiency row: live achieved FLOP/s and bytes/s per model and stage, MFU and MBU against the device's
    peak, and the share of sampled calls whose FLOPs are unknown (stats/efficiency.py)."""
    b.row("Efficiency")
    b.panel("Achieved FLOP/s (while running)", [
        (f"max by (model, stage) (perfmon_model_flops_per_second{{{MODEL}}})", "{{model}} {{stage}}"),
    ], "flops", width=8, description="Each input signature's FLOPs, counted once on a fake copy of the model, over "
        "the sampled calls' measured time (device time on GPU): the model's compute rate while it runs, over the "
        "agent's stats window. No series while none of the window's samples has a count (see 'unknown').")
    b.panel("MFU and MBU", [
        (f"max by (model, stage) (perfmon_model_mfu_ratio{{{MODEL}}})", "{{model}} {{stage}} MFU"),
        (f"max by (model, stage) (perfmon_model_mbu_ratio{{{MODEL}}})", "{{model}} {{stage}} MBU"),
    ], "percentunit", width=8, description="Achieved FLOP/s over the GPU's peak (16-bit or 32-bit by the matmuls' "
        "dtypes) and achieved bytes/s over its memory bandwidth, against perfmon's GPU table or the peak_flops/"
        "peak_bandwidth settings (perfmon_model_peak_info names the source). Absent on CPUs and unknown GPUs. High "
        "MBU with low MFU: memory-bound (decode, small batches); both low: launch- or host-bound.")
    b.panel("Bytes/s and unknown share", [
        (f"max by (model, stage) (perfmon_model_bytes_per_second{{{MODEL}}})", "{{model}} {{stage}} bytes/s"),
        (f"max by (model, stage) (perfmon_model_flops_unknown_ratio{{{MODEL}}})", "{{model}} {{stage}} unknown"),
    ], "Bps", width=8, description="Estimated memory traffic while running (each op's tensor inputs and outputs), "
        "and the share of sampled calls whose signature has no count (a KV-cache object, hooks, a data-dependent "
        "forward, the counting budget): those calls are left out of the rates, never guessed; /stats says why.",
        extra={"fieldConfig": {"defaults": {"unit": "Bps"}, "overrides": [
            {"matcher": {"id": "byFrameRefID", "options": "B"},
             "properties": [{"id": "unit", "value": "percentunit"}, {"id": "custom.axisPlacement", "value": "right"}]}]}})


def overview() -> dict[str, Any]:
    b = Board()
    steady = f'{MODEL}, phase="steady"'
    b.row("Traffic")
    # Forward calls are not requests: a generate() request of n tokens is a prefill and n-1 decode forwards (32
    # calls/s for 2 requests/s of 16 tokens). Requests are what generation and request spans count.
    b.panel("Forward calls per second", [
        (f"sum by (model) (rate(perfmon_forward_calls_total{{{MODEL}}}[{RATE}]))", "{{model}}"),
    ], "ops", width=8, description="Calls of each wrapped model's forward per second, every call counted exactly. "
        "Not requests: a generative model makes one call per prompt (prefill) and one per generated token "
        "(decode); see Requests per second.")
    b.panel("Requests per second", [
        (f"sum by (model) (rate(perfmon_generation_requests_total{{{MODEL}}}[{RATE}]))", "{{model}} generation"),
        (f"sum by (model) (rate(perfmon_requests_total{{{MODEL}}}[{RATE}]))", "{{model}} served (spans)"),
    ], "reqps", width=8, description="Requests that ended per second, every outcome: generation requests "
        "(monitor.generation, monitor.stream, a wrapped model's generate()) and served requests (request spans: "
        "the middlewares, monitor.request, monitor.batch; model is the span's name). A served request that "
        "generates counts in both; a server with neither instrumented shows none (its forward calls are the "
        "closest figure).")
    b.panel("Errors", [
        (f"sum by (model, exception) (rate(perfmon_forward_errors_total{{{MODEL}}}[{RATE}]))", "{{model}} {{exception}}"),
        # The all-classes counter: it exists at 0 from the wrap, where a class's series is born with its first
        # error and rate() misses what it counted before its first scrape. An agent older than it: by class.
        (f"(sum by (model) (rate(perfmon_forward_failed_calls_total{{{MODEL}}}[{RATE}])) or "
         f"sum by (model) (rate(perfmon_forward_errors_total{{{MODEL}}}[{RATE}]))) / "
         f"sum by (model) (rate(perfmon_forward_calls_total{{{MODEL}}}[{RATE}]))", "{{model}} error ratio"),
    ], "ops", width=8, description="Forward calls that raised per second, by exception class (a class appears "
        "with its first error), and the share of forward calls that raised, every class together.",
        extra={"fieldConfig": {"defaults": {"unit": "ops"}, "overrides": [
            {"matcher": {"id": "byFrameRefID", "options": "B"},
             "properties": [{"id": "unit", "value": "percentunit"}, {"id": "custom.axisPlacement", "value": "right"}]}]}})
    b.panel("Items per second", [
        (f"sum by (model) (rate(perfmon_forward_items_total{{{MODEL}}}[{RATE}]))", "{{model}} items"),
        (f"sum by (model) (rate(perfmon_forward_padded_items_total{{{MODEL}}}[{RATE}]))", "{{model}} incl. padding"),
    ], "short", description="Items processed per second in the model's own units (batch dimension by default, "
        "or effective tokens from an items callable), and including padding where reported.")
    b.panel("Padding ratio", [
        (f"1 - sum by (model) (rate(perfmon_forward_items_total{{{MODEL}}}[{RATE}])) / "
         f"sum by (model) (rate(perfmon_forward_padded_items_total{{{MODEL}}}[{RATE}]))", "{{model}}"),
    ], "percentunit", description="Share of processed items that were padding: a high ratio makes batching look "
        "faster than it is.")
    b.panel("Batch size (sampled calls)", [
        (f"sum by (le) (rate(perfmon_forward_batch_size_bucket{{{MODEL}}}[{RATE}]))", "{{le}}"),
    ], "short", kind="heatmap", width=24, description="Distribution of items per call over time.",
        extra={"options": {"calculate": False, "yAxis": {"unit": "short"}, "cellGap": 1,
                           "color": {"mode": "scheme", "scheme": "Oranges"}}})
    b.row("Latency")
    # By stage too: a generative model's prefill and decode differ 10-100x, mixed their percentiles follow the
    # traffic's prompt lengths. A model with one stage has no stage label, so its legend is just the model.
    b.panel("Steady-state latency (sampled) with baseline and threshold", [
        *_quantiles("perfmon_forward_duration_seconds", steady, "model, stage", "{{model}} {{stage}}",
                    ("0.5", "0.95", "0.99")),
        (f'max by (model, stage) (perfmon_latency_baseline_seconds{{{MODEL}, quantile="0.99"}})',
         "{{model}} {{stage}} p99 baseline"),
        (f'max by (model, stage) (perfmon_latency_threshold_seconds{{{MODEL}, quantile="0.99"}})',
         "{{model}} {{stage}} p99 trigger"),
    ], "s", width=24, description="Device time on GPU (CUDA events), wall time on CPU, steady state only, per "
        "model and, for a generative model, per stage (prefill, decode). The baseline is learned from healthy "
        "windows; above the trigger line for consecutive windows perfmon captures a profile (purple markers). "
        "Resolution: classic buckets 21% apart (a percentile within ~10%), native histograms 9% apart where "
        "Prometheus scrapes them; dots are exemplars of calls traced with OpenTelemetry.")
    b.panel("Cold vs steady (mean)", [
        (mean("perfmon_forward_duration_seconds", MODEL, "model, phase"), "{{model}} {{phase}}"),
    ], "s", description="Cold calls (first calls, first calls of a new input shape) against steady state.")
    b.panel("Host vs device time (mean)", [
        (mean("perfmon_forward_host_duration_seconds", steady, "model, device"), "{{model}} {{device}} host"),
        (mean("perfmon_forward_duration_seconds", steady, "model, device"), "{{model}} {{device}} device"),
    ], "s", description="On GPU, host time near device time means the call is launch-bound (CPU); far below, "
        "the host only enqueues. On CPU both are the same clock.")
    b.panel("Time to first forward and cold start", [
        (f"max by (model) (perfmon_time_to_first_forward_seconds{{{MODEL}}})", "{{model}} time to first forward"),
        (f"max by (model) (perfmon_cold_start_seconds{{{MODEL}}})", "{{model}} first call"),
    ], "s", kind="stat", description="From monitor start to the end of the first call, and the first call's duration.")
    b.panel("Regression", [
        (f"max by (model) (perfmon_regression_active{{{MODEL}}})", "{{model}} active"),
        # Over the dashboard's range, not the raw counter: that counts since each process started, summed
        # over replicas, and drops when one restarts.
        (f"round(sum by (model) (increase(perfmon_regressions_total{{{MODEL}}}[$__range])))", "{{model}} detected"),
    ], "short", kind="stat", description="1 while the detector sees a regression; regressions detected within the "
        "dashboard's time range, every selected replica together (increase() counts across restarts; rounded: it "
        "extrapolates to the range's ends).")
    b.panels[-1]["targets"][1].update(range=False, instant=True)  # one figure for the whole range, at its end
    fleet(b)


    efficiency(b)
    generation(b)
    gc_pauses(b)
    requests(b)
    occupancy(b)
    b.row("Agent")
    b.panel("Samples dropped and internal errors", [
        (f"sum by (model, reason) (rate(perfmon_samples_dropped_total{{{MODEL}}}[{RATE}]))", "{{model}} {{reason}}"),
        (f"sum by (stage) (rate(perfmon_internal_errors_total{{{BASE}}}[{RATE}]))", "internal: {{stage}}"),
        (f"sum by (model, reason) (rate(perfmon_generation_dropped_total{{{MODEL}}}[{RATE}]))",
         "{{model}} generation: {{reason}}"),
    ], "ops", description="Timed samples that never reached the histograms, faults inside the agent (never seen "
        "by requests), and generation timings not recorded (queue_full, live_limit: counted but not timed, "
        "after_finish).")
    b.panel("Timed share of calls", [
        (f"sum by (model) (rate(perfmon_forward_sampled_total{{{MODEL}}}[{RATE}])) / "
         f"sum by (model) (rate(perfmon_forward_calls_total{{{MODEL}}}[{RATE}]))", "{{model}} timed"),
        (f"max by (model) (perfmon_sample_rate{{{MODEL}}})", "{{model}} configured"),
    ], "percentunit", description="Effective sampling (configured rate + floor + cold calls).")
    b.panel("Captures", [
        (f"sum by (model, trigger, outcome) (increase(perfmon_captures_total{{{BASE}}}[1h]))",
         "{{model}} {{trigger}} {{outcome}}"),
        (f"sum by (reason) (increase(perfmon_captures_suppressed_total{{{BASE}}}[1h]))", "suppressed: {{reason}}"),
        (f"max(perfmon_capture_in_progress{{{BASE}}})", "in progress"),
    ], "short", description="Profiler captures in the last hour by trigger and outcome, automatic ones suppressed "
        "(cooldown, rate limit, busy), and whether one is running.")
    b.panel("Agent's own cost", [
        (f"sum by (instance, thread) (rate(perfmon_agent_cpu_seconds_total{{{BASE}}}[{RATE}]))",
         "{{instance}} CPU: {{thread}}"),
        (f"sum by (instance) (rate(perfmon_agent_http_paused_seconds_total{{{BASE}}}[{RATE}]))",
         "{{instance}} HTTP paused (budget spent)"),
        (f"sum by (instance, reason) (rate(perfmon_agent_http_refused_total{{{BASE}}}[{RATE}]))",
         "{{instance}} HTTP refused/s: {{reason}}"),
        (f"sum by (instance, thread) (rate(perfmon_agent_wakeups_total{{{BASE}}}[{RATE}]))",
         "{{instance}} wakes/s: {{thread}}"),
    ], "short", description="CPU seconds per second of perfmon's own threads; the share of time its HTTP server "
        "paused because it spent its CPU budget (http_cpu_budget), and connections it refused or cut, by reason; "
        "wakes per second of each thread (each takes the GIL from a GIL-bound serving thread: an idle agent wakes "
        "~1 a second; alert: PerfmonAgentWakingOften).")
    # Only agents with trace_store set export these; elsewhere the two panels stay empty.
    b.panel("Trace uploads (trace_store)", [
        (f"sum by (instance, outcome) (rate(perfmon_trace_uploads_total{{{BASE}}}[{RATE}]))",
         "{{instance}} {{outcome}}"),
        (f"sum by (instance, reason) (rate(perfmon_trace_spool_dropped_total{{{BASE}}}[{RATE}]))",
         "{{instance}} dropped unsent: {{reason}}"),
    ], "ops", description="Capture uploads to object storage per second: ok, and failed attempts (each retried with "
        "backoff); captures removed from trace_dir by retention before they went up. Alert: "
        "PerfmonTraceUploadsFailing.")
    b.panel("Trace spool (trace_store)", [
        (f"max by (instance) (perfmon_trace_spool_files{{{BASE}}})", "{{instance}} files waiting"),
        (f"max by (instance) (perfmon_trace_spool_bytes{{{BASE}}}) / 2^20", "{{instance}} MiB waiting"),
        (f"max by (instance) (perfmon_trace_upload_age_seconds{{{BASE}}}) / 60", "{{instance}} minutes since an upload"),
    ], "short", description="What waits in trace_dir for upload (files, MiB) and minutes since the last upload "
        "went through: a spool that grows while the age climbs is a store that is down or refusing writes.")
    b.panel("Agent process", [
        (f"rate(process_cpu_seconds_total{{{BASE}}}[{RATE}])", "{{instance}} CPU"),
        (f"process_resident_memory_bytes{{{BASE}}} / 2^30", "{{instance}} RSS GiB"),
    ], "short", description="CPU seconds per second and resident memory (GiB) of the serving process.")
    return dashboard("perfmon-overview", "perfmon: serving", "Calls, errors, sampled latency (cold vs steady, "
                     "host vs device, prefill vs decode), regressions, profiler captures, generation (time to "
                     "first token, inter-token latency, tokens) and requests (queue / model / rest) per model, and "
                     "the process's GC pauses.", b,
                     [{"title": "perfmon: GPU and memory", "type": "link", "url": "/d/perfmon-gpu",
                       "keepTime": True, "includeVars": True}])


def gpu() -> dict[str, Any]:
    b = Board()
    b.row("torch allocator")
    b.panel("Allocated vs reserved", [
        (f"perfmon_torch_memory_allocated_bytes{{{BASE}}}", "{{instance}} {{device}} allocated"),
        (f"perfmon_torch_memory_reserved_bytes{{{BASE}}}", "{{instance}} {{device}} reserved"),
        (f"perfmon_torch_memory_peak_allocated_bytes{{{BASE}}}", "{{instance}} {{device}} peak allocated"),
        (f"perfmon_torch_memory_peak_reserved_bytes{{{BASE}}}", "{{instance}} {{device}} peak reserved"),
    ], "bytes", description="Allocated rising steadily is a leak; reserved above allocated is the caching "
        "allocator's cache, not a leak.")
    b.panel("Fragmentation", [(f"perfmon_torch_memory_fragmentation_ratio{{{BASE}}}", "{{instance}} {{device}}")],
            "percentunit", description="Inactive split bytes over reserved bytes.")
    b.panel("Allocation retries and OOMs", [
        (f"increase(perfmon_torch_alloc_retries_total{{{BASE}}}[{RATE}])", "{{instance}} {{device}} retries"),
        (f"increase(perfmon_torch_ooms_total{{{BASE}}}[{RATE}])", "{{instance}} {{device}} OOMs"),
    ], "short", description="cudaMalloc retries after flushing the cache (memory pressure) and out-of-memory errors.")
    b.row("GPU (NVML)")
    b.panel("Utilization", [
        (f"perfmon_gpu_utilization_ratio{{{GPU}}}", "GPU {{gpu}} SM"),
        (f"perfmon_gpu_memory_utilization_ratio{{{GPU}}}", "GPU {{gpu}} memory"),
        (f"perfmon_gpu_process_utilization_ratio{{{GPU}}}", "GPU {{gpu}} this process"),
    ], "percentunit", description="Device-wide utilization and this serving process's own share of SM time.")
    b.panel("Memory used / total", [
        (f"perfmon_gpu_memory_used_bytes{{{GPU}}}", "GPU {{gpu}} used"),
        (f"perfmon_gpu_memory_total_bytes{{{GPU}}}", "GPU {{gpu}} total"),
        (f"perfmon_gpu_process_memory_used_bytes{{{GPU}}}", "GPU {{gpu}} this process"),
    ], "bytes", description="All processes, and this serving process (NVML compute process list).")
    b.panel("This process's share of GPU memory", [
        (f"perfmon_gpu_process_memory_used_bytes{{{GPU}}} / on (job, instance, gpu, UUID) "
         f"perfmon_gpu_memory_total_bytes{{{GPU}}}", "GPU {{gpu}}"),
    ], "percentunit", description="Memory this process holds over the device's total.")
    b.panel("Power vs limit", [
        (f"perfmon_gpu_power_watts{{{GPU}}}", "GPU {{gpu}} draw"),
        (f"perfmon_gpu_power_limit_watts{{{GPU}}}", "GPU {{gpu}} limit"),
        (f"rate(perfmon_gpu_energy_joules_total{{{GPU}}}[{RATE}])", "GPU {{gpu}} mean (energy)"),
    ], "watt", description="Power draw, the enforced limit, and mean power from the energy counter.")
    b.panel("Temperature", [(f"perfmon_gpu_temperature_celsius{{{GPU}}}", "GPU {{gpu}}")], "celsius",
            description="GPU die temperature.")
    b.panel("SM clock", [
        (f"perfmon_gpu_sm_clock_hertz{{{GPU}}}", "GPU {{gpu}}"),
        (f"perfmon_gpu_sm_clock_max_hertz{{{GPU}}}", "GPU {{gpu}} max"),
    ], "hertz", description="Current and maximum SM clock: a gap under load means throttling.")
    b.panel("Throttle reasons", [
        (f"max by (gpu, reason) (perfmon_gpu_clocks_event_reasons{{{GPU}}})", "GPU {{gpu}} {{reason}}"),
    ], "short", kind="state-timeline", description="Which clock event reasons hold the clocks down (1 = active).")
    b.panel("NVML", [
        (f"min by (instance) (perfmon_nvml_up{{{BASE}}})", "{{instance}} up"),
        (f"sum by (instance, call) (rate(perfmon_nvml_errors_total{{{BASE}}}[{RATE}]))", "{{instance}} {{call}} errors"),
    ], "short", description="Whether the agent reads NVML, and failing NVML calls per second.")
    return dashboard("perfmon-gpu", "perfmon: GPU and memory", "torch allocator memory and NVML telemetry, "
                     "including this serving process's share of the GPU.", b,
                     [{"title": "perfmon: serving", "type": "link", "url": "/d/perfmon-overview",
                       "keepTime": True, "includeVars": True}])


DASHBOARDS = {"perfmon-overview.json": overview, "perfmon-gpu.json": gpu}


def render() -> dict[str, str]:
    return {name: json.dumps(make(), indent=2, sort_keys=True) + "\n" for name, make in DASHBOARDS.items()}


def main() -> int:
    for name, text in render().items():
        (HERE / "dashboards" / name).write_text(text)
        print(f"wrote grafana/dashboards/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
