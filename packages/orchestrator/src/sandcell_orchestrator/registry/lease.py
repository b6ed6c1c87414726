"""Holding a session: acquire its lock, keep it renewed, abort the work if it is lost.

    async with hold_session(registry, session_id, ttl_ms=lock_ttl) as lease:
        ...  # the critical path: launch, execute, checkpoint, registry writes

A background task renews the lock every ``renew_every_ms`` (a third of the TTL
by default). The body is cancelled, and the ``async with`` raises
``LockLostError``, as soon as the lease can no longer be proven ours:

* a renewal answers ``False``: the token is gone (expired and taken, or deleted);
* renewals keep failing (``RegistryError``) or hang until the last proven
  renewal is a full TTL old: the lock may have expired, so we stop before
  another worker could start.

"Proven" is measured from the moment a successful request was *sent*, so the
local deadline never outlives the server's expiry.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import anyio

from ..errors import LockLostError, RegistryError, SessionBusyError

if TYPE_CHECKING:
    from . import Lease, SessionRegistry

__all__ = ["hold_session"]

logger = logging.getLogger(__name__)

_ACQUIRE_POLL_S = 0.05
# Release is best effort: an unreleased lock expires on its own, so a hung
# registry must not hold up the caller for longer than this.
_RELEASE_TIMEOUT_S = 5.0


@asynccontextmanager
async def hold_session(
    registry: SessionRegistry,
    session_id: str,
    *,
    ttl_ms: int,
    renew_every_ms: int | None = None,
    wait_ms: int = 0,
    clock: Callable[[], float] = time.monotonic,
) -> AsyncIterator[Lease]:
    """Hold ``session_id``'s lock for the duration of the block.

    Raises ``SessionBusyError`` if another worker still holds it after
    ``wait_ms`` (0: do not wait), and ``LockLostError`` out of the block if the
    lease is lost while the block runs (the block is cancelled first). The lock
    is released on a normal or failed exit. ``clock`` measures the lease's age;
    waiting uses the event loop's clock.
    """
    if ttl_ms <= 0:
        raise ValueError("ttl_ms: must be > 0")
    every_ms = ttl_ms // 3 if renew_every_ms is None else renew_every_ms
    if not 0 < every_ms < ttl_ms:
        raise ValueError("renew_every_ms: must be > 0 and < ttl_ms")
    if wait_ms < 0:
        raise ValueError("wait_ms: must be >= 0")

    lease, proven_at = await _acquire(
        registry, session_id, ttl_ms=ttl_ms, wait_ms=wait_ms, clock=clock
    )
    keeper = _Keeper(
        registry, lease, ttl_ms=ttl_ms, every_ms=every_ms, clock=clock, proven_at=proven_at
    )
    body_error: Exception | None = None
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(keeper.run, tg.cancel_scope)
            try:
                yield lease
            except Exception as exc:
                # Re-raised below: raised through the task group it would come
                # out wrapped in an ExceptionGroup.
                body_error = exc
            finally:
                tg.cancel_scope.cancel()
    finally:
        if keeper.lost_reason is None:
            await _release(registry, lease)
    if keeper.lost_reason is not None:
        if isinstance(body_error, LockLostError):
            raise body_error
        raise LockLostError(keeper.lost_reason) from body_error
    if body_error is not None:
        raise body_error


async def _acquire(
    registry: SessionRegistry,
    session_id: str,
    *,
    ttl_ms: int,
    wait_ms: int,
    clock: Callable[[], float],
) -> tuple[Lease, float]:
    deadline = clock() + wait_ms / 1000
    while True:
        sent_at = clock()
        lease = await registry.acquire_lock(session_id, ttl_ms=ttl_ms)
        if lease is not None:
            return lease, sent_at
        remaining_s = deadline - clock()
        if remaining_s <= 0:
            raise SessionBusyError(f"session {session_id} is held by another worker")
        await anyio.sleep(min(_ACQUIRE_POLL_S, remaining_s))


async def _release(registry: SessionRegistry, lease: Lease) -> None:
    # Shielded: a caller cancelled mid-turn should still free the session now
    # rather than a TTL from now.
    with anyio.move_on_after(_RELEASE_TIMEOUT_S, shield=True) as scope:
        try:
            released = await registry.release(lease)
        except RegistryError as exc:
            logger.warning(
                "could not release the lock on %s (%s); it will expire",
                lease.session_id,
                type(exc).__name__,
            )
            return
        if not released:
            logger.warning("the lock on %s was already gone at release", lease.session_id)
    if scope.cancelled_caught:
        logger.warning("releasing the lock on %s timed out; it will expire", lease.session_id)


class _Keeper:
    """Renews one lease until cancelled; on loss, records why and cancels the body."""

    def __init__(
        self,
        registry: SessionRegistry,
        lease: Lease,
        *,
        ttl_ms: int,
        every_ms: int,
        clock: Callable[[], float],
        proven_at: float,
    ) -> None:
        self._registry = registry
        self._lease = lease
        self._ttl_ms = ttl_ms
        self._every_s = every_ms / 1000
        # After a failure, retry sooner than the regular cadence so a short
        # blip costs one retry rather than a third of the remaining TTL.
        self._retry_s = min(self._every_s, max(0.01, ttl_ms / 10_000))
        self._clock = clock
        self._proven_at = proven_at
        self.lost_reason: str | None = None

    async def run(self, scope: anyio.CancelScope) -> None:
        try:
            self.lost_reason = await self._renew_until_lost()
        except Exception:
            # A registry bug must fence the work, not crash the task group.
            logger.exception("renewing the lease on %s failed", self._lease.session_id)
            self.lost_reason = f"lease on {self._lease.session_id} could not be renewed"
        scope.cancel()

    async def _renew_until_lost(self) -> str:
        session_id = self._lease.session_id
        ttl_s = self._ttl_ms / 1000
        delay_s = self._every_s
        while True:
            deadline = self._proven_at + ttl_s
            await anyio.sleep(max(0.0, min(delay_s, deadline - self._clock())))
            sent_at = self._clock()
            if sent_at >= deadline:
                return (
                    f"lease on {session_id} could not be renewed within its {self._ttl_ms} ms TTL"
                )
            renewed: bool | None = None
            # A renewal that hangs past the deadline proves nothing either.
            with anyio.move_on_after(deadline - sent_at):
                try:
                    renewed = await self._registry.renew(self._lease, ttl_ms=self._ttl_ms)
                except RegistryError as exc:
                    logger.warning(
                        "renewing the lease on %s failed (%s); retrying",
                        session_id,
                        type(exc).__name__,
                    )
            if renewed is None:
                delay_s = self._retry_s
                continue
            if not renewed:
                return f"lease on {session_id} was taken over"
            self._proven_at = sent_at
            delay_s = self._every_s
