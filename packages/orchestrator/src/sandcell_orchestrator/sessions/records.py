"""``SessionRecords``: the one writer (and deleter) of a held session's registry row.

Every row the manager writes is built here: the held row (or a new one) with the
changes, stamped with the hold's generation and written fenced by its lease, so a
holder that lost the session writes nothing. A turn's committing write carries the
turn's idempotent answer with it (``answer``), in the same atomic step.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import Any

import msgspec

from ..registry import IdempotentAnswer, SessionRecord, SessionRegistry
from .sandboxes import Hold

__all__ = ["SessionRecords"]

log = logging.getLogger(__name__)


class SessionRecords:
    """Writes held sessions' rows in ``registry`` for the provider ``provider_name``."""

    def __init__(
        self, registry: SessionRegistry, *, provider_name: str, wall_clock: Callable[[], float]
    ) -> None:
        self.registry = registry
        self.provider_name = provider_name
        self._now = wall_clock

    async def write(
        self, hold: Hold, *, answer: IdempotentAnswer | None = None, **changes: Any
    ) -> SessionRecord:
        """The one ``SessionRecord`` builder: the held row with ``changes``, stamped with
        this hold's generation, written fenced by its lease (with ``answer``, if any)."""
        now = self._now()
        if hold.record is not None:
            fields = msgspec.structs.asdict(hold.record)
        else:
            fields = {
                "session_id": hold.session_id,
                "provider": self.provider_name,
                "sandbox_uuid": str(uuid.uuid4()),
                "endpoint": None,
                "checkpoint_key": None,
                "state": "active",
                "created_at_s": now,
                # No record: a checkpoint the hold has came from the store's listing.
                "adopted": hold.checkpoint_key is not None,
            }
        record = SessionRecord(
            **{**fields, **changes, "generation": hold.generation, "updated_at_s": now}
        )
        await self.registry.put(hold.lease, record, answer=answer)
        hold.record = record
        return record

    async def delete(self, hold: Hold) -> None:
        """Delete the held row, fenced by the hold's lease and generation."""
        await self.registry.delete(hold.lease, hold.session_id, generation=hold.generation)

    async def mark_suspended(self, hold: Hold) -> None:
        """Mark the held row suspended, if there is one; a lost lease is only logged."""
        if hold.record is None:
            return
        try:
            await self.write(hold, state="suspended")
        except Exception as exc:  # the lease may be gone: the next holder sees a lost sandbox
            log.info("session %s: could not mark it suspended (%s)", hold.session_id[:11], exc)
