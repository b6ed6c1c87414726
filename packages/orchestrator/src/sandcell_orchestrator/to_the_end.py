"""Cleanup awaited to its end however often its caller is cancelled.

``anyio.CancelScope(shield=True)`` keeps out anyio's own cancellations (a lost
lease, a cancelled turn) but not a native ``task.cancel()``, nor ``asyncio.timeout``:
a caller cancelled a second time while it cleaned up (a stream's generator and the
task it awaits are both cancelled by a gone client) stopped the cleanup half-way,
and what it was removing (a runner, its root, its cgroups) stayed with no one left
to remove it. Here the cleanup runs as its own task, waited for through any number
of cancellations, which are passed on once it has ended.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import anyio

__all__ = ["to_the_end"]

T = TypeVar("T")


async def to_the_end(
    work: Coroutine[Any, Any, T], *, keep: set[asyncio.Task[Any]] | None = None
) -> T:
    """``await work``, run to its end even while the caller is being cancelled.

    ``keep``: a set holding the task while it runs (the loop holds tasks only weakly),
    for an owner that waits for cleanups in flight at its close.
    """
    task = asyncio.ensure_future(work)
    if keep is not None:
        keep.add(task)
        task.add_done_callback(keep.discard)
    cancelled = False
    # The anyio shield stops an anyio scope from re-sending its cancellation on every
    # loop iteration; the loop outlasts the native ones that pass it.
    with anyio.CancelScope(shield=True):
        while not task.done():
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                if task.cancelled():
                    raise
                cancelled = True
    if cancelled:
        if not task.cancelled():
            task.exception()  # retrieved: the cancellation is what the caller sees
        raise asyncio.CancelledError
    return task.result()
