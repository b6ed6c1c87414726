"""The session index in SQLite (``SessionIndex`` of ``SqliteRegistry``).

owners(session_id, namespace, user_id, hint)     whose each session is
"""

from __future__ import annotations

from typing import ClassVar

from .core import validate_session_id
from .index import SessionOwner, check_page_limit
from .sqlite_db import SqliteDatabase

__all__ = ["SqliteSessionIndex"]


class SqliteSessionIndex(SqliteDatabase):
    """``SessionIndex`` on the ``owners`` table."""

    SCHEMA: ClassVar[str] = """
CREATE TABLE IF NOT EXISTS owners (
    session_id TEXT PRIMARY KEY,
    namespace TEXT NOT NULL,
    user_id TEXT NOT NULL,
    hint TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS owners_by_namespace ON owners (namespace, session_id);
"""

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

    async def sessions_of(
        self, namespace: str, *, after: str | None = None, limit: int | None = None
    ) -> list[SessionOwner]:
        """The namespace's sessions above ``after``, by id: the first ``limit``
        (``owners_by_namespace`` serves the range, so a page reads only its rows)."""
        check_page_limit(limit)

        def work() -> list[SessionOwner]:
            with self._transaction(write=False) as db:
                rows = db.execute(
                    "SELECT session_id, namespace, user_id, hint FROM owners"
                    " WHERE namespace = ? AND session_id > ? ORDER BY session_id LIMIT ?",
                    # '' is below every id; SQLite's LIMIT -1 is no limit.
                    (namespace, "" if after is None else after, -1 if limit is None else limit),
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


def _owner(row: tuple[object, ...]) -> SessionOwner:
    session_id, namespace, user_id, hint = (str(value) for value in row)
    return SessionOwner(session_id=session_id, namespace=namespace, user_id=user_id, hint=hint)
