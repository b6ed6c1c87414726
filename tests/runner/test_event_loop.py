"""The runner's event loop setting: uvloop by default, asyncio on request, errors named."""

from __future__ import annotations

import pytest

from sandcell_runner.config import RunnerSettings
from sandcell_runner.errors import ConfigError

BASE = {"SANDCELL_RUNNER_INSECURE_NO_AUTH": "1", "SANDCELL_RUNNER_JAIL": "none"}


@pytest.mark.parametrize(
    ("asked", "expected"),
    [(None, "uvloop"), ("auto", "uvloop"), ("uvloop", "uvloop"), ("asyncio", "asyncio")],
)
def test_the_event_loop_is_uvloop_unless_asyncio_is_asked_for(
    asked: str | None, expected: str
) -> None:
    """uvloop is one of the runner's dependencies, so ``auto`` (the default) picks it."""
    env = dict(BASE) if asked is None else {**BASE, "SANDCELL_RUNNER_EVENT_LOOP": asked}
    assert RunnerSettings.from_env(env).event_loop == expected


def test_an_unknown_event_loop_fails_start_up_naming_the_variable() -> None:
    """A typo is a start-up error, not a silent fallback."""
    with pytest.raises(ConfigError, match="SANDCELL_RUNNER_EVENT_LOOP"):
        RunnerSettings.from_env({**BASE, "SANDCELL_RUNNER_EVENT_LOOP": "trio"})
