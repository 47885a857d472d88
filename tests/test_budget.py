"""The series budget of docs/metrics.md, measured on a live registry rather than restated."""

from __future__ import annotations

import torch
from prometheus_client import generate_latest

import perfmon

#: docs/metrics.md, "Series budget": per CPU model with one stage, cold and steady phases.
LATENCY_BUCKET_BUDGET = 100
MODEL_SERIES_BUDGET = 140


def _series(make_monitor, **kw: object) -> list[str]:
    """Sample lines of a scrape after a CPU model saw cold and steady calls and one error."""
    mon = make_monitor(sample_rate=0.5, **kw).start()
    model = mon.wrap(torch.nn.Linear(4, 4), name="lin")
    for _ in range(50):
        model(torch.randn(2, 4))
    try:
        model(torch.randn(2, 5))
    except RuntimeError:
        pass
    assert mon.flush()
    return [ln for ln in generate_latest(mon.registry).decode().splitlines() if ln and not ln.startswith("#")]


def test_default_grid_meets_the_series_budget_at_half_the_fine_grid(make_monitor) -> None:
    """A CPU model's latency histogram costs <= 100 bucket series (88), at most half of FINE_BUCKETS' (178)."""
    lines = [ln for ln in _series(make_monitor) if 'model="lin"' in ln]
    latency = [ln for ln in lines if ln.startswith("perfmon_forward_duration_seconds_bucket{")]
    assert len(latency) == 2 * (len(perfmon.DEFAULT_BUCKETS) + 1) <= LATENCY_BUCKET_BUDGET
    fine = [ln for ln in _series(make_monitor, buckets=perfmon.FINE_BUCKETS)
            if ln.startswith("perfmon_forward_duration_seconds_bucket{")]
    assert len(fine) == 2 * (len(perfmon.FINE_BUCKETS) + 1) and len(latency) <= len(fine) // 2
    # every series the model costs (latency, batch size, counts, drops, gauges), within the documented budget
    assert len(lines) <= MODEL_SERIES_BUDGET, len(lines)


#: docs/metrics.md, "Generation series": per generation name, histograms and counters.
GENERATION_SERIES_BUDGET = 182


def test_a_generation_name_costs_at_most_its_budget_and_no_latency_histogram_over_100(make_monitor) -> None:
    """One generation name (requests ok, error and cancelled, chunks): <= 182 series in all, and neither TTFT
    nor ITL over the 100-series latency budget a model's forward histogram has (they were 119 and 89)."""
    mon = make_monitor().start()
    for _ in range(3):
        for _tok in mon.stream(iter(range(5)), name="chat", prompt_tokens=7):
            pass
    with mon.generation(name="chat") as g:
        g.token(4)
    assert mon.flush()
    lines = [ln for ln in generate_latest(mon.registry).decode().splitlines()
             if ln and not ln.startswith("#") and 'model="chat"' in ln]
    assert len(lines) <= GENERATION_SERIES_BUDGET, len(lines)
    for name in ("perfmon_time_to_first_token_seconds", "perfmon_inter_token_latency_seconds"):
        buckets = [ln for ln in lines if ln.startswith(name + "_bucket{")]
        assert 0 < len(buckets) <= LATENCY_BUCKET_BUDGET, (name, len(buckets))


#: docs/metrics.md, "Request spans": per request model label, three part histograms, the duration, 3 outcomes.
REQUEST_SERIES_BUDGET = 135


def test_a_request_model_costs_at_most_its_budget(make_monitor) -> None:
    """Request spans of one model (ok, error and cancelled, queued and not): <= 135 series with model="lin" from the
    request families, each of the four histograms within the 100-series latency budget."""
    mon = make_monitor().start()
    model = mon.wrap(torch.nn.Linear(4, 4), name="lin")
    for i in range(5):
        with mon.request() as span:
            if i % 2:
                span.enqueued()
            model(torch.randn(2, 4))
    for exc in (ValueError("error"), KeyboardInterrupt()):
        try:
            with mon.request():
                model(torch.randn(2, 4))
                raise exc
        except (ValueError, KeyboardInterrupt):
            pass
    assert mon.flush()
    lines = [ln for ln in generate_latest(mon.registry).decode().splitlines()
             if ln.startswith(("perfmon_request_", "perfmon_requests_")) and 'model="lin"' in ln]
    assert len(lines) <= REQUEST_SERIES_BUDGET, len(lines)
    for part in ("queue", "model", "rest"):
        buckets = [ln for ln in lines if ln.startswith("perfmon_request_seconds_bucket{") and f'part="{part}"' in ln]
        assert 0 < len(buckets) <= LATENCY_BUCKET_BUDGET, (part, len(buckets))
