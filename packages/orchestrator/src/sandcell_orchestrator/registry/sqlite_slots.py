"""Fleet-wide slots in SQLite (``SlotCounter`` of ``SqliteRegistry``).

slots(scope, token, expires_at, boot_id)        one row per held slot
"""

from __future__ import annotations

import sqlite3
from typing import ClassVar

from .core import check_ttl
from .slots import validate_slot_scope
from .sqlite_db import SqliteDatabase

__all__ = ["SqliteSlots"]


class SqliteSlots(SqliteDatabase):
    """``SlotCounter`` on the ``slots`` table (expiry on CLOCK_MONOTONIC, like the locks)."""

    SCHEMA: ClassVar[str] = """
CREATE TABLE IF NOT EXISTS slots (
    scope TEXT NOT NULL,
    token TEXT NOT NULL,
    expires_at REAL NOT NULL,
    boot_id TEXT NOT NULL,
    PRIMARY KEY (scope, token)
);
"""

    def _prune(self, db: sqlite3.Connection, scope: str) -> None:
        db.execute(
            "DELETE FROM slots WHERE scope = ? AND (expires_at <= ? OR boot_id != ?)",
            (scope, self._clock(), self._boot_id),
        )

    async def acquire_slot(self, scope: str, *, token: str, limit: int, ttl_ms: int) -> bool:
        """Take a slot if fewer than ``limit`` are held."""
        validate_slot_scope(scope)
        check_ttl(ttl_ms)

        def work() -> bool:
            with self._transaction(write=True) as db:
                self._prune(db, scope)
                (held,) = db.execute(
                    "SELECT COUNT(*) FROM slots WHERE scope = ?", (scope,)
                ).fetchone()
                if int(held) >= limit:
                    return False
                db.execute(
                    "INSERT OR REPLACE INTO slots VALUES (?, ?, ?, ?)",
                    (scope, token, self._expiry(ttl_ms), self._boot_id),
                )
                return True

        return await self._run("acquire_slot", work)

    async def renew_slot(self, scope: str, *, token: str, ttl_ms: int) -> bool:
        """Extend ``token``'s live slot."""
        validate_slot_scope(scope)
        check_ttl(ttl_ms)

        def work() -> bool:
            with self._transaction(write=True) as db:
                self._prune(db, scope)
                done = db.execute(
                    "UPDATE slots SET expires_at = ? WHERE scope = ? AND token = ?",
                    (self._expiry(ttl_ms), scope, token),
                )
                return done.rowcount == 1

        return await self._run("renew_slot", work)

    async def release_slot(self, scope: str, *, token: str) -> None:
        """Delete ``token``'s slot."""
        validate_slot_scope(scope)

        def work() -> None:
            with self._transaction(write=True) as db:
                db.execute("DELETE FROM slots WHERE scope = ? AND token = ?", (scope, token))

        await self._run("release_slot", work)

    async def slots_held(self, scope: str) -> int:
        """Live slots of ``scope``."""
        validate_slot_scope(scope)

        def work() -> int:
            with self._transaction(write=True) as db:
                self._prune(db, scope)
                (held,) = db.execute(
                    "SELECT COUNT(*) FROM slots WHERE scope = ?", (scope,)
                ).fetchone()
                return int(held)

        return await self._run("slots_held", work)


def _count(db: sqlite3.Connection, scope: str) -> int:
    (held,) = db.execute("SELECT COUNT(*) FROM slots WHERE scope = ?", (scope,)).fetchone()
    return int(held)
