"""E2B's SDK against ``sandcell serve`` on the other providers: Docker (podman) and Lambda
MicroVMs (the emulator). The same API, a different provider chosen by configuration.

Docker: the engine and the runner image ``scripts/services`` provides (or a private
podman, as the Docker suite's own fixture does). Lambda: the MicroVM emulator in
this process (its VMs are real runner processes), boto3 with dummy credentials.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from e2b import CommandExitException, FilesystemEventType, PtySize, Sandbox, SandboxState
from e2b_code_interpreter import Sandbox as CodeSandbox

from sandcell_orchestrator.emulator import MicrovmEmulator, serve_in_thread
from tests.e2b_api.conftest import E2bServe, start_serve, stop_serve
from tests.fixtures.paths import traversable_dir
from tests.orchestrator.cli.conftest import stop_leftovers
from tests.orchestrator.docker.conftest import Engine, engine

__all__ = ["engine"]

RUNNER_KEY = "e2b-test-runner-key-" + "k" * 32


@pytest.fixture(scope="module")
def docker_serve(engine: Engine) -> Iterator[E2bServe]:
    with traversable_dir("e2b-docker-") as base:
        served = start_serve(
            base,
            env={
                "SANDCELL_PROVIDER": "docker",
                "DOCKER_HOST": engine.docker_host,
                "SANDCELL_DOCKER_IMAGE": engine.image,
                "SANDCELL_DOCKER_MEMORY_MIB": "1024",
            },
        )
        try:
            yield served
        finally:
            stop_serve(served)


@pytest.fixture(scope="module")
def lambda_serve() -> Iterator[E2bServe]:
    with traversable_dir("e2b-microvms-") as base:
        emulator = MicrovmEmulator(base_dir=base / "vms", sweep_interval_s=0.05)
        with serve_in_thread(emulator) as url:
            served = start_serve(
                base / "serve",
                env={
                    "SANDCELL_PROVIDER": "lambda-microvm",
                    "SANDCELL_MICROVM_IMAGE": "sandcell-runner",
                    "SANDCELL_MICROVM_ENDPOINT_URL": url,
                    "SANDCELL_MICROVM_REGION": "us-east-1",
                    "SANDCELL_MICROVM_RUNNER_KEY": RUNNER_KEY,
                    "SANDCELL_MICROVM_POLL_INTERVAL_S": "0.05",
                    "AWS_ACCESS_KEY_ID": "AKIDTESTINGEMULATOR",
                    "AWS_SECRET_ACCESS_KEY": "emulator-secret-" + "s" * 24,
                    "AWS_CONFIG_FILE": str(base / "no-aws-config"),
                    "AWS_SHARED_CREDENTIALS_FILE": str(base / "no-aws-credentials"),
                },
            )
            try:
                yield served
            finally:
                stop_serve(served)
        leftovers = stop_leftovers(base / "vms")
        assert not leftovers, f"MicroVM runners left behind: {leftovers}"


def test_docker_provider_end_to_end(docker_serve: E2bServe) -> None:
    """On podman: run, exit codes, files, a background command fed and killed, a PTY,
    the filesystem RPCs and a watcher, the code interpreter, pause then connect with the
    files intact, kill."""
    sandbox = Sandbox.create(**docker_serve.opts())
    try:
        assert sandbox.commands.run("echo hi").stdout == "hi\n"
        with pytest.raises(CommandExitException) as raised:
            sandbox.commands.run("exit 5")
        assert raised.value.exit_code == 5

        sandbox.files.write("/home/user/d.txt", "in a container")
        assert sandbox.files.read("d.txt") == "in a container"
        assert [e.name for e in sandbox.files.list("/home/user")] == ["d.txt"]

        handle = sandbox.commands.run("read x; echo got:$x; sleep 300", background=True, stdin=True)
        sandbox.commands.send_stdin(handle.pid, "podman\n")
        for stdout, _, _ in handle:
            if stdout and "got:" in stdout:
                break
        assert handle.kill() is True

        terminal = sandbox.pty.create(PtySize(rows=24, cols=80))
        sandbox.pty.send_stdin(terminal.pid, b"echo pty-$((40+2))\n")
        seen = bytearray()
        for _, _, data in terminal:
            seen.extend(data or b"")
            if b"pty-42" in seen:
                break
        assert sandbox.pty.kill(terminal.pid) is True

        assert sandbox.files.make_dir("tree/sub") is True
        watcher = sandbox.files.watch_dir("tree")
        sandbox.files.write("tree/sub/w.txt", "watched")
        moved = sandbox.files.rename("tree/sub/w.txt", "tree/w2.txt")
        assert moved.path == "/home/user/tree/w2.txt"
        assert {e.path for e in sandbox.files.list("tree", depth=2)} == {
            "/home/user/tree/sub",
            "/home/user/tree/w2.txt",
        }
        assert ("w2.txt", FilesystemEventType.CREATE) in {
            (e.name, e.type) for e in watcher.get_new_events()
        }
        watcher.stop()
        sandbox.files.remove("tree")
        assert sandbox.files.exists("tree") is False

        interpreter = CodeSandbox.connect(sandbox.sandbox_id, **docker_serve.opts())
        interpreter.run_code("x = 1")
        assert interpreter.run_code("x + 41").text == "42"

        assert sandbox.pause() is True
        info = Sandbox.get_info(sandbox.sandbox_id, **docker_serve.opts())
        assert info.state == SandboxState.PAUSED
        resumed = Sandbox.connect(sandbox.sandbox_id, **docker_serve.opts())
        assert resumed.files.read("d.txt") == "in a container"
    finally:
        Sandbox.kill(sandbox.sandbox_id, **docker_serve.opts())


def test_lambda_microvm_create_run_pause_kill(lambda_serve: E2bServe) -> None:
    """On the Lambda MicroVM emulator: create, run a command; pause suspends the MicroVM
    in place, so after connect a process started before the pause still runs; kill."""
    sandbox = Sandbox.create(**lambda_serve.opts())
    try:
        assert sandbox.commands.run("echo from a microvm").stdout == "from a microvm\n"
        sandbox.files.write("m.txt", "vm file")
        assert sandbox.commands.run("cat /home/user/m.txt").stdout == "vm file"
        kept = sandbox.commands.run("sleep 300", background=True)
        assert sandbox.pause() is True
        resumed = Sandbox.connect(sandbox.sandbox_id, **lambda_serve.opts())
        assert kept.pid in {p.pid for p in resumed.commands.list()}
        assert resumed.files.read("m.txt") == "vm file"
    finally:
        assert sandbox.kill() is True
    assert Sandbox.list(**lambda_serve.opts()).next_items() == []
