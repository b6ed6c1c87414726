"""Fixtures for RunnerClient and SandboxHandle tests.

Real runner processes on loopback for everything a runner does, and ``FakeRunner``
behind ``httpx.MockTransport`` (the transport is the seam) where a real one cannot
be made to misbehave on demand: another protocol major, an error body echoing a
secret, a proxy's HTML page.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from sandcell_orchestrator.runner.client import RunnerClient
from sandcell_protocol import (
    PROTOCOL_VERSION,
    ErrorCode,
    ExecuteRequest,
    ExecuteResult,
    Health,
    RunStatus,
    decode,
    encode,
    error_body,
    routes,
)
from sandcell_protocol.messages import HealthStatus
from tests.fixtures.paths import traversable_dir
from tests.fixtures.runner_process import RunnerProcess, start_runner

StartRunner = Callable[..., RunnerProcess]
SESSIONS_ON = {"SANDCELL_RUNNER_SESSIONS": "1"}


@pytest.fixture(scope="module")
def runner() -> Iterator[RunnerProcess]:
    """A stateless runner shared by a module's tests."""
    with traversable_dir() as root:
        process = start_runner(root)
        try:
            yield process
        finally:
            process.stop()


@pytest.fixture
async def client(runner: RunnerProcess) -> AsyncIterator[RunnerClient]:
    """A RunnerClient of the module's stateless runner, closed afterwards."""
    async with RunnerClient(runner.url, token=runner.token) as runner_client:
        yield runner_client


@pytest.fixture
def runner_factory() -> Iterator[StartRunner]:
    """Start runners with a custom environment (sessions on by default); all stopped after."""
    with ExitStack() as stack:

        def start(*, wait: bool = True, **env: str) -> RunnerProcess:
            root: Path = stack.enter_context(traversable_dir())
            process = start_runner(root, env={**SESSIONS_ON, **env}, wait=wait)
            stack.callback(process.stop)
            return process

        yield start


TOKEN = "fake-token-0123456789abcdef"
BASE_URL = "http://runner.test:8080"

Handler = Callable[[httpx.Request], httpx.Response]


def json_response(value: object, status: int = 200) -> httpx.Response:
    return httpx.Response(
        status, content=encode(value), headers={"Content-Type": "application/json"}
    )


def error_response(code: ErrorCode, message: str, status: int = 400) -> httpx.Response:
    return json_response(error_body(code, message), status)


def result(
    *,
    exit_code: int | None = 0,
    stdout: str = "",
    stderr: str = "",
    status: RunStatus = RunStatus.OK,
) -> ExecuteResult:
    return ExecuteResult(
        status=status,
        exit_code=exit_code,
        signal=None,
        stdout=stdout,
        stderr=stderr,
        stdout_truncated=False,
        stderr_truncated=False,
        wall_ms=1,
        cpu_ms=1,
        max_rss_kib=None,
        files=[],
    )


@dataclass
class FakeRunner:
    """Answers ``/health`` with ``protocol`` and every other route with ``handler``."""

    protocol: str = PROTOCOL_VERSION
    status: HealthStatus = "ok"
    handler: Handler = field(default=lambda request: json_response(result()))
    requests: list[httpx.Request] = field(default_factory=list)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if request.url.path == routes.HEALTH:
            return json_response(
                Health(status=self.status, protocol=self.protocol, runner_version="0")
            )
        return self.handler(request)

    def client(self, **kwargs: object) -> RunnerClient:
        return RunnerClient(
            BASE_URL,
            token=TOKEN,
            transport=httpx.MockTransport(self),
            **kwargs,  # type: ignore[arg-type]
        )

    @property
    def executes(self) -> list[ExecuteRequest]:
        return [
            decode(request.content, ExecuteRequest)
            for request in self.requests
            if request.url.path == routes.EXECUTE
        ]

    def paths(self) -> list[str]:
        return [request.url.path for request in self.requests]
