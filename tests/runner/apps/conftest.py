"""App tests: one session-enabled runner per module (a runner binds to one session)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.fixtures.paths import traversable_dir
from tests.fixtures.runner_process import RunnerProcess, running_runner
from tests.runner.apps.helpers import AppClient


@pytest.fixture(scope="module")
def app_runner() -> Iterator[RunnerProcess]:
    with (
        traversable_dir() as root,
        running_runner(root, env={"SANDCELL_RUNNER_SESSIONS": "1"}) as process,
    ):
        yield process


@pytest.fixture(scope="module")
def app(app_runner: RunnerProcess) -> Iterator[AppClient]:
    """The module's session (processes and errors accumulate across its tests)."""
    with AppClient(app_runner) as client:
        yield client


@pytest.fixture
def fresh_runner() -> Iterator[RunnerProcess]:
    """A runner of its own, for tests that end the session."""
    with (
        traversable_dir() as root,
        running_runner(root, env={"SANDCELL_RUNNER_SESSIONS": "1"}) as process,
    ):
        yield process
