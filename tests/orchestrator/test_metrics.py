"""Prometheus text rendering of the orchestrator's and a provider's counters."""

from __future__ import annotations

from sandcell_orchestrator.metrics import Metrics, render_provider_counters
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
