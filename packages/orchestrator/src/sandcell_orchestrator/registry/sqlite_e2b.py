"""The E2B sandbox table in SQLite (``E2bSandboxTable`` of ``SqliteRegistry``).

e2b_sandboxes(sandbox_id, namespace, revision, started_at_s, raw)
                                                 one E2bSandboxRow JSON per sandbox
e2b_by_namespace_start (namespace, started_at_s, sandbox_id)
                                                 a namespace's rows by start time (a listing page)
e2b_ends(sandbox_id, end_at_s)                   every running sandbox's end (the sweep)
e2b_killed(sandbox_id, until_s)                  ids removed (killed) lately
e2b_kept_merged(namespace, until_s)              tenants whose kept rows were merged lately
"""

from __future__ import annotations

import functools
import json
import logging
import sqlite3
import time
from collections.abc import Sequence
from typing import ClassVar

from .e2b import (
    KILLED_E2B_TTL_S,
    E2bSandboxRow,
    E2bStartKey,
    decode_row,
    validate_e2b_sandbox_id,
)
from .index import check_page_limit
from .sqlite_db import SqliteDatabase

__all__ = ["SqliteE2bTable"]

logger = logging.getLogger(__name__)


class SqliteE2bTable(SqliteDatabase):
    """``E2bSandboxTable`` on the ``e2b_sandboxes`` table."""

    SCHEMA: ClassVar[str] = """
CREATE TABLE IF NOT EXISTS e2b_sandboxes (
    sandbox_id TEXT PRIMARY KEY,
    namespace TEXT NOT NULL,
    revision INTEGER NOT NULL,
    started_at_s REAL NOT NULL,
    raw BLOB NOT NULL
);
DROP INDEX IF EXISTS e2b_by_namespace;
CREATE INDEX IF NOT EXISTS e2b_by_namespace_start
    ON e2b_sandboxes (namespace, started_at_s, sandbox_id);
DROP INDEX IF EXISTS e2b_by_namespace_id;
CREATE TABLE IF NOT EXISTS e2b_ends (
    sandbox_id TEXT PRIMARY KEY,
    end_at_s REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS e2b_ends_by_end ON e2b_ends (end_at_s);
CREATE TABLE IF NOT EXISTS e2b_killed (
    sandbox_id TEXT PRIMARY KEY,
    until_s REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS e2b_killed_by_until ON e2b_killed (until_s);
CREATE TABLE IF NOT EXISTS e2b_kept_merged (
    namespace TEXT PRIMARY KEY,
    until_s REAL NOT NULL
);
"""

    async def add_e2b_sandbox(self, row: E2bSandboxRow) -> bool:
        """Store a row at its revision; ``False`` if the id is taken."""
        raw = row.to_json()

        def work() -> bool:
            with self._transaction(write=True) as db:
                done = db.execute(
                    "INSERT OR IGNORE INTO e2b_sandboxes VALUES (?, ?, ?, ?, ?)",
                    (row.sandbox_id, row.namespace, row.revision, row.started_at_s, raw),
                )
                if done.rowcount != 1:
                    return False
                _set_end(db, row)
                return True

        return await self._run("add_e2b_sandbox", work)

    async def e2b_sandbox(self, sandbox_id: str) -> E2bSandboxRow | None:
        """The row; ``None`` if missing or unreadable."""
        validate_e2b_sandbox_id(sandbox_id)

        def work() -> bytes | None:
            with self._transaction(write=False) as db:
                found = db.execute(
                    "SELECT raw FROM e2b_sandboxes WHERE sandbox_id = ?", (sandbox_id,)
                ).fetchone()
            return None if found is None else bytes(found[0])

        raw = await self._run("e2b_sandbox", work)
        return None if raw is None else _decoded(sandbox_id, raw)

    async def e2b_sandboxes(self) -> list[E2bSandboxRow]:
        """Every row, by start time then id."""

        def work() -> list[tuple[str, bytes]]:
            with self._transaction(write=False) as db:
                rows = db.execute(
                    "SELECT sandbox_id, raw FROM e2b_sandboxes ORDER BY started_at_s, sandbox_id"
                ).fetchall()
            return [(str(sid), bytes(raw)) for sid, raw in rows]

        found = (_decoded(sid, raw) for sid, raw in await self._run("e2b_sandboxes", work))
        return [row for row in found if row is not None]

    async def e2b_sandboxes_by_start(
        self,
        namespace: str,
        *,
        after: E2bStartKey | None = None,
        limit: int,
        newest_first: bool = False,
    ) -> list[E2bSandboxRow]:
        """``namespace``'s rows past ``after`` by ``(started_at_s, sandbox_id)``, or the
        reverse: the first ``limit`` (``e2b_by_namespace_start`` serves the range, so a
        page reads only its rows). An unreadable row is skipped and the range read on
        past it until ``limit`` are found or it ends: a short page has to mean the end."""
        check_page_limit(limit)
        first, past = _BY_START[newest_first]

        def work(start: E2bStartKey | None, wanted: int) -> list[tuple[str, float, bytes]]:
            with self._transaction(write=False) as db:
                if start is None:
                    rows = db.execute(first, (namespace, wanted)).fetchall()
                else:
                    rows = db.execute(past, (namespace, *start, wanted)).fetchall()
            return [(str(sid), float(at), bytes(raw)) for sid, at, raw in rows]

        found: list[E2bSandboxRow] = []
        start = after
        while len(found) < limit:
            wanted = limit - len(found)
            read = await self._run("e2b_sandboxes_by_start", functools.partial(work, start, wanted))
            found += [row for sid, _, raw in read if (row := _decoded(sid, raw)) is not None]
            if len(read) < wanted:
                break
            start = (read[-1][1], read[-1][0])
        return found

    async def e2b_due(self, now_s: float, *, limit: int) -> list[E2bSandboxRow]:
        """Running rows ended by ``now_s``, soonest first (``e2b_ends_by_end`` serves the
        range, so a sweep reads the due rows only)."""
        check_page_limit(limit)

        def work() -> list[tuple[str, bytes]]:
            with self._transaction(write=False) as db:
                rows = db.execute(
                    "SELECT e.sandbox_id, s.raw FROM e2b_ends e"
                    " JOIN e2b_sandboxes s ON s.sandbox_id = e.sandbox_id"
                    " WHERE e.end_at_s <= ? ORDER BY e.end_at_s, e.sandbox_id LIMIT ?",
                    (now_s, limit),
                ).fetchall()
            return [(str(sid), bytes(raw)) for sid, raw in rows]

        found = (_decoded(sid, raw) for sid, raw in await self._run("e2b_due", work))
        return [row for row in found if row is not None and row.state == "running"]

    async def e2b_running_of(self, namespace: str) -> list[E2bSandboxRow]:
        """``namespace``'s rows that have an end in ``e2b_ends`` (the running ones), by
        start time then id; the paused rows are not read."""

        def work() -> list[tuple[str, bytes]]:
            with self._transaction(write=False) as db:
                rows = db.execute(
                    "SELECT s.sandbox_id, s.raw FROM e2b_sandboxes s"
                    " JOIN e2b_ends e ON e.sandbox_id = s.sandbox_id WHERE s.namespace = ?"
                    " ORDER BY s.started_at_s, s.sandbox_id",
                    (namespace,),
                ).fetchall()
            return [(str(sid), bytes(raw)) for sid, raw in rows]

        found = (_decoded(sid, raw) for sid, raw in await self._run("e2b_running_of", work))
        return [row for row in found if row is not None and row.state == "running"]

    async def e2b_running_count(self, namespace: str) -> int:
        """``COUNT`` of ``e2b_running_of``'s join: ``e2b_by_namespace_start`` and the
        ends' primary key serve it, so no row is read. A row this table cannot decode is
        counted (``e2b_running_of`` skips it): the caller confirms a count at its limit."""

        def work() -> int:
            with self._transaction(write=False) as db:
                (count,) = db.execute(
                    "SELECT COUNT(*) FROM e2b_sandboxes s"
                    " JOIN e2b_ends e ON e.sandbox_id = s.sandbox_id WHERE s.namespace = ?",
                    (namespace,),
                ).fetchone()
            return int(count)

        return await self._run("e2b_running_count", work)

    async def e2b_index(self, rows: Sequence[E2bSandboxRow]) -> None:
        """Each row's ``e2b_ends`` entry as its state calls for, where it is still at the
        revision read (rows from before ``e2b_ends`` have none)."""
        wanted = list(rows)

        def work() -> None:
            with self._transaction(write=True) as db:
                for row in wanted:
                    current = db.execute(
                        "SELECT 1 FROM e2b_sandboxes WHERE sandbox_id = ? AND revision = ?",
                        (row.sandbox_id, row.revision),
                    ).fetchone()
                    if current is not None:
                        _set_end(db, row)

        if wanted:
            await self._run("e2b_index", work)

    async def e2b_sandboxes_present(self, sandbox_ids: Sequence[str]) -> set[str]:
        """Which of ``sandbox_ids`` have a row (their primary keys, in one query)."""
        ids = json.dumps([validate_e2b_sandbox_id(i) for i in sandbox_ids])

        def work() -> set[str]:
            with self._transaction(write=False) as db:
                found = db.execute(
                    "SELECT sandbox_id FROM e2b_sandboxes"
                    " WHERE sandbox_id IN (SELECT value FROM json_each(?))",
                    (ids,),
                ).fetchall()
            return {str(sid) for (sid,) in found}

        return await self._run("e2b_sandboxes_present", work) if sandbox_ids else set()

    async def e2b_kept_merged(self, namespace: str) -> bool:
        """Whether ``namespace`` was marked merged within its TTL."""

        def work() -> bool:
            with self._transaction(write=False) as db:
                found = db.execute(
                    "SELECT 1 FROM e2b_kept_merged WHERE namespace = ? AND until_s > ?",
                    (namespace, time.time()),
                ).fetchone()
                return found is not None

        return await self._run("e2b_kept_merged", work)

    async def mark_e2b_kept_merged(self, namespace: str, *, ttl_s: float) -> None:
        """Mark ``namespace`` merged for ``ttl_s`` (the marks that ran out go too)."""

        def work() -> None:
            now = time.time()
            with self._transaction(write=True) as db:
                db.execute("DELETE FROM e2b_kept_merged WHERE until_s <= ?", (now,))
                db.execute(
                    "INSERT OR REPLACE INTO e2b_kept_merged VALUES (?, ?)",
                    (namespace, now + ttl_s),
                )

        await self._run("mark_e2b_kept_merged", work)

    async def update_e2b_sandbox(self, row: E2bSandboxRow) -> bool:
        """Compare-and-set on ``revision``."""
        raw = row.to_json()

        def work() -> bool:
            with self._transaction(write=True) as db:
                done = db.execute(
                    "UPDATE e2b_sandboxes SET revision = ?, raw = ?"
                    " WHERE sandbox_id = ? AND revision = ? AND namespace = ?",
                    (row.revision, raw, row.sandbox_id, row.revision - 1, row.namespace),
                )
                if done.rowcount != 1:
                    return False
                _set_end(db, row)
                return True

        return await self._run("update_e2b_sandbox", work)

    async def remove_e2b_sandbox(self, sandbox_id: str) -> bool:
        """Delete the row and mark the id killed for ``KILLED_E2B_TTL_S`` (one
        transaction; the marks that ran out go in it too)."""
        validate_e2b_sandbox_id(sandbox_id)

        def work() -> bool:
            now = time.time()
            with self._transaction(write=True) as db:
                done = db.execute("DELETE FROM e2b_sandboxes WHERE sandbox_id = ?", (sandbox_id,))
                db.execute("DELETE FROM e2b_ends WHERE sandbox_id = ?", (sandbox_id,))
                db.execute("DELETE FROM e2b_killed WHERE until_s <= ?", (now,))
                db.execute(
                    "INSERT OR REPLACE INTO e2b_killed VALUES (?, ?)",
                    (sandbox_id, now + KILLED_E2B_TTL_S),
                )
                return done.rowcount == 1

        return await self._run("remove_e2b_sandbox", work)

    async def e2b_sandbox_killed(self, sandbox_id: str) -> bool:
        """Whether the id was removed in the last ``KILLED_E2B_TTL_S``."""
        validate_e2b_sandbox_id(sandbox_id)

        def work() -> bool:
            with self._transaction(write=False) as db:
                found = db.execute(
                    "SELECT 1 FROM e2b_killed WHERE sandbox_id = ? AND until_s > ?",
                    (sandbox_id, time.time()),
                ).fetchone()
                return found is not None

        return await self._run("e2b_sandbox_killed", work)


def _set_end(db: sqlite3.Connection, row: E2bSandboxRow) -> None:
    """``row``'s entry in ``e2b_ends``: its end while it runs, none otherwise (in the
    transaction of the row's own write)."""
    if row.state == "running":
        db.execute("INSERT OR REPLACE INTO e2b_ends VALUES (?, ?)", (row.sandbox_id, row.end_at_s))
    else:
        db.execute("DELETE FROM e2b_ends WHERE sandbox_id = ?", (row.sandbox_id,))


def _by_start(order: str, past: str) -> tuple[str, str]:
    """The first page's query and the query of a page past a key, in one order. A row
    value is compared whole, so ties on the start time go by id and the index
    ``e2b_by_namespace_start`` serves the range (SQLite 3.15+)."""
    read = "SELECT sandbox_id, started_at_s, raw FROM e2b_sandboxes WHERE namespace = ?"
    by = f" ORDER BY started_at_s {order}, sandbox_id {order} LIMIT ?"
    return read + by, read + f" AND (started_at_s, sandbox_id) {past} (?, ?)" + by


_BY_START = {False: _by_start("ASC", ">"), True: _by_start("DESC", "<")}
"""Built once from constants (never from input): by ``newest_first``."""


def _decoded(sandbox_id: str, raw: bytes) -> E2bSandboxRow | None:
    row = decode_row(sandbox_id, raw)
    if row is None:
        logger.warning("e2b sandbox row %s is unreadable; treating it as missing", sandbox_id)
    return row
