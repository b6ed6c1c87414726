"""``InProcessRegistry``: the session registry for one process (the embedded default).

It keeps the same semantics as ``RedisRegistry`` (TTL locks with random tokens,
fenced writes, generations, last-seen times) so code and tests written against
one behave the same against the other. Every method runs without awaiting
between its reads and writes, which makes each one atomic on its event loop.
Records are stored in their JSON form, as Redis stores them, so a record that
could not survive Redis cannot survive here either. Not thread-safe: use it
from one event loop.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Sequence

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
from .e2b import KILLED_E2B_TTL_S, E2bSandboxRow, E2bStartKey, validate_e2b_sandbox_id
from .idempotency import IdempotencyEntry, IdempotentAnswer, validate_idempotency_key
from .index import SessionOwner, check_page_limit
from .slots import validate_slot_scope

__all__ = ["InProcessRegistry"]

logger = logging.getLogger(__name__)


class InProcessRegistry:
    """A ``SessionRegistry`` in this process's memory; lock TTLs follow ``clock``."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        # session id -> (token, expires at, by ``clock``)
        self._locks: dict[str, tuple[str, float]] = {}
        self._records: dict[str, bytes] = {}
        self._generations: dict[str, int] = {}
        self._last_seen: dict[str, float] = {}
        # idempotency key -> (token, entry, expires at, by ``clock``)
        self._idempotency: dict[str, tuple[str, IdempotencyEntry, float]] = {}
        self._owners: dict[str, SessionOwner] = {}
        self._e2b: dict[str, E2bSandboxRow] = {}
        self._e2b_killed: dict[str, float] = {}
        self._e2b_kept_merged: dict[str, float] = {}
        """Removed ids, to when (``time.monotonic``) they stop counting as killed, oldest
        first (one TTL for all): the ones that ran out are popped from the front."""
        # slot scope -> token -> expires at, by ``clock``
        self._slots: dict[str, dict[str, float]] = {}
        self._corrupt = _CorruptRecordLog(logger)

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

    async def index_session(self, owner: SessionOwner) -> None:
        """Record whose the session is."""
        await anyio.lowlevel.checkpoint()
        self._owners[owner.session_id] = owner

    async def session_owner(self, session_id: str) -> SessionOwner | None:
        """Whose the session is."""
        validate_session_id(session_id)
        await anyio.lowlevel.checkpoint()
        return self._owners.get(session_id)

    async def sessions_of(
        self, namespace: str, *, after: str | None = None, limit: int | None = None
    ) -> list[SessionOwner]:
        """The namespace's sessions above ``after``, by id: the first ``limit``."""
        check_page_limit(limit)
        await anyio.lowlevel.checkpoint()
        owners = [
            owner
            for session_id, owner in sorted(self._owners.items())
            if owner.namespace == namespace and (after is None or session_id > after)
        ]
        return owners if limit is None else owners[:limit]

    async def unindex_session(self, session_id: str) -> None:
        """Forget whose the session is."""
        validate_session_id(session_id)
        await anyio.lowlevel.checkpoint()
        self._owners.pop(session_id, None)

    def _idempotent(self, key: str) -> tuple[str, IdempotencyEntry, float] | None:
        validate_idempotency_key(key)
        held = self._idempotency.get(key)
        if held is not None and self._clock() >= held[2]:
            del self._idempotency[key]
            return None
        return held

    async def claim_idempotency(
        self, key: str, *, fingerprint: str, token: str, ttl_ms: int
    ) -> IdempotencyEntry | None:
        """Claim ``key`` unless someone has; else the entry found."""
        check_ttl(ttl_ms)
        await anyio.lowlevel.checkpoint()
        held = self._idempotent(key)
        if held is not None:
            return held[1]
        pending = IdempotencyEntry(fingerprint=fingerprint, done=False, status=0, body=b"")
        self._idempotency[key] = (token, pending, self._clock() + ttl_ms / 1000)
        return None

    async def renew_idempotency(self, key: str, *, token: str, ttl_ms: int) -> bool:
        """Extend ``token``'s pending claim."""
        check_ttl(ttl_ms)
        await anyio.lowlevel.checkpoint()
        held = self._idempotent(key)
        if held is None or held[0] != token or held[1].done:
            return False
        self._idempotency[key] = (token, held[1], self._clock() + ttl_ms / 1000)
        return True

    async def finish_idempotency(
        self, key: str, *, token: str, status: int, body: bytes, ttl_ms: int
    ) -> bool:
        """Store the answer of ``token``'s claim."""
        check_ttl(ttl_ms)
        await anyio.lowlevel.checkpoint()
        return self._finish(key, token, status, body, ttl_ms)

    def _finish(self, key: str, token: str, status: int, body: bytes, ttl_ms: int) -> bool:
        held = self._idempotent(key)
        if held is None or held[0] != token:
            return False
        done = IdempotencyEntry(
            fingerprint=held[1].fingerprint, done=True, status=status, body=bytes(body)
        )
        self._idempotency[key] = (token, done, self._clock() + ttl_ms / 1000)
        return True

    async def drop_idempotency(self, key: str, *, token: str) -> bool:
        """Forget ``token``'s pending claim."""
        await anyio.lowlevel.checkpoint()
        held = self._idempotent(key)
        if held is None or held[0] != token or held[1].done:
            return False
        del self._idempotency[key]
        return True

    async def add_e2b_sandbox(self, row: E2bSandboxRow) -> bool:
        """Store a row at its revision; ``False`` if the id is taken."""
        await anyio.lowlevel.checkpoint()
        if row.sandbox_id in self._e2b:
            return False
        self._e2b[row.sandbox_id] = row
        return True

    async def e2b_sandbox(self, sandbox_id: str) -> E2bSandboxRow | None:
        """The row; ``None`` if missing."""
        validate_e2b_sandbox_id(sandbox_id)
        await anyio.lowlevel.checkpoint()
        return self._e2b.get(sandbox_id)

    async def e2b_sandboxes(self) -> list[E2bSandboxRow]:
        """Every row, by start time then id."""
        await anyio.lowlevel.checkpoint()
        return sorted(self._e2b.values(), key=_start_key)

    async def e2b_sandboxes_by_start(
        self,
        namespace: str,
        *,
        after: E2bStartKey | None = None,
        limit: int,
        newest_first: bool = False,
    ) -> list[E2bSandboxRow]:
        """``namespace``'s rows by start time then id (reversed with ``newest_first``),
        the first ``limit`` past ``after`` (a sort of the namespace's rows: in-process)."""
        check_page_limit(limit)
        await anyio.lowlevel.checkpoint()
        rows = sorted(
            (r for r in self._e2b.values() if r.namespace == namespace),
            key=_start_key,
            reverse=newest_first,
        )
        if after is not None:
            rows = [
                r
                for r in rows
                if (_start_key(r) < after if newest_first else _start_key(r) > after)
            ]
        return rows[:limit]

    async def e2b_due(self, now_s: float, *, limit: int) -> list[E2bSandboxRow]:
        """Running rows ended by ``now_s``, soonest first (a pass over the rows: in-process)."""
        check_page_limit(limit)
        await anyio.lowlevel.checkpoint()
        due = (r for r in self._e2b.values() if r.state == "running" and r.end_at_s <= now_s)
        return sorted(due, key=lambda r: (r.end_at_s, r.sandbox_id))[:limit]

    async def e2b_running_of(self, namespace: str) -> list[E2bSandboxRow]:
        """``namespace``'s running rows, by start time then id."""
        await anyio.lowlevel.checkpoint()
        rows = (r for r in self._e2b.values() if r.namespace == namespace and r.state == "running")
        return sorted(rows, key=_start_key)

    async def e2b_running_count(self, namespace: str) -> int:
        """How many of ``namespace``'s rows run (a pass over the rows: in-process)."""
        await anyio.lowlevel.checkpoint()
        rows = self._e2b.values()
        return sum(1 for r in rows if r.namespace == namespace and r.state == "running")

    async def e2b_index(self, rows: Sequence[E2bSandboxRow]) -> None:
        """Nothing to do: the in-process table keeps no index (and no older writer)."""
        await anyio.lowlevel.checkpoint()

    async def e2b_sandboxes_present(self, sandbox_ids: Sequence[str]) -> set[str]:
        """Which of ``sandbox_ids`` have a row."""
        await anyio.lowlevel.checkpoint()
        return {i for i in sandbox_ids if validate_e2b_sandbox_id(i) in self._e2b}

    async def e2b_kept_merged(self, namespace: str) -> bool:
        """Whether ``namespace`` was marked merged within its TTL."""
        await anyio.lowlevel.checkpoint()
        return self._e2b_kept_merged.get(namespace, 0.0) > time.monotonic()

    async def mark_e2b_kept_merged(self, namespace: str, *, ttl_s: float) -> None:
        """Mark ``namespace`` merged for ``ttl_s`` (one entry per tenant that lists)."""
        await anyio.lowlevel.checkpoint()
        self._e2b_kept_merged[namespace] = time.monotonic() + ttl_s

    async def update_e2b_sandbox(self, row: E2bSandboxRow) -> bool:
        """Compare-and-set on ``revision``."""
        await anyio.lowlevel.checkpoint()
        stored = self._e2b.get(row.sandbox_id)
        if stored is None or stored.revision != row.revision - 1:
            return False
        if stored.namespace != row.namespace:
            return False
        self._e2b[row.sandbox_id] = row
        return True

    async def remove_e2b_sandbox(self, sandbox_id: str) -> bool:
        """Delete the row; the id counts as killed for ``KILLED_E2B_TTL_S``."""
        validate_e2b_sandbox_id(sandbox_id)
        await anyio.lowlevel.checkpoint()
        now = time.monotonic()
        killed = self._e2b_killed
        # Not a rebuild of the dict on every kill: that cost each kill a pass over a
        # day's kills, on the event loop.
        while killed and next(iter(killed.values())) <= now:
            del killed[next(iter(killed))]
        killed.pop(sandbox_id, None)  # re-inserted last, in expiry order
        killed[sandbox_id] = now + KILLED_E2B_TTL_S
        return self._e2b.pop(sandbox_id, None) is not None

    async def e2b_sandbox_killed(self, sandbox_id: str) -> bool:
        """Whether the id was removed in the last ``KILLED_E2B_TTL_S``."""
        validate_e2b_sandbox_id(sandbox_id)
        await anyio.lowlevel.checkpoint()
        return self._e2b_killed.get(sandbox_id, 0.0) > time.monotonic()

    def _live_slots(self, scope: str) -> dict[str, float]:
        validate_slot_scope(scope)
        now = self._clock()
        held = {t: at for t, at in self._slots.get(scope, {}).items() if at > now}
        self._slots[scope] = held
        return held

    async def acquire_slot(self, scope: str, *, token: str, limit: int, ttl_ms: int) -> bool:
        """Take a slot if fewer than ``limit`` are held."""
        check_ttl(ttl_ms)
        await anyio.lowlevel.checkpoint()
        held = self._live_slots(scope)
        if len(held) >= limit:
            return False
        held[token] = self._clock() + ttl_ms / 1000
        return True

    async def renew_slot(self, scope: str, *, token: str, ttl_ms: int) -> bool:
        """Extend ``token``'s live slot."""
        check_ttl(ttl_ms)
        await anyio.lowlevel.checkpoint()
        held = self._live_slots(scope)
        if token not in held:
            return False
        held[token] = self._clock() + ttl_ms / 1000
        return True

    async def release_slot(self, scope: str, *, token: str) -> None:
        """Give ``token``'s slot back."""
        await anyio.lowlevel.checkpoint()
        self._live_slots(scope).pop(token, None)

    async def slots_held(self, scope: str) -> int:
        """Live slots of ``scope``."""
        await anyio.lowlevel.checkpoint()
        return len(self._live_slots(scope))

    async def close(self) -> None:
        """Nothing to release; present for the protocol."""
        await anyio.lowlevel.checkpoint()


def _start_key(row: E2bSandboxRow) -> E2bStartKey:
    return (row.started_at_s, row.sandbox_id)
