"""Cancellation that waits for what it cannot stop, or for what it stopped.

``await asyncio.to_thread(f)`` returns at once when its caller is cancelled, but the
thread cannot be stopped: it goes on making the directory, the cgroup or the network
namespace after the caller's ``finally`` ran. What the caller then releases (a UID,
the session lock) is released under it, and what the thread makes is left with no
one to remove it. ``to_thread_to_the_end`` waits for the thread through any number
of cancellations (native ``task.cancel()`` passes anyio's shields, so both are used),
undoes what it made, then passes the cancellation on.

``cancel_and_wait`` cancels a run once and waits for its cleanup. Awaiting the task
itself, as a stream's ``finally`` did, passed a second cancellation of the awaiting
generator (Starlette re-sends it while the generator is unshielded) on to the run,
cutting its cleanup short, and the stream ended before it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import anyio

__all__ = ["cancel_and_wait", "to_thread_to_the_end"]

log = logging.getLogger(__name__)

T = TypeVar("T")


async def to_thread_to_the_end(
    func: Callable[[], T], *, undo: Callable[[T], object] | None = None
) -> T:
    """``func()`` in a thread, its result; a cancelled caller still waits for its end.

    Once the caller was cancelled meanwhile, ``undo(result)`` runs (in a thread, also
    to its end; its failure logged) and ``CancelledError`` is raised: the result never
    reaches the caller, so ``undo`` is what removes it. A ``func`` that failed has
    nothing to undo. Without ``undo`` the caller's own bookkeeping (a list ``func``
    appends to) must say what to remove.
    """
    done, cancelled = await _to_the_end(func)
    if not cancelled:
        return done.result()
    if undo is not None and not done.cancelled() and done.exception() is None:
        undone, _ = await _to_the_end(lambda: undo(done.result()))
        if not undone.cancelled() and undone.exception() is not None:
            log.warning("undoing a cancelled call failed: %s", undone.exception())
    elif not done.cancelled():
        done.exception()  # retrieved: the cancellation is what the caller sees
    raise asyncio.CancelledError


async def _to_the_end(func: Callable[[], T]) -> tuple[asyncio.Future[T], bool]:
    """The finished call and whether the caller was cancelled while it ran."""
    # As ``asyncio.to_thread``, but the future is shielded rather than awaited: the
    # uncancelled path costs what ``to_thread`` does (no task, no anyio scope).
    context = contextvars.copy_context()
    call = asyncio.get_running_loop().run_in_executor(None, context.run, func)
    try:
        await asyncio.shield(call)
    except asyncio.CancelledError:
        pass
    else:
        return call, False
    # The anyio shield keeps a cancelled anyio scope from re-sending its cancellation on
    # every loop iteration; the loop outlasts the native ones it lets through.
    with anyio.CancelScope(shield=True):
        while not call.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({call})
    with contextlib.suppress(asyncio.CancelledError):
        call.exception()  # retrieved here; ``result()`` raises it again for the caller
    return call, True


async def cancel_and_wait(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` (once) if it still runs and wait for its end, however often the
    caller is cancelled meanwhile (that cancellation is raised after). Its outcome is
    retrieved, not raised: whoever needed it has read it."""
    if not task.done():
        task.cancel()
    cancelled = False
    with anyio.CancelScope(shield=True):
        while not task.done():
            try:
                await asyncio.wait({task})  # never cancels ``task``, unlike ``await task``
            except asyncio.CancelledError:
                cancelled = True
    if not task.cancelled():
        task.exception()
    if cancelled:
        raise asyncio.CancelledError
