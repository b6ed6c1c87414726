"""The session index: whose each runtime session is, read by every worker.

``SessionOwner`` is one entry; ``SessionIndex`` is what a registry backend
implements for it (``sqlite_index``, ``redis_index``, ``memory``).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import msgspec

from ..stored import StoredDecoder
from .core import validate_session_id

__all__ = ["SessionIndex", "SessionOwner", "check_page_limit"]


class SessionOwner(msgspec.Struct, frozen=True, kw_only=True):
    """Whose a runtime session is: the session index every worker reads.

    Records do not carry their tenant (they are written on the lifecycle's hot
    path, by code that knows no tenants); the serving surfaces index a session
    here when a tenant names it, and look it up before any session route.
    """

    session_id: str
    namespace: str
    user_id: str
    hint: str

    def __post_init__(self) -> None:
        validate_session_id(self.session_id)

    def to_json(self) -> bytes:
        return _OWNER_ENCODER.encode(self)

    @classmethod
    def from_json(cls, data: bytes | str) -> SessionOwner:
        return _OWNER_DECODER.decode(data)


_OWNER_ENCODER = msgspec.json.Encoder()
_OWNER_DECODER = StoredDecoder(SessionOwner)


def check_page_limit(limit: int | None) -> None:
    """``ValueError`` unless ``limit`` is ``None`` (no limit) or a count (0 or more)."""
    if limit is not None and limit < 0:
        raise ValueError("limit: must be >= 0")


@runtime_checkable
class SessionIndex(Protocol):
    """Who owns which runtime session (the listing and ownership checks of every surface)."""

    async def index_session(self, owner: SessionOwner) -> None:
        """Record whose ``owner.session_id`` is (idempotent; the latest write wins)."""
        ...

    async def session_owner(self, session_id: str) -> SessionOwner | None:
        """Whose the session is; ``None`` if it was never indexed (or was unindexed)."""
        ...

    async def sessions_of(
        self, namespace: str, *, after: str | None = None, limit: int | None = None
    ) -> list[SessionOwner]:
        """The sessions indexed for ``namespace`` with ids above ``after``, by session id:
        the first ``limit`` of them (all with ``None``).

        Fewer than ``limit`` means there are no more; none above ``after`` and below the
        last one returned is left out. A page reads about ``limit`` entries, not the
        namespace's whole index.
        """
        ...

    async def unindex_session(self, session_id: str) -> None:
        """Forget whose the session is (it was destroyed); idempotent."""
        ...
