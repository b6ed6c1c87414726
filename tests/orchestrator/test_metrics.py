"""Prometheus text rendering of the orchestrator's and a provider's counters."""

from __future__ import annotations

from sandcell_orchestrator.metrics import (
    HISTOGRAMS,
    METRIC_HELP,
    Metrics,
    declared_metrics,
    render_provider_counters,
)
from sandcell_orchestrator.providers.lambda_microvm import MicrovmMetrics


def test_counters_render_with_labels_and_help() -> None:
    metrics = Metrics()
    metrics.describe("sandcell_executions_total", "Executions by final status.")
    metrics.inc("sandcell_executions_total", status="ok")
    metrics.inc("sandcell_executions_total", status="ok")
    metrics.inc("sandcell_executions_total", status='we"ird')
    text = metrics.render()
    assert "# HELP sandcell_executions_total Executions by final status." in text
    assert "# TYPE sandcell_executions_total counter" in text
    assert 'sandcell_executions_total{status="ok"} 2' in text
    assert 'sandcell_executions_total{status="we\\"ird"} 1' in text
    assert metrics.value("sandcell_executions_total", status="ok") == 2


def test_provider_counters_render() -> None:
    counters = MicrovmMetrics(launches_ok=3, throttles=1)
    text = render_provider_counters("lambda-microvm", counters)
    assert 'sandcell_provider_launches_ok_total{provider="lambda-microvm"} 3' in text
    assert 'sandcell_provider_throttles_total{provider="lambda-microvm"} 1' in text
    assert render_provider_counters("local", None) == ""


def test_every_series_is_there_from_the_start() -> None:
    """Before anything happened, /metrics already lists every counter (at 0, with its
    known labels) and every duration histogram (empty)."""
    text = declared_metrics().render()
    for name in METRIC_HELP:
        assert f"# TYPE {name} counter" in text
    assert 'sandcell_launches_total{outcome="failed"} 0' in text
    assert "sandcell_lock_contention_total 0" in text
    for name in HISTOGRAMS:
        assert f"# TYPE {name} histogram" in text
        assert f'{name}_bucket{{le="+Inf"}} 0' in text
        assert f"{name}_count 0" in text


def test_histograms_are_cumulative() -> None:
    """A timer observes by its clock; buckets count every observation at or below them."""
    now = [0.0]
    metrics = Metrics(clock=lambda: now[0])
    metrics.declare_histogram("sandcell_turn_duration_seconds", "Turns.")
    for seconds in (0.02, 0.3, 7.0):
        with metrics.timer("sandcell_turn_duration_seconds"):
            now[0] += seconds
    text = metrics.render()
    assert 'sandcell_turn_duration_seconds_bucket{le="0.025"} 1' in text
    assert 'sandcell_turn_duration_seconds_bucket{le="0.5"} 2' in text
    assert 'sandcell_turn_duration_seconds_bucket{le="10"} 3' in text
    assert 'sandcell_turn_duration_seconds_bucket{le="+Inf"} 3' in text
    assert "sandcell_turn_duration_seconds_count 3" in text
    assert "sandcell_turn_duration_seconds_sum 7.32" in text
