"""Stopping local runners and reaping what they leave: processes, cgroups, roots.

A runner's remains are its process (a zombie until whoever started it waits for
it), the job-pool cgroups it made (named after its root; a zombie still counts in
them, so they cannot go before it is reaped), and its root with tmpfs workspace
mounts. ``stop_runner`` ends the process and reaps its cgroups however it ended;
``discard_launch`` does all of it for a launch that failed, which nothing else would
find; ``reap_in_background`` waits for a runner this process started, so none is
left a zombie whoever ends it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import threading

import psutil

from .local_state import LaunchedProcess, LocalRunner, is_this_runner, runner_alive
from .local_zygote import ForkedRunner
from .runner_roots import detach_runner_mounts, reap_runner_cgroups, remove_runner_root

__all__ = ["discard_launch", "reap_in_background", "stop_runner"]


async def stop_runner(runner: LocalRunner, *, python: str) -> bool:
    """Stop the runner and reap its cgroups; False when some are still there.

    Reaped however it ended: gone before us (crashed, killed), SIGKILLed here, and
    also after a "graceful" stop, which is no proof: a runner SIGKILLed by someone
    else while this waited, or one whose own removal met a busy cgroup, left its
    job-pool cgroups, and nothing would find them once the root is gone. ``python``
    is the runner's interpreter, which runs the cgroup reaper.
    """
    if runner_alive(runner):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(runner.pid, signal.SIGTERM)
        # A runner mid-job drains for up to its graceful-shutdown timeout; destroy
        # does not need the drain, only the runner's own unmounts, so wait briefly.
        for _ in range(40):
            if not runner_alive(runner):
                break
            await asyncio.sleep(0.05)
        else:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(runner.pid, signal.SIGKILL)
    return await _reap_cgroups(runner, python=python)


async def _reap_cgroups(runner: LocalRunner, *, python: str) -> bool:
    # Dying, or a zombie (which still counts as a member of its cgroups, so rmdir
    # says EBUSY until whoever started it reaps it): wait for that, briefly.
    for _ in range(100):
        if not (runner_alive(runner) or _is_zombie_runner(runner)):
            break
        await asyncio.sleep(0.02)
    return await asyncio.to_thread(reap_runner_cgroups, python, runner.root)


async def discard_launch(runner: LocalRunner, process: LaunchedProcess, *, python: str) -> None:
    """A launch that failed: its runner killed and waited for, its root removed.

    No ``sandbox.json`` names it yet, so only the sweeper (which ``sandcell exec``
    has not) would find the root: each failed start left one, with whatever tmpfs
    workspaces it had mounted. As in ``destroy``, a root whose cgroups are still
    there stays (its name finds them), its mounts detached.
    """
    clean = await stop_runner(runner, python=python)
    # A forked one is the zygote's child, reaped by it: its pid is ours to signal
    # only while its pidfd says it has not exited.
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    await asyncio.to_thread(process.wait)
    if isinstance(process, ForkedRunner):
        process.close()
    if not clean:  # the runner was still dying: reaped now, so try once more
        clean = await asyncio.to_thread(reap_runner_cgroups, python, runner.root)
    if clean:
        await asyncio.to_thread(remove_runner_root, runner.root)
    else:
        await asyncio.to_thread(detach_runner_mounts, runner.root)


def reap_in_background(process: subprocess.Popen[bytes]) -> None:
    """Wait for the runner in a daemon thread, whoever ends it (this or another process).

    No Popen is kept per sandbox: one left un-waited becomes a zombie and a
    ResourceWarning, and a provider instance may never be the one that destroys it.
    """
    threading.Thread(target=process.wait, name=f"reap-{process.pid}", daemon=True).start()


def _is_zombie_runner(runner: LocalRunner) -> bool:
    try:
        return (
            is_this_runner(runner) and psutil.Process(runner.pid).status() == psutil.STATUS_ZOMBIE
        )
    except psutil.Error:
        return False
