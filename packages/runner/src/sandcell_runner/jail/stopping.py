"""Ending a job: wait out its grace, then kill it — one rule for every kind of job.

A caller asks the job to stop its own way first (SIGTERM to a process, SIGINT to a
cell), then calls ``end_within``: the job has ``grace_s`` to end; past it, ``kill``
runs (SIGKILL to the whole jail) and the end is awaited a bounded while more.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

__all__ = ["KILLED_WAIT_S", "end_within"]

KILLED_WAIT_S = 10.0
"""How long a killed job may take to be reaped before the caller gives up waiting."""


async def end_within(
    done: asyncio.Event,
    *,
    grace_s: float,
    kill: Callable[[], None],
    killed_wait_s: float = KILLED_WAIT_S,
) -> bool:
    """Wait up to ``grace_s`` for ``done``; past it call ``kill`` and wait up to
    ``killed_wait_s`` more. True when the job ended within its grace."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(grace_s):
            await done.wait()
        return True
    kill()
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(killed_wait_s):
            await done.wait()
    return False
