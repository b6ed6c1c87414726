"""``TurnCommits``: the fenced record writes that commit a held turn.

``checkpoint`` saves the workspace under the hold's own generation (a second
checkpoint in one hold first takes a new one), then the fenced record write
points at it: a holder that was superseded gets ``LockLostError``/``FencedError``
and its object is never referenced. ``open_turn`` marks a turn running in the
held sandbox, ``close_turn`` ends it with nothing uncommitted (or, ``unsaved``,
with acknowledged work no checkpoint has). The write that commits a turn also
stores its idempotent answer (``answer``), in the same atomic step; a keyed
turn's result goes with its checkpoint object, and once committed under its key
alone (``save_answer``), so a retry after the registry forgot the turn finds it
applied (``saved_answer``, ``commit_answer``), whichever checkpoint it restored.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from sandcell_protocol import checkpoint_key

from ..config import Budgets
from ..errors import CheckpointError
from ..metrics import Metrics
from ..registry import IdempotentAnswer, SessionRegistry
from ..snapshots import SnapshotInfo
from .persistence import Persistence, PersistentWorkspace, TurnResult
from .records import SessionRecords
from .sandboxes import Attached, Hold

__all__ = ["TurnCommits"]

log = logging.getLogger(__name__)


class TurnCommits:
    """Commits held turns through ``records``, their checkpoints through ``persistence``."""

    def __init__(
        self,
        registry: SessionRegistry,
        records: SessionRecords,
        persistence: Persistence,
        *,
        budgets: Budgets,
        metrics: Metrics,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.registry = registry
        self.records = records
        self.persistence = persistence
        self.budgets = budgets
        self.metrics = metrics
        self._now = wall_clock

    async def checkpoint(
        self,
        hold: Hold,
        attached: Attached,
        *,
        workspace: PersistentWorkspace | None = None,
        answer: IdempotentAnswer | None = None,
        turn_result: TurnResult | None = None,
    ) -> SnapshotInfo:
        """Save the sandbox's workspace (it keeps running) and point the record at it.

        The object goes under this hold's own generation (a second checkpoint in
        one hold first takes a new one), then the fenced record write commits it:
        ``LockLostError``/``FencedError`` if this holder was superseded, in which
        case its object is never referenced. ``answer`` (the turn's idempotent
        answer) is stored by that same write; ``turn_result`` (a keyed turn's) is
        saved next to the object, before it, so the store itself says which turn
        the object applied (``Persistence.save_turn_result``).
        """
        if hold.checkpointed:
            hold.generation = await self.registry.next_generation(hold.session_id)
        hold.checkpointed = True
        try:
            with self.metrics.timer("sandcell_checkpoint_duration_seconds"):
                async with asyncio.timeout(self.budgets.checkpoint_s):
                    if turn_result is not None:
                        await self.persistence.save_turn_result(
                            checkpoint_key(hold.session_id, hold.generation),
                            turn_key=turn_result.turn_key,
                            body=turn_result.body,
                        )
                    info = await self.persistence.save(
                        attached.handle,
                        session_id=hold.session_id,
                        generation=hold.generation,
                        workspace=workspace,
                    )
                await self.records.write(
                    hold,
                    answer=answer,
                    checkpoint_key=info.key,
                    unsaved=False,
                    turn_open=False,
                    adopted=False,
                )
        except Exception:
            self.metrics.inc("sandcell_checkpoints_total", outcome="failed")
            raise
        hold.checkpoint_key = info.key
        self.metrics.inc("sandcell_checkpoints_total", outcome="ok")
        self.metrics.inc("sandcell_checkpoint_bytes_total", info.size)
        if hold.stored is not None:
            # Listed at hold time: what this commit superseded goes (after the grace).
            await self.persistence.collect(
                hold.session_id, hold.stored, keep=info.key, below_generation=hold.generation
            )
        return info

    async def open_turn(self, hold: Hold) -> None:
        """Record that a turn's job is about to run in the held sandbox (``turn_open``):
        until the turn closes, no later holder reuses that sandbox."""
        if hold.record is not None and not hold.record.turn_open:
            await self.records.write(hold, turn_open=True)

    async def close_turn(
        self, hold: Hold, *, unsaved: bool = False, answer: IdempotentAnswer | None = None
    ) -> None:
        """Record that the held turn ended with nothing uncommitted in its sandbox, or
        (``unsaved``) with acknowledged work no checkpoint has, which whichever worker
        takes the next turn saves (the record is the one place every worker reads).
        ``answer`` (the turn's idempotent answer) is stored by that same write."""
        record = hold.record
        if record is not None and (record.turn_open or record.unsaved != unsaved):
            await self.records.write(
                hold, answer=answer, turn_open=False, unsaved=unsaved or record.unsaved
            )

    def may_have_forgotten(self, hold: Hold) -> bool:
        """Whether the registry may have lost a keyed turn's answer for this session:
        it had no record (a wiped Redis); or one pointing at a checkpoint taken from
        the store's listing (``adopted``: made by a hold that found none, however long
        ago: a client may retry a turn from before the wipe after a retry that failed
        made it); or one made within the collection window (made again since, by
        another turn or a holder the wipe interrupted). Any other record has kept
        every answer written while it lived."""
        record = hold.record
        return (
            record is None
            or record.adopted
            or self._now() - record.created_at_s < self.persistence.grace_s
        )

    async def saved_answer(self, hold: Hold, turn_key: str) -> bytes | None:
        """The result of the keyed turn ``turn_key`` if the store says it is applied in
        the held session: the checkpoint the hold works on (restored, or the record's)
        is the one it wrote (its ``.turn-`` result), or the turn committed and saved
        its answer by key (``save_answer``). None: run the turn. Called when the
        registry may have forgotten (``may_have_forgotten``, judged when the hold
        began) or the hold restored a checkpoint: a warm turn costs no store read.

        The record's checkpoint is looked at too, not only a restore from the store's
        listing: a retry that found no record may have recorded the sandbox it
        restored and then failed (a store blink as it read the result), and the next
        retry finds that young record, pointing at the turn's own checkpoint."""
        if hold.checkpoint_key is not None:
            body = await self.persistence.result_with(hold.checkpoint_key, turn_key)
            if body is not None:
                return body
        return await self.persistence.answer(hold.session_id, turn_key)

    async def save_answer(self, session_id: str, turn_key: str, body: bytes) -> None:
        """Store a committed keyed turn's result by its key (best effort: the registry
        holds its answer too; only a wipe of the registry would need this copy). No
        hold needed: the turn is committed, and every write of it has these bytes."""
        try:
            async with asyncio.timeout(self.budgets.checkpoint_s):
                await self.persistence.save_answer(session_id, turn_key=turn_key, body=body)
        except (CheckpointError, TimeoutError) as exc:
            self.metrics.inc("sandcell_turn_answers_unsaved_total")
            log.warning(
                "session %s: a keyed turn's answer not saved in the store (%s)",
                session_id[:11],
                type(exc).__name__,
            )

    async def commit_answer(self, hold: Hold, answer: IdempotentAnswer | None) -> None:
        """Store a keyed turn's ``answer`` with a fenced write of the held record, as
        it stands (its pointer commits the checkpoint the turn was found applied in);
        None: the turn's result has no answer to keep, the write commits the pointer."""
        await self.records.write(hold, answer=answer, turn_open=False)
