"""``InProcessRegistry``: the session registry for one process (the embedded default).

It keeps the same semantics as ``RedisRegistry`` (TTL locks with random tokens,
fenced writes, generations, last-seen times) so code and tests written against
one behave the same against the other. Every method runs without awaiting
between its reads and writes, which makes each one atomic on its event loop.
Records are stored in their JSON form, as Redis stores them, so a record that
could not survive Redis cannot survive here either. Not thread-safe: use it
from one event loop.

This module is its core (locks, generations, records, last-seen); each other
concept is a base class in a module of its own beside it: ``memory_index``,
``memory_idempotency``, ``memory_e2b``, ``memory_slots``.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable

import anyio

from ..errors import LockLostError
from .core import (
    FencedError,
    Lease,
    SessionRecord,
    _CorruptRecordLog,
    check_floor,
    check_ttl,
    validate_session_id,
)
from .idempotency import IdempotentAnswer
from .memory_e2b import InProcessE2bTable
from .memory_idempotency import InProcessIdempotency
from .memory_index import InProcessSessionIndex
from .memory_slots import InProcessSlots

__all__ = ["InProcessRegistry"]

logger = logging.getLogger(__name__)


class InProcessRegistry(
    InProcessSessionIndex, InProcessIdempotency, InProcessE2bTable, InProcessSlots
):
    """A ``SessionRegistry`` in this process's memory; lock TTLs follow ``clock``."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        # session id -> (token, expires at, by ``clock``)
        self._locks: dict[str, tuple[str, float]] = {}
        self._records: dict[str, bytes] = {}
        self._generations: dict[str, int] = {}
        self._last_seen: dict[str, float] = {}
        self._corrupt = _CorruptRecordLog(logger)
        InProcessSessionIndex.__init__(self)
        InProcessIdempotency.__init__(self)
        InProcessE2bTable.__init__(self)
        InProcessSlots.__init__(self)

    def __repr__(self) -> str:
        return f"InProcessRegistry(sessions={len(self._records)})"

    def _holder(self, session_id: str) -> str | None:
        held = self._locks.get(session_id)
        if held is None:
            return None
        token, expires_at = held
        if self._clock() >= expires_at:
            del self._locks[session_id]
            return None
        return token

    def _check_writer(self, lease: Lease, session_id: str, generation: int) -> None:
        if lease.session_id != session_id:
            raise ValueError("the lease is for another session")
        if self._holder(session_id) != lease.token:
            raise LockLostError(f"lock on {session_id} is no longer held by this lease")
        current = self._generations.get(session_id, 0)
        if generation < current:
            raise FencedError(
                f"generation {generation} of {session_id} is older than the current {current}",
                generation=generation,
                current_generation=current,
            )

    async def acquire_lock(self, session_id: str, *, ttl_ms: int) -> Lease | None:
        """Take the lock for ``ttl_ms`` unless someone holds it (``None``)."""
        validate_session_id(session_id)
        check_ttl(ttl_ms)
        await anyio.lowlevel.checkpoint()
        if self._holder(session_id) is not None:
            return None
        token = secrets.token_hex(16)
        self._locks[session_id] = (token, self._clock() + ttl_ms / 1000)
        return Lease(session_id=session_id, token=token, ttl_ms=ttl_ms)

    async def renew(self, lease: Lease, *, ttl_ms: int) -> bool:
        """Reset the TTL if the lock is still ``lease``'s."""
        check_ttl(ttl_ms)
        await anyio.lowlevel.checkpoint()
        if self._holder(lease.session_id) != lease.token:
            return False
        self._locks[lease.session_id] = (lease.token, self._clock() + ttl_ms / 1000)
        return True

    async def release(self, lease: Lease) -> bool:
        """Drop the lock if it is still ``lease``'s."""
        await anyio.lowlevel.checkpoint()
        if self._holder(lease.session_id) != lease.token:
            return False
        del self._locks[lease.session_id]
        return True

    async def next_generation(self, session_id: str, *, above: int = 0) -> int:
        """Increment and return the generation (greater than ``above``)."""
        validate_session_id(session_id)
        check_floor(above)
        await anyio.lowlevel.checkpoint()
        generation = max(self._generations.get(session_id, 0), above) + 1
        self._generations[session_id] = generation
        return generation

    async def current_generation(self, session_id: str) -> int:
        """The generation; 0 if never incremented."""
        validate_session_id(session_id)
        await anyio.lowlevel.checkpoint()
        return self._generations.get(session_id, 0)

    async def get(self, session_id: str) -> SessionRecord | None:
        """The record; ``None`` if missing or corrupt."""
        validate_session_id(session_id)
        await anyio.lowlevel.checkpoint()
        raw = self._records.get(session_id)
        return None if raw is None else self._corrupt.decode(session_id, raw)

    async def put(
        self, lease: Lease, record: SessionRecord, *, answer: IdempotentAnswer | None = None
    ) -> None:
        """Store ``record``, fenced by ``lease`` and ``record.generation``; with ``answer``
        stored in the same step (no await between them)."""
        raw = record.to_json()
        await anyio.lowlevel.checkpoint()
        self._check_writer(lease, record.session_id, record.generation)
        self._records[record.session_id] = raw
        if answer is not None:
            self._finish(answer.key, answer.token, answer.status, answer.body, answer.ttl_ms)
        self._corrupt.repaired(record.session_id)

    async def delete(self, lease: Lease, session_id: str, *, generation: int) -> None:
        """Remove the record and last-seen entry, fenced like ``put``."""
        validate_session_id(session_id)
        await anyio.lowlevel.checkpoint()
        self._check_writer(lease, session_id, generation)
        self._records.pop(session_id, None)
        self._last_seen.pop(session_id, None)
        self._corrupt.repaired(session_id)

    async def touch(self, session_id: str, *, at_s: float) -> None:
        """Move the last-seen time forward to ``at_s``."""
        validate_session_id(session_id)
        await anyio.lowlevel.checkpoint()
        previous = self._last_seen.get(session_id)
        if previous is None or at_s > previous:
            self._last_seen[session_id] = at_s

    async def idle_sessions(self, *, older_than_s: float, now_s: float) -> list[str]:
        """Sessions last seen at or before ``now_s - older_than_s``, oldest first."""
        await anyio.lowlevel.checkpoint()
        cutoff = now_s - older_than_s
        idle = [(at_s, sid) for sid, at_s in self._last_seen.items() if at_s <= cutoff]
        return [sid for _, sid in sorted(idle)]

    async def list_records(self) -> list[SessionRecord]:
        """Every readable record, by session id."""
        await anyio.lowlevel.checkpoint()
        records = (self._corrupt.decode(sid, raw) for sid, raw in sorted(self._records.items()))
        return [record for record in records if record is not None]

    async def close(self) -> None:
        """Nothing to release; present for the protocol."""
        await anyio.lowlevel.checkpoint()
