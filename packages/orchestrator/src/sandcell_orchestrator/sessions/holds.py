"""``Holds``: holding a session, and the generation of a hold.

A hold takes the session's lock, then its own generation (``next_generation``),
so no two holders ever share one, even when the second reuses the first's live
sandbox. When the registry has no record of the session (a new session, an
embedded registry of a new process, a wiped Redis), the snapshot store says what
the newest checkpoint is, and the generation moves past it; when the registry forgot
the counter too, also past the wall clock (in milliseconds), so two holds after two
wipes never share a generation even when nothing was uploaded between them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable

from ..errors import CheckpointError, SandboxUnavailableError, SessionBusyError
from ..metrics import Metrics
from ..registry import Lease, SessionRegistry
from ..registry.lease import hold_session
from .persistence import Persistence
from .sandboxes import Hold

__all__ = ["Holds"]

_NO_RECORD_GAP = 1 << 20
"""How far a hold that finds neither a record nor a generation counter (the registry
forgot the session) moves the generation past the newest object."""


class Holds:
    """Takes holds on sessions of ``registry`` whose checkpoints ``persistence`` keeps."""

    def __init__(
        self,
        registry: SessionRegistry,
        persistence: Persistence,
        *,
        lock_ttl_ms: int,
        metrics: Metrics,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.registry = registry
        self.persistence = persistence
        self.lock_ttl_ms = lock_ttl_ms
        self.metrics = metrics
        self._now = wall_clock

    @contextlib.asynccontextmanager
    async def hold(self, session_id: str, *, wait_ms: int = 0) -> AsyncIterator[Hold]:
        """Hold the session (its lock, renewed; ``LockLostError`` out if lost) and a
        generation of its own; ``SessionBusyError`` if another holder has it."""
        entered = False
        try:
            async with hold_session(
                self.registry, session_id, ttl_ms=self.lock_ttl_ms, wait_ms=wait_ms
            ) as lease:
                entered = True
                yield await self._begin(session_id, lease)
        except SessionBusyError:
            if not entered:
                self.metrics.inc("sandcell_lock_contention_total")
            raise

    async def _begin(self, session_id: str, lease: Lease) -> Hold:
        record = await self.registry.get(session_id)
        if record is not None:
            generation = await self.registry.next_generation(session_id)
            return Hold(session_id, lease, generation, record, record.checkpoint_key)
        # No record (a new session, an embedded registry of a new process, a wiped
        # Redis): the store says what the newest checkpoint is, and the generation
        # moves past the newest one's so this hold never writes an older holder's key.
        try:
            stored = await self.persistence.stored(session_id)
        except CheckpointError as exc:
            self.metrics.inc("sandcell_restores_total", outcome="failed")
            raise SandboxUnavailableError(
                f"cannot list the session's checkpoints ({type(exc).__name__}); retry"
            ) from exc
        latest = Persistence.latest(stored)
        floor = latest.generation if latest else 0
        if await self.registry.current_generation(session_id) == 0:
            # The registry forgot the session (a wiped Redis, a new in-process
            # registry): a holder from before may still be mid-turn a few generations
            # past the newest object, and must never share a generation, and so a
            # checkpoint key, with this hold. A kept counter (a new or deleted
            # session, a lost record) already fences: the next one is never reused.
            # The gap alone is not enough: a hold after an earlier wipe that has
            # uploaded nothing yet (a stopped worker) listed this same newest object,
            # so it took this same floor. The wall clock orders the two: every
            # generation taken since such a floor is below the clock now (a session
            # takes far fewer than one hold a millisecond), and the later hold's
            # newer objects stay the newest. Milliseconds keep the numbers exact in
            # Redis's Lua (doubles, printed with 14 digits).
            floor = max(floor + _NO_RECORD_GAP, int(self._now() * 1000))
        generation = await self.registry.next_generation(session_id, above=floor)
        key = latest.key if latest else None
        return Hold(session_id, lease, generation, None, key, stored=stored)
