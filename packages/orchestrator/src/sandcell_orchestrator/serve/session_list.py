"""``GET /v1/sessions``: a tenant's runtime sessions, a page at a time.

    GET /v1/sessions?limit=N&after=<session_id>
        {"sessions": [SessionInfo, ...], "next_after": "<session_id>"}

Sessions come in session-id order: those of the registry's session index and those
whose owner the snapshot store keeps (``SessionOwners``), together, so a registry that
lost its data (a Redis wiped or restarted without persistence) still lists every
session the store can restore, as ``saved``, before its next turn. Each one listed
costs a record read and a checkpoint lookup (a listing of its prefix on S3), and one
of the store's alone a read of its owner; so one request looks at no more than
``limit`` sessions (default 100, at most 1000), one page of the registry's index and
one of the tenant's owners in the store (``limit + 1`` ids of each): a tenant with
many sessions is read page by page, never all at once. ``next_after`` (absent on the
last page) is what the next request passes as ``after``; a page can hold fewer than
``limit`` sessions when entries had nothing left to list (a session destroyed on
another worker between the index read and the lookups, a stored owner whose session
has no checkpoint left).
"""

from __future__ import annotations

import msgspec
from starlette.requests import Request

from sandcell_protocol import ProtocolError

from ..bootstrap import Services
from ..registry import validate_session_id

__all__ = ["DEFAULT_LIMIT", "MAX_LIMIT", "SessionInfo", "SessionList", "list_sessions", "page_of"]

DEFAULT_LIMIT = 100
MAX_LIMIT = 1000


class SessionInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One runtime session of the caller's namespace, as ``GET /v1/sessions`` lists it."""

    session_id: str
    user_id: str
    hint: str
    state: str
    """``active`` (a sandbox is warm), ``suspended`` or ``saved`` (a checkpoint only)."""
    has_checkpoint: bool
    updated_at_s: float | None


class SessionList(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The body of ``GET /v1/sessions``."""

    sessions: list[SessionInfo]
    next_after: str | None = None
    """The ``after`` of the next page; absent on the last one."""


def page_of(request: Request) -> tuple[int, str | None]:
    """The request's ``limit`` and ``after``; ``ProtocolError`` (400) if malformed."""
    raw_limit = request.query_params.get("limit")
    limit = DEFAULT_LIMIT
    if raw_limit is not None:
        # ASCII digits, few of them: ``isdecimal`` takes other scripts' digits, and
        # ``int`` refuses a string of over 4300 digits (a ValueError, not a 400).
        digits = raw_limit.isascii() and raw_limit.isdecimal() and len(raw_limit) <= 4
        if not digits or not 1 <= int(raw_limit) <= MAX_LIMIT:
            raise ProtocolError(f"limit: an integer from 1 to {MAX_LIMIT}")
        limit = int(raw_limit)
    after = request.query_params.get("after")
    if after is not None:
        try:
            validate_session_id(after)
        except ValueError:
            raise ProtocolError("after: a session id from next_after") from None
    return limit, after


async def list_sessions(
    services: Services, namespace: str, *, limit: int, after: str | None
) -> SessionList:
    """One page of ``namespace``'s sessions: at most ``limit`` entries looked at."""
    page, next_after = await services.owners.page(namespace, after=after, limit=limit)
    sessions: list[SessionInfo] = []
    for owner in page:
        session_id = owner.session_id
        record = await services.manager.record(session_id)
        saved = await services.manager.current_checkpoint(session_id) is not None
        if record is None and not saved:
            continue
        sessions.append(
            SessionInfo(
                session_id=session_id,
                user_id=owner.user_id,
                hint=owner.hint,
                state=record.state if record else "saved",
                has_checkpoint=saved,
                updated_at_s=record.updated_at_s if record else None,
            )
        )
    return SessionList(sessions=sessions, next_after=next_after)
