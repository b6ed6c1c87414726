"""Idempotency keys in SQLite (``IdempotencyStore`` of ``SqliteRegistry``).

    idempotency(key, token, fingerprint, done, status, body, expires_at, boot_id)
                                                     requests claimed or answered

Expiry is on CLOCK_MONOTONIC like the locks: an answer kept from another boot
is forgotten (a retry then runs again), never misread as current.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from typing import ClassVar

from .core import check_ttl
from .idempotency import IdempotencyEntry, IdempotentAnswer, validate_idempotency_key
from .sqlite_db import SqliteDatabase

__all__ = ["SqliteIdempotency"]


class SqliteIdempotency(SqliteDatabase):
    """``IdempotencyStore`` on the ``idempotency`` table."""

    SCHEMA: ClassVar[str] = """
CREATE TABLE IF NOT EXISTS idempotency (
    key TEXT PRIMARY KEY,
    token TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    done INTEGER NOT NULL,
    status INTEGER NOT NULL,
    body BLOB NOT NULL,
    expires_at REAL NOT NULL,
    boot_id TEXT NOT NULL
);
"""

    def _idempotent(self, db: sqlite3.Connection, key: str) -> tuple[str, IdempotencyEntry] | None:
        row = db.execute(
            "SELECT token, fingerprint, done, status, body, expires_at, boot_id"
            " FROM idempotency WHERE key = ?",
            (key,),
        ).fetchone()
        if row is None:
            return None
        token, fingerprint, done, status, body, expires_at, row_boot = row
        if not self._live(expires_at, row_boot):
            return None
        entry = IdempotencyEntry(
            fingerprint=str(fingerprint), done=bool(done), status=int(status), body=bytes(body)
        )
        return str(token), entry

    async def claim_idempotency(
        self, key: str, *, fingerprint: str, token: str, ttl_ms: int
    ) -> IdempotencyEntry | None:
        """Claim ``key`` unless someone has; else the entry found."""
        validate_idempotency_key(key)
        check_ttl(ttl_ms)

        def work() -> IdempotencyEntry | None:
            with self._transaction(write=True) as db:
                held = self._idempotent(db, key)
                if held is not None:
                    return held[1]
                db.execute(
                    "INSERT OR REPLACE INTO idempotency VALUES (?, ?, ?, 0, 0, ?, ?, ?)",
                    (key, token, fingerprint, b"", self._expiry(ttl_ms), self._boot_id),
                )
                return None

        return await self._run("claim_idempotency", work)

    def _update_own(
        self, key: str, token: str, *, pending_only: bool, sql: str, args: tuple[object, ...]
    ) -> Callable[[], bool]:
        validate_idempotency_key(key)

        def work() -> bool:
            with self._transaction(write=True) as db:
                held = self._idempotent(db, key)
                if held is None or held[0] != token or (pending_only and held[1].done):
                    return False
                db.execute(sql, (*args, key))
                return True

        return work

    async def renew_idempotency(self, key: str, *, token: str, ttl_ms: int) -> bool:
        """Extend ``token``'s pending claim."""
        check_ttl(ttl_ms)
        sql = "UPDATE idempotency SET expires_at = ? WHERE key = ?"
        work = self._update_own(
            key, token, pending_only=True, sql=sql, args=(self._expiry(ttl_ms),)
        )
        return await self._run("renew_idempotency", work)

    async def finish_idempotency(
        self, key: str, *, token: str, status: int, body: bytes, ttl_ms: int
    ) -> bool:
        """Store the answer of ``token``'s claim."""
        check_ttl(ttl_ms)
        sql = "UPDATE idempotency SET done = 1, status = ?, body = ?, expires_at = ? WHERE key = ?"
        args = (status, bytes(body), self._expiry(ttl_ms))
        work = self._update_own(key, token, pending_only=False, sql=sql, args=args)
        return await self._run("finish_idempotency", work)

    def _finish_in(self, db: sqlite3.Connection, answer: IdempotentAnswer) -> bool:
        """Store ``answer`` inside the caller's write transaction (the record's)."""
        held = self._idempotent(db, answer.key)
        if held is None or held[0] != answer.token:
            return False
        db.execute(
            "UPDATE idempotency SET done = 1, status = ?, body = ?, expires_at = ? WHERE key = ?",
            (answer.status, bytes(answer.body), self._expiry(answer.ttl_ms), answer.key),
        )
        return True

    async def drop_idempotency(self, key: str, *, token: str) -> bool:
        """Forget ``token``'s pending claim."""
        sql = "DELETE FROM idempotency WHERE key = ?"
        work = self._update_own(key, token, pending_only=True, sql=sql, args=())
        return await self._run("drop_idempotency", work)
