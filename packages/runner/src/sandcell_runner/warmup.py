"""The warmup command: spawned once at start-up, detached, outside any job jail.

It never blocks readiness and never holds a session; ``/health`` reports its
state. Its environment is the runner's minus every ``SANDCELL_*`` variable (and
the runner's own environment block holds no token: ``runner_token.py``). Run as
root, it runs through ``setpriv`` without ``CAP_SYS_PTRACE``, ``CAP_SYS_RAWIO``
and ``CAP_SYS_MODULE`` in its bounding and inheritable sets: the runner is
non-dumpable, so without ptrace the warmup cannot read the runner's memory,
``/proc/<runner>/environ`` or its descriptors. It can warm caches, not read the
runner's configuration or token.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
from collections.abc import Callable
from typing import Literal

log = logging.getLogger(__name__)

WarmupState = Literal["none", "running", "done", "failed"]

DROPPED_CAPABILITIES = ("sys_ptrace", "sys_rawio", "sys_module")
"""What a root warmup must not hold: each reads another process's memory or the kernel's."""


def warmup_argv(
    command: str,
    *,
    euid: int | None = None,
    which: Callable[[str], str | None] = shutil.which,
) -> list[str] | None:
    """How to run ``command``; None when it would run as root with ``CAP_SYS_PTRACE``
    (no ``setpriv``), which the caller refuses."""
    shell = ["/bin/sh", "-c", command]
    if (os.geteuid() if euid is None else euid) != 0:
        return shell  # without CAP_SYS_PTRACE already: a non-dumpable runner is out of reach
    setpriv = which("setpriv")
    if setpriv is None:
        return None
    drop = ",".join(f"-{cap}" for cap in DROPPED_CAPABILITIES)
    return [setpriv, f"--bounding-set={drop}", f"--inh-caps={drop}", "--", *shell]


class Warmup:
    """Runs ``SANDCELL_RUNNER_WARMUP_COMMAND`` in the background and tracks it."""

    def __init__(self, command: str | None) -> None:
        self.command = command
        self.state: WarmupState = "none"
        self._task: asyncio.Task[None] | None = None
        self._process: asyncio.subprocess.Process | None = None

    def start(self) -> None:
        if self.command is None or self._task is not None:
            return
        self.state = "running"
        self._task = asyncio.create_task(self._run(self.command), name="sandcell-warmup")

    async def _run(self, command: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SANDCELL_")}
        argv = warmup_argv(command)
        if argv is None:
            self.state = "failed"
            log.warning("warmup command refused: running as root without setpriv to drop ptrace")
            return
        try:
            self._process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
            output, _ = await self._process.communicate()
        except OSError as exc:
            self.state = "failed"
            log.warning("warmup command could not start: %s", exc)
            return
        if self._process.returncode == 0:
            self.state = "done"
            log.info("warmup command finished")
        else:
            self.state = "failed"
            tail = output.decode("utf-8", "replace")[-2000:]
            log.warning("warmup command failed with %s: %s", self._process.returncode, tail)

    async def stop(self) -> None:
        if self._process is not None and self._process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._process.pid, 9)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
