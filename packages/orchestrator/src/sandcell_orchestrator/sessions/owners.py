"""``SessionOwners``: whose each runtime session is, kept where a registry wipe cannot reach.

Session records carry no tenant, so the serving surfaces index each session a tenant
names (``SessionIndex``, the registry's), and every listing and ownership check reads
that index. A registry that forgets everything (a Redis restarted without persistence,
flushed) forgets the index with it, while the sessions' checkpoints stay in the
snapshot store and each session comes back on its next turn (the newest object found).
So a session indexed anew also has its owner written to the store, under its tenant's
own prefix, and listings and ownership checks read that too:

    owners/<sha256 of the namespace>/<rt>     SessionOwner JSON

The prefix is the namespace's hash: a tenant's listing reads only its own prefix, and
an ownership check the registry cannot answer looks only for the caller's own object,
so no tenant ever sees or reaches another's session (DESIGN rule 8). A listing reads
one page of that prefix and one of the registry's index (``page``: at most
``limit + 1`` ids after the caller's ``after`` from each, S3's ``start-after`` and the
index's ``sessions_of(after=, limit=)``), never the whole of either.

Cost: a turn of a session the registry has indexed reads that entry (one HGET on
Redis) and writes nothing; a session indexed anew (its first turn, its first after a
wipe) pays one store put. A session indexed before owners were kept in the store
gets its object the next time it is indexed anew: until then a wipe drops it from
listings until its next turn, as before.
"""

from __future__ import annotations

import logging

import msgspec

from sandcell_protocol import is_runtime_session_id

from ..errors import CheckpointError
from ..registry import SessionIndex, SessionOwner, validate_session_id
from ..snapshots import SnapshotNotFoundError, SnapshotStore
from ..snapshots.whole import put_whole, read_whole
from ..tenants import tenant_digest

__all__ = ["OWNERS_PREFIX", "SessionOwners", "owner_key", "owners_prefix"]

log = logging.getLogger(__name__)

OWNERS_PREFIX = "owners/"
_OWNER_MAX_BYTES = 64 << 10
"""An owner is a session id, a namespace, a user id and a hint: well under this."""
_UNSAVED_MAX = 10_000
"""Sessions whose owner this process could not store, retried on their next turn."""


def owners_prefix(namespace: str) -> str:
    """Where the owners of ``namespace``'s sessions live: ``owners/<sha256>/``."""
    return f"{OWNERS_PREFIX}{tenant_digest(namespace)}/"


def owner_key(namespace: str, session_id: str) -> str:
    """The object of ``session_id``'s owner, under ``namespace``'s prefix."""
    return owners_prefix(namespace) + validate_session_id(session_id)


class SessionOwners:
    """The session index of ``index`` (the registry), kept in ``store`` as well."""

    def __init__(self, index: SessionIndex, store: SnapshotStore) -> None:
        self.index = index
        self.store = store
        self._unsaved: set[str] = set()

    def __repr__(self) -> str:
        return f"SessionOwners({self.store!r})"

    async def remember(self, owner: SessionOwner) -> None:
        """Index ``owner`` (a tenant named its session): in the registry, and in the store
        when the registry did not have it. A store that fails is logged, not raised (the
        turn needs only the registry's entry), and tried again on the session's next turn
        in this process."""
        session_id = owner.session_id
        if await self.index.session_owner(session_id) == owner and session_id not in self._unsaved:
            return
        try:
            await put_whole(
                self.store,
                owner_key(owner.namespace, session_id),
                owner.to_json(),
                max_bytes=_OWNER_MAX_BYTES,
            )
        except CheckpointError as exc:
            log.warning("owner of %s not stored: %s", session_id[:11], type(exc).__name__)
            if len(self._unsaved) >= _UNSAVED_MAX:
                self._unsaved.pop()
            self._unsaved.add(session_id)
        else:
            self._unsaved.discard(session_id)
        await self.index.index_session(owner)

    async def owns(self, namespace: str, session_id: str) -> bool:
        """Whether ``session_id`` is ``namespace``'s: the registry's entry, or, when the
        registry has none (wiped), the store's object under ``namespace``'s own prefix.

        Another tenant's session takes the path of one nobody has (the caller's own
        prefix is looked at): answered from the registry alone, it would come back
        sooner, and as a 404 where the store's failure makes a missing one a 5xx, which
        tells a tenant that the id it guessed exists (DESIGN rule 8)."""
        owner = await self.index.session_owner(session_id)
        if owner is not None and owner.namespace == namespace:
            return True
        return await self.store.exists(owner_key(namespace, session_id))

    async def page(
        self, namespace: str, *, after: str | None, limit: int
    ) -> tuple[list[SessionOwner], str | None]:
        """Up to ``limit`` of ``namespace``'s sessions with ids above ``after``, by id, as
        the registry's index and the store's objects know them together; and the
        ``after`` of the next page (``None`` on the last).

        Both are read one page at a time: at most ``limit + 1`` ids after ``after`` from
        each. Every id of a source up to the last it gave is among those it gave, so the
        page takes nothing past the smaller of the two lasts (of a source that gave all
        ``limit + 1``; one that gave fewer has no more): the other source's ids beyond it
        wait for the next page, where the first one's listing reaches them, and no id is
        skipped or listed twice across pages.
        """
        indexed_owners = await self.index.sessions_of(namespace, after=after, limit=limit + 1)
        indexed = {owner.session_id: owner for owner in indexed_owners}
        prefix = owners_prefix(namespace)
        entries = await self.store.list(
            prefix, start_after=None if after is None else prefix + after, limit=limit + 1
        )
        listed = [entry.key.removeprefix(prefix) for entry in entries]
        bounds: list[str] = []  # the last id of each source that has more past it
        if len(indexed_owners) > limit:
            bounds.append(indexed_owners[-1].session_id)
        if len(entries) > limit:
            bounds.append(listed[-1])
        bound = min(bounds, default=None)
        ids = sorted(
            session_id
            for session_id in set(indexed).union(filter(is_runtime_session_id, listed))
            if bound is None or session_id <= bound
        )
        chosen = ids[:limit]
        owners: list[SessionOwner] = []
        for session_id in chosen:
            owner = indexed.get(session_id) or await self._stored(namespace, session_id)
            if owner is not None:
                owners.append(owner)
        more = len(ids) > limit or bound is not None
        return owners, (chosen[-1] if more and chosen else None)

    async def forget(self, namespace: str, session_id: str) -> None:
        """Unindex a destroyed session: its store object, then its registry entry
        (either way round a failure leaves it owned, so the delete can be retried)."""
        await self.store.delete(owner_key(namespace, session_id))
        await self.index.unindex_session(session_id)

    async def _stored(self, namespace: str, session_id: str) -> SessionOwner | None:
        key = owner_key(namespace, session_id)
        try:
            owner = SessionOwner.from_json(
                await read_whole(self.store, key, max_bytes=_OWNER_MAX_BYTES)
            )
        except SnapshotNotFoundError:
            return None  # forgotten since the listing
        except (msgspec.DecodeError, ValueError):
            log.warning("the stored owner of %s is unreadable; skipping it", session_id[:11])
            return None
        if owner.session_id != session_id or owner.namespace != namespace:
            log.warning("the stored owner of %s names another session", session_id[:11])
            return None
        return owner
