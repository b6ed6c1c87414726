"""No secret (API key, runner token, preview token, webhook secret) reaches a log or a repr."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidHandshake

from sandcell_orchestrator.apps.preview import ACCESS_LOG_SECRET_PARAMETERS, COOKIE_NAME
from sandcell_orchestrator.serve.redaction import RedactQueryParameters

from .conftest import KEY_A, WEBHOOK_SECRET, StartApi
from .test_diagnostics import THROWING_JS
from .test_instances import eventually


def test_access_log_lines_lose_their_token() -> None:
    record = logging.LogRecord(
        "uvicorn.access",
        logging.INFO,
        __file__,
        1,
        '%s - "%s %s HTTP/%s" %d',
        ("127.0.0.1:1", "GET", "/preview/app_1/?a=1&token=SECRET-abc&b=2", "1.1", 200),
        None,
    )
    assert RedactQueryParameters(ACCESS_LOG_SECRET_PARAMETERS).filter(record)
    assert "SECRET" not in record.getMessage()
    assert "/preview/app_1/?a=1&token=[redacted]&b=2" in record.getMessage()


async def test_a_full_flow_logs_no_secret(
    start_api: StartApi, browser: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Create, preview in a browser, error + webhook, commands, delete: every record is clean."""
    caplog.set_level(logging.DEBUG)
    # uvicorn.access's own level too: a uvicorn.Config(log_level=...) made earlier in this
    # process (another test file) leaves it at that level, and no access line is recorded.
    caplog.set_level(logging.INFO, logger="uvicorn.access")
    api = await start_api()
    created = await api.create("static-site", webhook_url=f"{api.receiver_url}/hook")
    instance_id = created["instance_id"]
    (instance,) = api.apps.instances.all()
    preview_token = instance.preview_token
    runner_token = instance.handle.runner.connection._token
    await api.write(instance_id, {"app.js": THROWING_JS}, message="Throw")
    page = await browser.new_page()
    await page.goto(created["url"])
    await api.receiver.wait_for(1)
    await api.run(instance_id, "echo hi", "exit 2")
    await api.run(instance_id, "sudo id")
    async with httpx.AsyncClient() as client:
        await client.get(created["url"])

    async def deleted() -> bool:
        answer = await api.client.delete(f"/v1/instances/{instance_id}", headers=api.auth())
        return answer.status_code in (204, 404)

    await eventually(deleted)
    secrets = {
        "api key": KEY_A,
        "runner token": runner_token,
        "preview token": preview_token,
        "webhook secret": WEBHOOK_SECRET,
    }
    # httpx/httpcore records come from this test's own clients too, which are sent
    # the cookie and use the tokened URL, like a browser; httpcore never logs
    # request headers, so the service's runner client cannot leak through them.
    records = [r for r in caplog.records if not r.name.startswith(("httpx", "httpcore"))]
    assert any(r.name.startswith("uvicorn.access") for r in records)
    assert any(r.name.startswith("sandcell_orchestrator") for r in records)
    assert any("token=[redacted]" in r.getMessage() for r in records)
    for record in records:
        text = record.getMessage() + repr(record.args)
        for name, value in secrets.items():
            assert value not in text, f"{name} in a {record.name} log record"
    for thing in (instance, api.apps.instances, api.apps, api.apps.instances.settings):
        for name, value in secrets.items():
            assert value not in repr(thing), f"{name} in repr of {type(thing).__name__}"


async def test_preview_websockets_log_no_token_on_either_side(
    start_api: StartApi, caplog: pytest.LogCaptureFixture
) -> None:
    """uvicorn logs a WebSocket's path and query on its error logger (INFO), and the
    websockets library every handshake header there (DEBUG): with the service and its
    runners at DEBUG, upgrades with the preview token in the query or the cookie, and a
    wrong one, leave neither token nor the runner's in the service's or the runner's log."""
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="uvicorn.error")
    api = await start_api(SANDCELL_RUNNER_LOG_LEVEL="debug")
    created = await api.create("static-site")
    instance_id = created["instance_id"]
    (instance,) = api.apps.instances.all()
    preview_token = instance.preview_token
    runner_token = instance.handle.runner.connection._token
    ws_base = api.url.replace("http://", "ws://") + f"/preview/{instance_id}"
    for url, headers in (
        (f"{ws_base}/hmr?token={preview_token}&v=1", {}),
        (f"{ws_base}/hmr?v=2", {"Cookie": f"{COOKIE_NAME}={preview_token}"}),
        (f"{ws_base}/hmr?token=wrong-{preview_token}&v=3", {}),
    ):
        # static-site's server answers no upgrade: refused, after the runner was asked.
        with pytest.raises(InvalidHandshake):
            async with connect(url, additional_headers=headers, open_timeout=30):
                pass
    records = [r for r in caplog.records if r.name == "uvicorn.error"]
    lines = [r.getMessage() for r in records]
    assert sum("WebSocket /preview/" in line for line in lines) == 3, lines
    runner_logs = "".join(
        path.read_text(errors="replace") for path in api.runtime_dir.glob("*/runner.log")
    )
    assert '"WebSocket /v1/session/ports/' in runner_logs  # the runner was asked, and logged
    # The test's own clients (websockets, httpx) log what they send: not the service's.
    for record in caplog.records:
        if record.name.startswith(("websockets", "httpx", "httpcore")):
            continue
        text = record.getMessage() + repr(record.args)
        for name, value in (("preview token", preview_token), ("runner token", runner_token)):
            assert value not in text, f"{name} in a {record.name} log record"
    assert preview_token not in runner_logs
    assert runner_token not in runner_logs
    assert any("token=[redacted]&v=3" in line for line in lines), lines
    # The unauthenticated metrics name no credential and no tenant either.
    metrics = (await api.client.get("/metrics")).text
    assert "sandcell_preview_upstream_failures_total" in metrics
    for value in (preview_token, runner_token, KEY_A, "tenant-a"):
        assert value not in metrics
