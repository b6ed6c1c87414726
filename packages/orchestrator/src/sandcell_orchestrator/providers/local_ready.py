"""Waiting for a launched local runner to answer, and saying why it did not.

The provider binds the runner's listening socket itself and hands it over, so the
ready check's one request waits in the listen backlog until the runner accepts it:
no port that refuses while the runner imports itself, no polling. The wait ends
early when the runner exits first (a pidfd says so): a runner that crashed or was
misconfigured will never answer, and a cold session should hear that at once
rather than after the whole ready timeout.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import anyio

from ..errors import SandboxUnavailableError
from ..runner.client import RunnerClient
from .local_state import LaunchedProcess
from .local_zygote import ForkedRunner

__all__ = ["runner_log_tail", "wait_ready_unless_exited"]

_LOG_TAIL_CHARS = 300
"""How much of the runner's log an error quotes: its last lines say why it stopped."""


async def wait_ready_unless_exited(
    client: RunnerClient, process: LaunchedProcess, *, timeout_s: float
) -> None:
    """``client.wait_ready``, given up once the runner has exited (a configuration error,
    a crash): it will never answer, and waiting out ``timeout_s`` (30 s) kept a cold
    session from hearing so. A pidfd says when (no polling; it is close-on-exec).

    ``SandboxUnavailableError`` when the runner exited first or did not answer in time.
    """
    scope = anyio.CancelScope()
    loop = asyncio.get_running_loop()
    try:
        # A forked runner is not our child: only the zygote's pidfd surely names it.
        pidfd = (
            os.dup(process.pidfd)
            if isinstance(process, ForkedRunner)
            else os.pidfd_open(process.pid)
        )
    except OSError:  # a kernel before 5.3: only the timeout ends the wait
        pidfd = -1

    def exited() -> None:
        loop.remove_reader(pidfd)
        scope.cancel()

    if pidfd >= 0:
        loop.add_reader(pidfd, exited)
    try:
        with scope:
            # One try as long as the whole wait: the backlog holds it until the runner
            # accepts it, where shorter tries each queued one more request to serve.
            await client.wait_ready(timeout_s=timeout_s, interval_s=0.01, attempt_s=timeout_s)
            return
    finally:
        if pidfd >= 0:
            loop.remove_reader(pidfd)
            os.close(pidfd)
    raise SandboxUnavailableError(f"the runner exited ({process.poll()}) before it was ready")


def runner_log_tail(root: Path) -> str:
    """The end of the runner's log under ``root`` ("" when there is none), for an error
    that says why the runner did not become ready."""
    try:
        # Stripped: it ends a one-line CLI error, where a trailing newline is a blank line.
        return (root / "runner.log").read_text(errors="replace")[-_LOG_TAIL_CHARS:].strip()
    except OSError:
        return ""
