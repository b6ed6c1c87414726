"""``sandcell serve`` reads runners' answers up to the ceiling its settings give.

A real service (uvicorn, the local provider, real runners) whose runners are told,
through the ``SANDCELL_RUNNER_*`` variables the provider passes on, to keep 16 MiB of
stdout by default. With ``SANDCELL_ANSWER_MAX_OUTPUT_BYTES`` above that, a job's 15 MiB
of output arrives in full; with it below, the answer is refused with a 413 that names
the variable to raise (and the runner's), not a 503 asking to retry.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx
import pytest

from sandcell_orchestrator.config import OrchestratorSettings
from sandcell_orchestrator.serve.app import create_app
from sandcell_orchestrator.testing import clean_environ
from sandcell_protocol import ErrorBody, ErrorCode, ExecuteResult, RunStatus, decode
from tests.fixtures.serving import serving

MIB = 1 << 20
KEY = "key-a-0123456789abcdef"
RUNNERS = {
    # What the local provider passes on to every runner it starts.
    "SANDCELL_RUNNER_STDOUT_BYTES": str(16 * MIB),
    "SANDCELL_RUNNER_MAX_STDOUT_BYTES": str(32 * MIB),
    "SANDCELL_RUNNER_STDERR_BYTES": str(64 << 10),
    "SANDCELL_RUNNER_OUTPUT_SCAN_BYTES": str(1 * MIB),
    "SANDCELL_RUNNER_MAX_OUTPUT_FILES": "10",
}
"""Runners that keep 16 MiB of a job's stdout when its request sets no limit."""
TIGHT = {
    # So that the answer's cap is mostly its output's (not 341 MiB of inlined files).
    "SANDCELL_ANSWER_OUTPUT_SCAN_BYTES": str(1 * MIB),
    "SANDCELL_ANSWER_MAX_OUTPUT_FILES": "10",
}
PRINT = "import sys; sys.stdout.write('x' * (15 << 20))"

Serve = Callable[..., Awaitable[httpx.AsyncClient]]


@pytest.fixture
async def serve(tmp_path: Path, runtime_dir: Path) -> AsyncIterator[Serve]:
    async with contextlib.AsyncExitStack() as stack:

        async def start(**env: str) -> httpx.AsyncClient:
            settings = OrchestratorSettings.from_env(
                clean_environ(
                    SANDCELL_HOME=str(tmp_path / f"home{len(started)}"),
                    SANDCELL_LOCAL_RUNTIME_DIR=str(runtime_dir),
                    SANDCELL_API_KEYS=f"{KEY}=tenant-a",
                    **RUNNERS,
                    **TIGHT,
                    **env,
                )
            )
            started.append(settings)
            url = await stack.enter_async_context(serving(create_app(settings), lifespan="on"))
            return await stack.enter_async_context(
                httpx.AsyncClient(
                    base_url=url, timeout=120, headers={"Authorization": f"Bearer {KEY}"}
                )
            )

        started: list[OrchestratorSettings] = []
        yield start


async def _exec(client: httpx.AsyncClient, code: str) -> httpx.Response:
    return await client.post(
        "/v1/exec", json={"language": "python", "user_id": "alice", "code": code}
    )


async def test_a_ceiling_above_the_runners_limits_reads_their_whole_output(serve: Serve) -> None:
    client = await serve(SANDCELL_ANSWER_MAX_OUTPUT_BYTES=str(32 * MIB))
    response = await _exec(client, PRINT)
    assert response.status_code == 200, response.text[:500]
    result = decode(response.content, ExecuteResult)
    assert (result.status, len(result.stdout), result.stdout_truncated) == (
        RunStatus.OK,
        15 * MIB,
        False,
    )


async def test_a_ceiling_below_them_is_a_413_naming_the_variable_to_raise(
    serve: Serve, caplog: pytest.LogCaptureFixture
) -> None:
    client = await serve(SANDCELL_ANSWER_MAX_OUTPUT_BYTES=str(1 * MIB))
    response = await _exec(client, PRINT)
    assert response.status_code == 413, response.text[:500]
    error = decode(response.content, ErrorBody).error
    assert (error.code, error.retryable) == (ErrorCode.PAYLOAD_TOO_LARGE, False)
    assert "raise SANDCELL_ANSWER_MAX_OUTPUT_BYTES" in error.message
    assert f"SANDCELL_RUNNER_STDOUT_BYTES={16 * MIB} is above" in error.message
    # A small answer from the same runners still arrives.
    small = await _exec(client, "print(6 * 7)")
    assert small.status_code == 200, small.text
    assert decode(small.content, ExecuteResult).stdout == "42\n"
