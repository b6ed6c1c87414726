"""A real failure answered by ``/v1``: a runner SIGKILLed mid-job is a retryable 503
``busy`` that says what failed and names no runner route, address or path; what the
failure itself said (the runner's route) is in the service's log instead.

Through ``sandcell serve``'s app under a real uvicorn, real runners underneath.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import httpx
import pytest

from sandcell_orchestrator.config import OrchestratorSettings
from sandcell_orchestrator.serve.app import create_app
from sandcell_orchestrator.testing import clean_environ
from sandcell_protocol import ErrorBody, ErrorCode, decode, routes
from tests.fixtures.killed_runner import (
    assert_no_internal_detail,
    job,
    kill_when_running,
    new_marker,
)
from tests.fixtures.serving import serving

KEY = "errors-key-0123456789abcdef"


@pytest.fixture
async def client(tmp_path: Path, runtime_dir: Path) -> AsyncIterator[httpx.AsyncClient]:
    settings = OrchestratorSettings.from_env(
        clean_environ(
            SANDCELL_HOME=str(tmp_path / "home"),
            SANDCELL_LOCAL_RUNTIME_DIR=str(runtime_dir),
            SANDCELL_API_KEYS=f"{KEY}=tenant-a",
        )
    )
    async with (
        serving(create_app(settings), lifespan="on") as url,
        httpx.AsyncClient(
            base_url=url, timeout=300, headers={"Authorization": f"Bearer {KEY}"}
        ) as client,
    ):
        yield client


def _call(marker: str) -> dict[str, object]:
    return {
        "language": "python",
        "user_id": "u",
        "runtime_session_hint": f"h-{uuid.uuid4().hex[:8]}",
        "code": job(marker),
        "timeout_ms": 600_000,
    }


async def test_a_killed_runner_answers_what_failed_not_where(
    client: httpx.AsyncClient, runtime_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``POST /v1/exec`` (JSON): 503 ``busy``, retryable, no internal detail in the body;
    the runner route the failure named is logged."""
    marker = new_marker()
    caplog.set_level(logging.WARNING, logger="sandcell_orchestrator.serve.errors")
    with anyio.fail_after(300):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(
                anyio.to_thread.run_sync,
                lambda: kill_when_running(marker, runtime_dir, spare=os.getpid()),
            )
            response = await client.post("/v1/exec", json=_call(marker))
    assert response.status_code == 503, response.text
    error = decode(response.content, ErrorBody).error
    assert (error.code, error.retryable) == (ErrorCode.BUSY, True)
    assert "sandbox" in error.message
    assert_no_internal_detail(response.text, runtime_dir=runtime_dir)
    assert routes.EXECUTE in caplog.text


async def test_a_killed_runner_mid_stream_ends_in_a_clean_error_event(
    client: httpx.AsyncClient, runtime_dir: Path
) -> None:
    """``POST /v1/exec`` (NDJSON): the output so far, then an error event that names
    nothing internal."""
    marker = new_marker()
    lines: list[str] = []
    with anyio.fail_after(300):
        async with (
            anyio.create_task_group() as tasks,
            client.stream(
                "POST",
                "/v1/exec",
                json=_call(marker),
                headers={"Accept": "application/x-ndjson"},
            ) as response,
        ):
            assert response.status_code == 200
            tasks.start_soon(
                anyio.to_thread.run_sync,
                lambda: kill_when_running(marker, runtime_dir, spare=os.getpid()),
            )
            lines = [line async for line in response.aiter_lines() if line]
    last = json.loads(lines[-1])
    assert last["error"]["code"] == "busy", lines
    assert last["error"]["retryable"] is True
    for line in lines:
        assert_no_internal_detail(line, runtime_dir=runtime_dir)
