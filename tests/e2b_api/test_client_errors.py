"""A real failure as E2B's SDK reports it: a sandbox whose runner is SIGKILLed mid-command
fails that command, and every later call on it, with errors that say what failed and
name no runner route, address or path."""

from __future__ import annotations

import threading
from collections.abc import Callable

from e2b import Sandbox
from e2b.exceptions import SandboxException
from e2b_code_interpreter import Sandbox as CodeSandbox

from tests.e2b_api.conftest import E2bServe
from tests.fixtures.killed_runner import assert_no_internal_detail, kill_when_running, new_marker


def _failure(call: Callable[[], object]) -> BaseException:
    """What ``call`` raised (it must raise)."""
    try:
        call()
    except Exception as exc:
        return exc
    raise AssertionError(f"{call} did not fail")


def _kill_mid_command(e2b_serve: E2bServe, sandbox: Sandbox) -> BaseException:
    """Start a long command, kill the sandbox's runner once it runs; what the run raised."""
    marker = new_marker()
    raised: list[BaseException] = []

    def run() -> None:
        command = f"python3 -c 'import time; time.sleep(600)' {marker}"
        raised.append(_failure(lambda: sandbox.commands.run(command, timeout=0)))

    thread = threading.Thread(target=run)
    thread.start()
    try:
        kill_when_running(marker, e2b_serve.runtime_dir, spare=e2b_serve.process.pid)
    finally:
        thread.join(timeout=300)
    assert raised, "the command never ended"
    return raised[0]


def test_a_killed_runner_fails_calls_without_internal_detail(e2b_serve: E2bServe) -> None:
    """The running command, then a file read, a new command and a cell: each fails as
    E2B's SDK raises it, naming nothing internal."""
    sandbox = CodeSandbox.create(**e2b_serve.opts())
    try:
        failures = [
            _kill_mid_command(e2b_serve, sandbox),
            _failure(lambda: sandbox.files.read("/home/user/anything")),
            _failure(lambda: sandbox.files.list("/home/user")),
            _failure(lambda: sandbox.commands.run("echo hi")),
            _failure(lambda: sandbox.run_code("1 + 1")),
        ]
    finally:
        sandbox.kill()
    for failure in failures:
        assert isinstance(failure, SandboxException), repr(failure)
        assert_no_internal_detail(str(failure), runtime_dir=e2b_serve.runtime_dir)
    assert "sandbox" in str(failures[1]), failures[1]


def test_a_refused_path_names_the_callers_path_only(e2b_serve: E2bServe) -> None:
    """A runner's refusal (a directory read as a file) keeps its own words about the
    caller's path, without the runner route it came from."""
    path = "/home/user/x"
    sandbox = Sandbox.create(**e2b_serve.opts())
    try:
        sandbox.files.make_dir(path)
        failure = _failure(lambda: sandbox.files.read(path))
    finally:
        sandbox.kill()
    assert isinstance(failure, SandboxException), repr(failure)
    assert str(failure) == "path '/home/user/x': is a directory", failure
    assert_no_internal_detail(str(failure), runtime_dir=e2b_serve.runtime_dir)
