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
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import anyio

__all__ = ["to_the_end"]

T = TypeVar("T")

log = logging.getLogger(__name__)


async def to_the_end(
    work: Coroutine[Any, Any, T],
    *,
    keep: set[asyncio.Task[Any]] | None = None,
    undo: Callable[[T], Awaitable[object]] | None = None,
) -> T:
    """``await work``, run to its end even while the caller is being cancelled.

    ``keep``: a set holding the task while it runs (the loop holds tasks only weakly),
    for an owner that waits for cleanups in flight at its close. ``undo``: once the
    caller was cancelled meanwhile, awaited (also to its end) with what ``work``
    returned, which the caller never gets: what removes it (a file a thread made).
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
        if not task.cancelled() and task.exception() is None and undo is not None:
            try:
                await to_the_end(_undo(undo, task.result()))
            except Exception as exc:
                log.warning("undoing what a cancelled call made failed: %s", exc)
        raise asyncio.CancelledError
    return task.result()


async def _undo(undo: Callable[[T], Awaitable[object]], made: T) -> None:
    await undo(made)
