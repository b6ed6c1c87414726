"""A process's output faster than its E2B stream reads it, through the real ``e2b``
client: once the stream falls ``SANDCELL_RUNNER_PROCESS_STREAM_EVENTS`` chunks behind
it is ended, and the user is told why. The end event's ``error`` (``.error`` of the
SDK's ``CommandExitException``) and a last stderr line (what the exception prints)
name the limit and the variable that raises it; they said "the client fell too far
behind the process's output" in ``.error`` only, so the exception printed
"Command exited with code -1 and error:" and nothing after it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from e2b import CommandExitException, Sandbox

from tests.e2b_api.conftest import E2bServe, start_serve, stop_serve
from tests.fixtures.paths import traversable_dir
from tests.orchestrator.cli.conftest import stop_leftovers

EVENTS = 32


@pytest.fixture(scope="module")
def served() -> Iterator[E2bServe]:
    with traversable_dir("e2b-drop-") as base:
        service = start_serve(base, env={"SANDCELL_RUNNER_PROCESS_STREAM_EVENTS": str(EVENTS)})
        try:
            yield service
        finally:
            stop_serve(service)
            assert not stop_leftovers(service.runtime_dir)


def test_a_dropped_stream_says_which_limit_and_variable(served: E2bServe) -> None:
    sandbox = Sandbox.create(**served.opts())
    try:
        with pytest.raises(CommandExitException) as raised:
            sandbox.commands.run("head -c 200000000 /dev/zero", timeout=120)
        exc = raised.value
        assert exc.exit_code == -1
        assert exc.error is not None
        assert f"fell {EVENTS} output chunks behind" in exc.error, exc.error
        assert "SANDCELL_RUNNER_PROCESS_STREAM_EVENTS" in exc.error, exc.error
        assert str(exc).endswith(f"\n{exc.error}\n"), str(exc)[-300:]
        # Less came than was written: the stream ended early, not the process.
        assert len(exc.stdout) < 200_000_000
        # The sandbox and its other commands are unaffected.
        assert sandbox.commands.run("echo alive").stdout == "alive\n"
    finally:
        sandbox.kill()
