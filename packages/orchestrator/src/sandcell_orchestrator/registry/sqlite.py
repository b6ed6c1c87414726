"""``SqliteRegistry``: the session registry in one SQLite file (the embedded default).

Every ``sandcell exec`` is its own process, so an in-process registry cannot
keep two of them out of one session. This one keeps the same semantics as
``RedisRegistry`` (TTL locks on random tokens, compare-and-delete release,
generations, fenced writes) in ``$SANDCELL_HOME/registry.sqlite3``, which every
process on the machine opens:

    locks(session_id, token, expires_at, boot_id)   one row per held lock
    generations(session_id, generation)             never deleted (fencing)
    records(session_id, raw)                         the SessionRecord JSON
    last_seen(session_id, at_s)                      wall-clock seconds
    owners(session_id, namespace, user_id, hint)     the session index (whose it is)
    idempotency(key, token, fingerprint, done, status, body, expires_at, boot_id)
                                                     requests claimed or answered

Each operation is one transaction. Writers open it with ``BEGIN IMMEDIATE``
(the database's write lock first, so "is the lock mine, is my generation
current" and the write are one atomic step across processes); the journal is
WAL so readers never wait for writers, and a busy database is waited for up to
``busy_timeout_ms`` before it is a ``RegistryError``.

Lock expiry is measured on ``CLOCK_MONOTONIC``, which every process on one boot
shares and which wall-clock jumps do not move; a lock row from another boot
(``boot_id``) is expired, since monotonic time restarts at boot.

The sqlite3 module blocks, so every call runs in a worker thread, one at a time
per registry (one connection, not shared between threads at once).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import anyio.to_thread

from ..errors import LockLostError, RegistryError
from . import (
    FencedError,
    IdempotencyEntry,
    Lease,
    SessionOwner,
    SessionRecord,
    _CorruptRecordLog,
    validate_idempotency_key,
    validate_session_id,
)
from .memory import _check_floor, _check_ttl

__all__ = ["SqliteRegistry"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_SCHEMA = """
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
CREATE TABLE IF NOT EXISTS owners (
    session_id TEXT PRIMARY KEY,
    namespace TEXT NOT NULL,
    user_id TEXT NOT NULL,
    hint TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS owners_by_namespace ON owners (namespace, session_id);
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


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"


class SqliteRegistry:
    """A ``SessionRegistry`` in a SQLite file shared by every process on this machine."""

    def __init__(
        self,
        path: Path,
        *,
        busy_timeout_ms: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
        boot_id: str | None = None,
    ) -> None:
        self.path = path
        self._busy_timeout_ms = busy_timeout_ms
        self._clock = clock
        self._boot_id = _boot_id() if boot_id is None else boot_id
        self._connection: sqlite3.Connection | None = None
        self._closed = False
        self._mutex = threading.Lock()
        self._limiter = anyio.CapacityLimiter(1)
        self._corrupt = _CorruptRecordLog(logger)

    def __repr__(self) -> str:
        return f"SqliteRegistry({str(self.path)!r})"

    # -- plumbing -----------------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        if self._closed:
            raise RegistryError("the registry is closed")
        if self._connection is not None:
            return self._connection
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        # Created 0600 before SQLite opens it: its WAL and shm files copy the mode.
        os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600))
        connection = sqlite3.connect(
            self.path,
            timeout=self._busy_timeout_ms / 1000,
            isolation_level=None,
            # Used from worker threads, one at a time (self._mutex).
            check_same_thread=False,
        )
        try:
            connection.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout_ms)}")
            connection.execute("PRAGMA journal_mode = WAL")
            # WAL + NORMAL survives a crashed process; only a power loss can drop
            # the last transactions, and then every lock is void anyway.
            connection.execute("PRAGMA synchronous = NORMAL")
            connection.executescript(_SCHEMA)
        except BaseException:
            connection.close()
            raise
        self._connection = connection
        return connection

    @contextlib.contextmanager
    def _transaction(self, *, write: bool) -> Iterator[sqlite3.Connection]:
        connection = self._connect()
        connection.execute("BEGIN IMMEDIATE" if write else "BEGIN DEFERRED")
        try:
            yield connection
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                connection.execute("ROLLBACK")
            raise
        connection.execute("COMMIT")

    async def _run(self, operation: str, work: Callable[[], T]) -> T:
        def guarded() -> T:
            with self._mutex:
                try:
                    return work()
                except sqlite3.Error as exc:
                    # The message names the failure (locked, disk I/O), never a value.
                    raise RegistryError(
                        f"registry {operation} failed ({type(exc).__name__}: {exc})"
                    ) from None

        return await anyio.to_thread.run_sync(guarded, limiter=self._limiter)

    def _holder(self, connection: sqlite3.Connection, session_id: str) -> str | None:
        row = connection.execute(
            "SELECT token, expires_at, boot_id FROM locks WHERE session_id = ?", (session_id,)
        ).fetchone()
        if row is None:
            return None
        token, expires_at, boot_id = row
        if boot_id != self._boot_id or self._clock() >= expires_at:
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
        _check_ttl(ttl_ms)

        def work() -> Lease | None:
            with self._transaction(write=True) as db:
                if self._holder(db, session_id) is not None:
                    return None
                token = secrets.token_hex(16)
                db.execute(
                    "INSERT OR REPLACE INTO locks VALUES (?, ?, ?, ?)",
                    (session_id, token, self._clock() + ttl_ms / 1000, self._boot_id),
                )
                return Lease(session_id=session_id, token=token, ttl_ms=ttl_ms)

        return await self._run("acquire_lock", work)

    async def renew(self, lease: Lease, *, ttl_ms: int) -> bool:
        """Reset the TTL if the lock is still ``lease``'s."""
        _check_ttl(ttl_ms)

        def work() -> bool:
            with self._transaction(write=True) as db:
                if self._holder(db, lease.session_id) != lease.token:
                    return False
                db.execute(
                    "UPDATE locks SET expires_at = ? WHERE session_id = ?",
                    (self._clock() + ttl_ms / 1000, lease.session_id),
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
        _check_floor(above)

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

    async def put(self, lease: Lease, record: SessionRecord) -> None:
        """Store ``record``, fenced by ``lease`` and ``record.generation``."""
        raw = record.to_json()

        def work() -> None:
            with self._transaction(write=True) as db:
                self._check_writer(db, lease, record.session_id, record.generation)
                db.execute("INSERT OR REPLACE INTO records VALUES (?, ?)", (record.session_id, raw))

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

    # -- the session index ----------------------------------------------------------

    async def index_session(self, owner: SessionOwner) -> None:
        """Record whose the session is."""

        def work() -> None:
            with self._transaction(write=True) as db:
                db.execute(
                    "INSERT OR REPLACE INTO owners VALUES (?, ?, ?, ?)",
                    (owner.session_id, owner.namespace, owner.user_id, owner.hint),
                )

        await self._run("index_session", work)

    async def session_owner(self, session_id: str) -> SessionOwner | None:
        """Whose the session is."""
        validate_session_id(session_id)

        def work() -> SessionOwner | None:
            with self._transaction(write=False) as db:
                row = db.execute(
                    "SELECT session_id, namespace, user_id, hint FROM owners WHERE session_id = ?",
                    (session_id,),
                ).fetchone()
            return None if row is None else _owner(row)

        return await self._run("session_owner", work)

    async def sessions_of(self, namespace: str) -> list[SessionOwner]:
        """The namespace's sessions, by id."""

        def work() -> list[SessionOwner]:
            with self._transaction(write=False) as db:
                rows = db.execute(
                    "SELECT session_id, namespace, user_id, hint FROM owners"
                    " WHERE namespace = ? ORDER BY session_id",
                    (namespace,),
                ).fetchall()
            return [_owner(row) for row in rows]

        return await self._run("sessions_of", work)

    async def unindex_session(self, session_id: str) -> None:
        """Forget whose the session is."""
        validate_session_id(session_id)

        def work() -> None:
            with self._transaction(write=True) as db:
                db.execute("DELETE FROM owners WHERE session_id = ?", (session_id,))

        await self._run("unindex_session", work)

    # -- idempotency --------------------------------------------------------------
    # Expiry is on CLOCK_MONOTONIC like the locks: an answer kept from another
    # boot is forgotten (a retry then runs again), never misread as current.

    def _idempotent(self, db: sqlite3.Connection, key: str) -> tuple[str, IdempotencyEntry] | None:
        row = db.execute(
            "SELECT token, fingerprint, done, status, body, expires_at, boot_id"
            " FROM idempotency WHERE key = ?",
            (key,),
        ).fetchone()
        if row is None:
            return None
        token, fingerprint, done, status, body, expires_at, boot_id = row
        if boot_id != self._boot_id or self._clock() >= expires_at:
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
        _check_ttl(ttl_ms)

        def work() -> IdempotencyEntry | None:
            with self._transaction(write=True) as db:
                held = self._idempotent(db, key)
                if held is not None:
                    return held[1]
                db.execute(
                    "INSERT OR REPLACE INTO idempotency VALUES (?, ?, ?, 0, 0, ?, ?, ?)",
                    (key, token, fingerprint, b"", self._clock() + ttl_ms / 1000, self._boot_id),
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
        _check_ttl(ttl_ms)
        sql = "UPDATE idempotency SET expires_at = ? WHERE key = ?"
        work = self._update_own(
            key, token, pending_only=True, sql=sql, args=(self._clock() + ttl_ms / 1000,)
        )
        return await self._run("renew_idempotency", work)

    async def finish_idempotency(
        self, key: str, *, token: str, status: int, body: bytes, ttl_ms: int
    ) -> bool:
        """Store the answer of ``token``'s claim."""
        _check_ttl(ttl_ms)
        sql = "UPDATE idempotency SET done = 1, status = ?, body = ?, expires_at = ? WHERE key = ?"
        args = (status, bytes(body), self._clock() + ttl_ms / 1000)
        work = self._update_own(key, token, pending_only=False, sql=sql, args=args)
        return await self._run("finish_idempotency", work)

    async def drop_idempotency(self, key: str, *, token: str) -> bool:
        """Forget ``token``'s pending claim."""
        sql = "DELETE FROM idempotency WHERE key = ?"
        work = self._update_own(key, token, pending_only=True, sql=sql, args=())
        return await self._run("drop_idempotency", work)

    async def close(self) -> None:
        """Close the connection; idempotent (the file stays for the next process)."""

        def work() -> None:
            self._closed = True
            connection, self._connection = self._connection, None
            if connection is not None:
                connection.close()

        await anyio.to_thread.run_sync(lambda: _locked(self._mutex, work), limiter=self._limiter)


def _locked(mutex: threading.Lock, work: Callable[[], None]) -> None:
    with mutex:
        work()


def _owner(row: tuple[object, ...]) -> SessionOwner:
    session_id, namespace, user_id, hint = (str(value) for value in row)
    return SessionOwner(session_id=session_id, namespace=namespace, user_id=user_id, hint=hint)


def _generation(connection: sqlite3.Connection, session_id: str) -> int:
    row = connection.execute(
        "SELECT generation FROM generations WHERE session_id = ?", (session_id,)
    ).fetchone()
    return 0 if row is None else int(row[0])
