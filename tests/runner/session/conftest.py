"""Session-enabled runners."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.fixtures.paths import traversable_dir
from tests.fixtures.runner_process import RunnerProcess, running_runner


@pytest.fixture
def session_runner() -> Iterator[RunnerProcess]:
    """A fresh session-enabled runner per test (a runner binds to one session)."""
    with (
        traversable_dir() as root,
        running_runner(root, env={"SANDCELL_RUNNER_SESSIONS": "1"}) as process,
    ):
        yield process
