"""Fixtures for runner tests: real runner processes over real HTTP, real nsjail."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from tests.fixtures.paths import traversable_dir
from tests.fixtures.runner_process import RunnerProcess, start_runner

StartRunner = Callable[..., RunnerProcess]


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
def runner_factory() -> Iterator[StartRunner]:
    """Start runners with custom environment; all are stopped afterwards."""
    with ExitStack() as stack:

        def start(**env: str) -> RunnerProcess:
            root: Path = stack.enter_context(traversable_dir())
            process = start_runner(root, env=env)
            stack.callback(process.stop)
            return process

        yield start
