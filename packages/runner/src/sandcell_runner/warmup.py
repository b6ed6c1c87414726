"""The warmup command: spawned once at start-up, detached, outside any job jail.

It never blocks readiness and never holds a session; ``/health`` reports its
state. Its environment is the runner's minus every ``SANDCELL_*`` variable, so
it can warm caches but cannot read the runner's configuration or token.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import Literal

log = logging.getLogger(__name__)

WarmupState = Literal["none", "running", "done", "failed"]


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
        try:
            self._process = await asyncio.create_subprocess_shell(
                command,
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
