"""The local provider's ready check against the listening socket it binds for the runner.

The kernel accepts every connection to a listening socket before the runner does: a
ready try that gave up early left its request queued for the runner to serve once it
was up. One try bounded by the ready timeout, closed when it gives up, is what is asked.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandcell_orchestrator.errors import SandboxUnavailableError
from sandcell_orchestrator.providers.base import SandboxSpec
from sandcell_orchestrator.providers.local import LocalProvider, LocalSettings
from sandcell_orchestrator.providers.local_ready import runner_log_tail, wait_ready_unless_exited
from sandcell_orchestrator.runner.client import RunnerClient
from tests.fixtures.paths import traversable_dir

_TOKEN = "ready-check-token"


def _queued(listener: socket.socket) -> list[tuple[bytes, bool]]:
    """Each connection waiting in ``listener``'s backlog: what it sent, and whether its
    client had closed it (EOF after the request)."""
    listener.settimeout(0.2)
    found = []
    while True:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            return found
        with conn:
            conn.settimeout(0.5)
            data, closed = b"", False
            try:
                while chunk := conn.recv(65536):
                    data += chunk
                closed = True
            except TimeoutError:
                pass
            found.append((data, closed))


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    with socket.create_server(("127.0.0.1", 0), backlog=128) as sock:
        yield sock


async def test_a_runner_slow_to_accept_gets_one_request_and_the_ready_timeout_bounds_it(
    listener: socket.socket,
) -> None:
    """The runner (here: a live process, and a socket nobody accepts on) does not answer
    within the 4.5 s ready timeout. The wait ends at that timeout, not before, and it
    left one request in the backlog, closed (two-second tries left three)."""
    client = RunnerClient(f"http://127.0.0.1:{listener.getsockname()[1]}", token=_TOKEN)
    process = subprocess.Popen(["sleep", "60"])
    try:
        started = time.monotonic()
        with pytest.raises(SandboxUnavailableError, match=r"not ready in 4\.5s"):
            await wait_ready_unless_exited(client, process, timeout_s=4.5)
        assert 4.4 <= time.monotonic() - started < 30
        queued = _queued(listener)
        assert len(queued) == 1
        request, closed = queued[0]
        assert request.startswith(b"GET /health")
        assert closed
    finally:
        await client.close()
        process.kill()
        process.wait()


async def test_a_runner_that_exits_first_leaves_its_request_closed(
    listener: socket.socket,
) -> None:
    """The runner exits before accepting: the wait ends at once and the connection it
    had opened is closed, not left open in the backlog."""
    client = RunnerClient(f"http://127.0.0.1:{listener.getsockname()[1]}", token=_TOKEN)
    process = subprocess.Popen(["sleep", "0.5"])
    try:
        started = time.monotonic()
        with pytest.raises(SandboxUnavailableError, match="exited"):
            await wait_ready_unless_exited(client, process, timeout_s=60)
        assert time.monotonic() - started < 30
        await asyncio.sleep(0.1)  # the close's FIN to arrive
        assert [closed for _, closed in _queued(listener)] == [True]
    finally:
        await client.close()
        process.wait()


async def test_a_runner_slower_to_start_than_one_try_gets_one_ready_request() -> None:
    """A real runner that starts 3 s late (its interpreter wrapped by a script that
    sleeps first, then counts the runner's backlog): the create succeeds, and just
    one ready request was waiting for it."""
    with traversable_dir("ready-") as base:
        wrapper = base / "python"
        count = base / "queued"
        wrapper.write_text(
            "#!/bin/sh\n"
            'if [ "$2" = sandcell_runner ]; then\n'
            "    sleep 3\n"
            f'    ss -Hltn "sport = :$SANDCELL_RUNNER_PORT" > {count}\n'
            "fi\n"
            f'exec {sys.executable} "$@"\n'
        )
        wrapper.chmod(0o755)
        provider = LocalProvider(LocalSettings(runtime_dir=base / "rt", python=str(wrapper)))
        try:
            handle = await provider.create(SandboxSpec())
            try:
                assert (await handle.runner.health()).status == "ok"
            finally:
                await handle.runner.close()
                await provider.destroy(handle.sandbox_id)
        finally:
            await provider.close()
        # ss: State Recv-Q Send-Q ...; a listener's Recv-Q is its accept queue.
        assert Path(count).read_text().split()[1] == "1"


def test_the_log_tail_of_a_runner_that_never_got_ready_is_one_line(tmp_path: Path) -> None:
    """It ends the CLI's one-line error: no trailing blank line after the runner's words."""
    (tmp_path / "runner.log").write_text(
        "sandcell-runner: configuration error: SANDCELL_RUNNER_MEMORY_MIB: must be ...\n\n"
    )
    assert runner_log_tail(tmp_path).endswith("must be ...")
    assert runner_log_tail(tmp_path / "missing") == ""
