"""Context tests: one session-enabled runner and one session per module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.fixtures.paths import traversable_dir
from tests.fixtures.runner_process import RunnerProcess, running_runner
from tests.runner.contexts.helpers import ContextClient

# Short enough that the timeout tests end quickly, long enough for a loaded machine.
RUNNER_ENV = {
    "SANDCELL_RUNNER_SESSIONS": "1",
    "SANDCELL_RUNNER_CONTEXT_GRACE_MS": "1500",
    "SANDCELL_RUNNER_MAX_CONTEXTS": "32",
}


@pytest.fixture(scope="module")
def ctx_runner() -> Iterator[RunnerProcess]:
    with traversable_dir() as root, running_runner(root, env=RUNNER_ENV) as process:
        yield process


@pytest.fixture(scope="module")
def client(ctx_runner: RunnerProcess) -> Iterator[ContextClient]:
    """The module's session; each test makes the contexts it needs."""
    with ContextClient(ctx_runner) as session:
        yield session


@pytest.fixture
def fresh_runner() -> Iterator[RunnerProcess]:
    """A runner of its own, for tests that end the session or the runner."""
    with traversable_dir() as root, running_runner(root, env=RUNNER_ENV) as process:
        yield process


@pytest.fixture
def ctx(client: ContextClient) -> Iterator[str]:
    """A fresh python context in the module's session, deleted afterwards."""
    context_id = client.create()
    yield context_id
    client.http.delete(f"/v1/session/contexts/{context_id}")


@pytest.fixture
def other_runner() -> Iterator[RunnerProcess]:
    """A second runner, to restore a checkpoint into a new sandbox."""
    with traversable_dir() as root, running_runner(root, env=RUNNER_ENV) as process:
        yield process
