"""``SqliteRegistry``: the session registry in one SQLite file (the embedded default).

Every ``sandcell exec`` is its own process, so an in-process registry cannot
keep two of them out of one session. This one keeps the same semantics as
``RedisRegistry`` (TTL locks on random tokens, compare-and-delete release,
generations, fenced writes) in ``$SANDCELL_HOME/registry.sqlite3``, which every
process on the machine opens. This module holds the core tables; the others
live with their feature (``sqlite_index``, ``sqlite_idempotency``,
``sqlite_e2b``, ``sqlite_slots``), on the plumbing of ``sqlite_db`` (transactions, threads,
monotonic expiry):

    locks(session_id, token, expires_at, boot_id)   one row per held lock
    generations(session_id, generation)             never deleted (fencing)
    records(session_id, raw)                         the SessionRecord JSON
    last_seen(session_id, at_s)                      wall-clock seconds
"""

from __future__ import annotations

import logging
import secrets
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

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
from .sqlite_db import SqliteDatabase
from .sqlite_e2b import SqliteE2bTable
from .sqlite_idempotency import SqliteIdempotency
from .sqlite_index import SqliteSessionIndex
from .sqlite_slots import SqliteSlots

__all__ = ["SqliteRegistry"]

logger = logging.getLogger(__name__)


class SqliteRegistry(
    SqliteSessionIndex, SqliteIdempotency, SqliteE2bTable, SqliteSlots, SqliteDatabase
):
    """A ``SessionRegistry`` in a SQLite file shared by every process on this machine."""

    SCHEMA: ClassVar[str] = """
CREATE TABLE IF NOT EXISTS locks (
    session_id TEXT PRIMARY KEY,
    token TEXT NOT NULL,
    expires_at REAL NOT NULL,
    boot_id TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS generations (
    session_id TEXT PRIMARY KEY,
    generation INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS records (
    session_id TEXT PRIMARY KEY,
    raw BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS last_seen (
    session_id TEXT PRIMARY KEY,
    at_s REAL NOT NULL
);
"""

    def __init__(
        self,
        path: Path,
        *,
        busy_timeout_ms: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
        boot_id: str | None = None,
    ) -> None:
        super().__init__(path, busy_timeout_ms=busy_timeout_ms, clock=clock, boot_id=boot_id)
        self._corrupt = _CorruptRecordLog(logger)

    def __repr__(self) -> str:
        return f"SqliteRegistry({str(self.path)!r})"

    def _holder(self, connection: sqlite3.Connection, session_id: str) -> str | None:
        row = connection.execute(
            "SELECT token, expires_at, boot_id FROM locks WHERE session_id = ?", (session_id,)
        ).fetchone()
        if row is None:
            return None
        token, expires_at, row_boot = row
        if not self._live(expires_at, row_boot):
            return None
        return str(token)

    def _check_writer(
        self, connection: sqlite3.Connection, lease: Lease, session_id: str, generation: int
    ) -> None:
        if lease.session_id != session_id:
            raise ValueError("the lease is for another session")
        if self._holder(connection, session_id) != lease.token:
            raise LockLostError(f"lock on {session_id} is no longer held by this lease")
        current = _generation(connection, session_id)
        if generation < current:
            raise FencedError(
                f"generation {generation} of {session_id} is older than the current {current}",
                generation=generation,
                current_generation=current,
            )

    # -- locks --------------------------------------------------------------------

    async def acquire_lock(self, session_id: str, *, ttl_ms: int) -> Lease | None:
        """Take the lock for ``ttl_ms`` unless someone holds it (``None``)."""
        validate_session_id(session_id)
        check_ttl(ttl_ms)

        def work() -> Lease | None:
            with self._transaction(write=True) as db:
                if self._holder(db, session_id) is not None:
                    return None
                token = secrets.token_hex(16)
                db.execute(
                    "INSERT OR REPLACE INTO locks VALUES (?, ?, ?, ?)",
                    (session_id, token, self._expiry(ttl_ms), self._boot_id),
                )
                return Lease(session_id=session_id, token=token, ttl_ms=ttl_ms)

        return await self._run("acquire_lock", work)

    async def renew(self, lease: Lease, *, ttl_ms: int) -> bool:
        """Reset the TTL if the lock is still ``lease``'s."""
        check_ttl(ttl_ms)

        def work() -> bool:
            with self._transaction(write=True) as db:
                if self._holder(db, lease.session_id) != lease.token:
                    return False
                db.execute(
                    "UPDATE locks SET expires_at = ? WHERE session_id = ?",
                    (self._expiry(ttl_ms), lease.session_id),
                )
                return True

        return await self._run("renew", work)

    async def release(self, lease: Lease) -> bool:
        """Drop the lock if it is still ``lease``'s."""

        def work() -> bool:
            with self._transaction(write=True) as db:
                if self._holder(db, lease.session_id) != lease.token:
                    return False
                db.execute("DELETE FROM locks WHERE session_id = ?", (lease.session_id,))
                return True

        return await self._run("release", work)

    # -- generations --------------------------------------------------------------

    async def next_generation(self, session_id: str, *, above: int = 0) -> int:
        """Increment and return the generation (greater than ``above``)."""
        validate_session_id(session_id)
        check_floor(above)

        def work() -> int:
            with self._transaction(write=True) as db:
                generation = max(_generation(db, session_id), above) + 1
                db.execute(
                    "INSERT OR REPLACE INTO generations VALUES (?, ?)", (session_id, generation)
                )
                return generation

        return await self._run("next_generation", work)

    async def current_generation(self, session_id: str) -> int:
        """The generation; 0 if never incremented."""
        validate_session_id(session_id)

        def work() -> int:
            with self._transaction(write=False) as db:
                return _generation(db, session_id)

        return await self._run("current_generation", work)

    # -- records ------------------------------------------------------------------

    async def get(self, session_id: str) -> SessionRecord | None:
        """The record; ``None`` if missing or corrupt."""
        validate_session_id(session_id)

        def work() -> bytes | None:
            with self._transaction(write=False) as db:
                row = db.execute(
                    "SELECT raw FROM records WHERE session_id = ?", (session_id,)
                ).fetchone()
                return None if row is None else bytes(row[0])

        raw = await self._run("get", work)
        return None if raw is None else self._corrupt.decode(session_id, raw)

    async def put(
        self, lease: Lease, record: SessionRecord, *, answer: IdempotentAnswer | None = None
    ) -> None:
        """Store ``record``, fenced by ``lease`` and ``record.generation``; with ``answer``
        stored in the same transaction."""
        raw = record.to_json()

        def work() -> None:
            with self._transaction(write=True) as db:
                self._check_writer(db, lease, record.session_id, record.generation)
                db.execute("INSERT OR REPLACE INTO records VALUES (?, ?)", (record.session_id, raw))
                if answer is not None:
                    self._finish_in(db, answer)

        await self._run("put", work)
        self._corrupt.repaired(record.session_id)

    async def delete(self, lease: Lease, session_id: str, *, generation: int) -> None:
        """Remove the record and last-seen entry, fenced like ``put``."""
        validate_session_id(session_id)

        def work() -> None:
            with self._transaction(write=True) as db:
                self._check_writer(db, lease, session_id, generation)
                db.execute("DELETE FROM records WHERE session_id = ?", (session_id,))
                db.execute("DELETE FROM last_seen WHERE session_id = ?", (session_id,))

        await self._run("delete", work)
        self._corrupt.repaired(session_id)

    async def touch(self, session_id: str, *, at_s: float) -> None:
        """Move the last-seen time forward to ``at_s``."""
        validate_session_id(session_id)

        def work() -> None:
            with self._transaction(write=True) as db:
                db.execute(
                    "INSERT INTO last_seen VALUES (?, ?) ON CONFLICT(session_id)"
                    " DO UPDATE SET at_s = MAX(at_s, excluded.at_s)",
                    (session_id, at_s),
                )

        await self._run("touch", work)

    async def idle_sessions(self, *, older_than_s: float, now_s: float) -> list[str]:
        """Sessions last seen at or before ``now_s - older_than_s``, oldest first."""

        def work() -> list[str]:
            with self._transaction(write=False) as db:
                rows = db.execute(
                    "SELECT session_id FROM last_seen WHERE at_s <= ? ORDER BY at_s, session_id",
                    (now_s - older_than_s,),
                ).fetchall()
                return [str(row[0]) for row in rows]

        return await self._run("idle_sessions", work)

    async def list_records(self) -> list[SessionRecord]:
        """Every readable record, by session id."""

        def work() -> list[tuple[str, bytes]]:
            with self._transaction(write=False) as db:
                rows = db.execute(
                    "SELECT session_id, raw FROM records ORDER BY session_id"
                ).fetchall()
                return [(str(sid), bytes(raw)) for sid, raw in rows]

        rows = await self._run("list_records", work)
        records = (self._corrupt.decode(sid, raw) for sid, raw in rows)
        return [record for record in records if record is not None]


def _generation(connection: sqlite3.Connection, session_id: str) -> int:
    row = connection.execute(
        "SELECT generation FROM generations WHERE session_id = ?", (session_id,)
    ).fetchone()
    return 0 if row is None else int(row[0])
