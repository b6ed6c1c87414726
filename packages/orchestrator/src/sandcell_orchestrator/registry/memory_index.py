"""Whose each session is, in this process's memory (``SessionIndex`` of ``InProcessRegistry``)."""

from __future__ import annotations

import anyio

from .core import validate_session_id
from .index import SessionOwner, check_page_limit

__all__ = ["InProcessSessionIndex"]


class InProcessSessionIndex:
    """``SessionIndex`` in a dict: session id -> its owner."""

    def __init__(self) -> None:
        self._owners: dict[str, SessionOwner] = {}

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
