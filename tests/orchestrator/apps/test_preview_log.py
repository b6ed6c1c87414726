"""Preview upstream failures: each counted, a run of them one INFO line (not one each)."""

from __future__ import annotations

import logging

import httpx
import pytest
import websockets
from websockets.asyncio.client import connect

from sandcell_orchestrator.apps.client import AppRunnerClient
from sandcell_orchestrator.apps.preview_log import FAILURES_METRIC, UpstreamFailures
from sandcell_orchestrator.metrics import Metrics

from .fake_runner import INSTANCE, PREVIEW_TOKEN, RUNNER_TOKEN, SESSION, Preview

_LOGGER = "sandcell_orchestrator.apps.preview"


def _lines(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == _LOGGER and r.levelno == level]


async def _runner_gone(preview: Preview) -> AppRunnerClient:
    """The instance's runner swapped for one at a closed port; the working one returned."""
    working = preview.instance.runner
    preview.instance.runner = AppRunnerClient(
        "http://127.0.0.1:9", token=RUNNER_TOKEN, session_id=SESSION
    )
    return working


async def test_a_client_polling_a_sandbox_that_does_not_answer_is_one_info_line(
    preview: Preview, caplog: pytest.LogCaptureFixture
) -> None:
    """Twelve polls of a preview whose sandbox does not answer: twelve 502s, twelve
    counted, one INFO line (the first) and the rest at DEBUG. Once a request gets
    through, the next failure is INFO again: a new run of them is news."""
    caplog.set_level(logging.DEBUG, logger=_LOGGER)
    metrics = preview.instances.manager.metrics
    working = await _runner_gone(preview)
    async with httpx.AsyncClient(base_url=preview.url) as client:
        for _ in range(12):
            response = await client.get(f"/preview/{INSTANCE}/?token={PREVIEW_TOKEN}")
            assert response.status_code == 502
        assert metrics.value(FAILURES_METRIC, kind="http") == 12
        assert _lines(caplog, logging.INFO) == [
            f"preview {INSTANCE}: upstream failed: SandboxUnavailableError"
        ]
        assert len(_lines(caplog, logging.DEBUG)) >= 11

        gone, preview.instance.runner = preview.instance.runner, working
        assert (await client.get(f"/preview/{INSTANCE}/?token={PREVIEW_TOKEN}")).status_code == 200
        preview.instance.runner = gone
        assert (await client.get(f"/preview/{INSTANCE}/?token={PREVIEW_TOKEN}")).status_code == 502
    assert len(_lines(caplog, logging.INFO)) == 2
    await gone.close()
    preview.instance.runner = working


async def test_a_hot_reload_client_retrying_its_websocket_is_one_info_line(
    preview: Preview, caplog: pytest.LogCaptureFixture
) -> None:
    """A dev server's hot-reload client reconnecting while its upstream refuses the
    upgrade (the fake runner refuses this client's token, as the real one answers 502
    while the app is not listening): each try is refused and counted, one INFO line."""
    caplog.set_level(logging.DEBUG, logger=_LOGGER)
    metrics = preview.instances.manager.metrics
    working = preview.instance.runner
    preview.instance.runner = AppRunnerClient(
        working.base_url, token="not-the-runner-token", session_id=SESSION
    )
    ws_url = preview.url.replace("http://", "ws://")
    for _ in range(6):
        with pytest.raises(websockets.exceptions.InvalidStatus):
            async with connect(f"{ws_url}/preview/{INSTANCE}/hmr?token={PREVIEW_TOKEN}"):
                pass
    assert metrics.value(FAILURES_METRIC, kind="websocket") == 6
    assert _lines(caplog, logging.INFO) == [
        f"preview {INSTANCE}: websocket upstream failed: InvalidStatus"
    ]
    await preview.instance.runner.close()
    preview.instance.runner = working


def test_a_run_longer_than_the_window_logs_again_with_its_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Past ``window_s`` the next failure is INFO again and says how many it stood for;
    instances and kinds are runs of their own; the tracked runs stay bounded."""
    caplog.set_level(logging.DEBUG, logger=_LOGGER)
    now = [0.0]
    failures = UpstreamFailures(window_s=60, max_tracked=2, clock=lambda: now[0])
    metrics = Metrics()
    for second in range(0, 90, 10):  # 0, 10, ..., 80
        now[0] = float(second)
        failures.failed("app_a", "http", "upstream failed", "E", metrics)
    failures.failed("app_a", "websocket", "websocket upstream failed", "E", metrics)
    failures.failed("app_b", "http", "upstream failed", "E", metrics)
    assert _lines(caplog, logging.INFO) == [
        "preview app_a: upstream failed: E",
        "preview app_a: upstream failed: E (5 more in the last 60 s, at DEBUG)",
        "preview app_a: websocket upstream failed: E",
        "preview app_b: upstream failed: E",
    ]
    assert metrics.value(FAILURES_METRIC, kind="http") == 10
    assert len(failures._runs) == 2
