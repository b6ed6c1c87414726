"""``SqliteDatabase``: the connection, transactions and thread hand-off of ``SqliteRegistry``.

Each feature module (``sqlite``, ``sqlite_index``, ``sqlite_idempotency``,
``sqlite_e2b``) subclasses it with its tables in a ``SCHEMA`` class attribute;
the schema created is every ``SCHEMA`` of the final class's bases.

Each operation is one transaction. Writers open it with ``BEGIN IMMEDIATE``
(the database's write lock first, so "is the lock mine, is my generation
current" and the write are one atomic step across processes); the journal is
WAL so readers never wait for writers, and a busy database is waited for up to
``busy_timeout_ms`` before it is a ``RegistryError``.

Expiry is measured on ``CLOCK_MONOTONIC``, which every process on one boot
shares and which wall-clock jumps do not move; a row from another boot
(``boot_id``) is expired, since monotonic time restarts at boot.

The sqlite3 module blocks, so every call runs in a worker thread, one at a time
per registry (one connection, not shared between threads at once).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import ClassVar, TypeVar

import anyio.to_thread

from ..errors import RegistryError

__all__ = ["SqliteDatabase", "current_boot_id"]

T = TypeVar("T")


def current_boot_id() -> str:
    """This boot's id (``/proc/sys/kernel/random/boot_id``); ``"unknown"`` without one."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"


class SqliteDatabase:
    """One SQLite file shared by every process on this machine, used from worker threads."""

    SCHEMA: ClassVar[str] = ""

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
        self._boot_id = current_boot_id() if boot_id is None else boot_id
        self._connection: sqlite3.Connection | None = None
        self._closed = False
        self._mutex = threading.Lock()
        self._limiter = anyio.CapacityLimiter(1)

    @classmethod
    def _schema(cls) -> str:
        return "".join(vars(base).get("SCHEMA", "") for base in reversed(cls.__mro__))

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
            connection.executescript(self._schema())
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

    def _expiry(self, ttl_ms: int) -> float:
        return self._clock() + ttl_ms / 1000

    def _live(self, expires_at: float, row_boot_id: str) -> bool:
        return row_boot_id == self._boot_id and self._clock() < expires_at

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
