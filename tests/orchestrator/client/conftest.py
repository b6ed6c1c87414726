"""Fixtures for RunnerClient and SandboxHandle tests: real runner processes on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from sandcell_orchestrator.runner_client import RunnerClient
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
