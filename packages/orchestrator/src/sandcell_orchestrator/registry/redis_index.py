"""The session index in Redis (``SessionIndex`` of ``RedisRegistry``).

<prefix>owners          hash    id -> SessionOwner JSON (the session index)
<prefix>nsids:<sha256>  zset    ids indexed for one namespace, all scored 0 so they
                                sort by id (hashed: any text); a listing pages it
                                with ZRANGEBYLEX
<prefix>ns:<sha256>     set     the same, as orchestrators before the zset kept it

The namespace's ids used to be a set, which can only be read whole; the zset can be
read a page at a time. A set left by an older orchestrator (or written by one still
running during a rolling upgrade) is moved into the zset, and deleted, by the listing
itself (``PAGE_IDS_LUA``), atomically, so no id is lost or listed from both; removals
take an id out of both keys, so the move cannot bring a removed id back. An older
orchestrator's removal takes it out of the set only; the listing that finds its owner
gone takes it out of the zset too (``PRUNE_IDS_LUA``).
"""

from __future__ import annotations

import logging
from functools import cached_property

import msgspec
from redis.commands.core import AsyncScript

from ..tenants import tenant_digest
from .core import validate_session_id
from .index import SessionOwner, check_page_limit
from .redis_db import RedisDatabase, map_redis_errors, moving_page_lua, text

__all__ = ["PAGE_IDS_LUA", "PRUNE_IDS_LUA", "RedisSessionIndex"]

logger = logging.getLogger(__name__)

# KEYS[1] the namespace's zset, KEYS[2] its legacy set
# ARGV[1] where the page starts ('-', or '(' and the id it follows), ARGV[2] how many ids
# (-1: all)
# Moves the legacy set's ids into the zset (score 0) and deletes the set, then returns
# the page of ids. One script, so an id is in one key or the other, never neither.
PAGE_IDS_LUA = moving_page_lua("redis.call('smembers', KEYS[2])")

# KEYS[1] the namespace's zset, KEYS[2] the owners hash
# ARGV[1], ARGV[2]... ids a page found without an owner
# Takes out of the zset each id that still has no owner: an older orchestrator's
# unindex leaves the id there (it knows only the legacy set), and every listing would
# read past it again. Checked in the script, so an id indexed again meanwhile stays.
PRUNE_IDS_LUA = """
local pruned = 0
for i = 1, #ARGV do
    if redis.call('hexists', KEYS[2], ARGV[i]) == 0 then
        pruned = pruned + redis.call('zrem', KEYS[1], ARGV[i])
    end
end
return pruned
"""


class RedisSessionIndex(RedisDatabase):
    """``SessionIndex`` on ``<prefix>owners`` and one sorted set per namespace."""

    @cached_property
    def _page_ids(self) -> AsyncScript:
        return self._client.register_script(PAGE_IDS_LUA)

    @cached_property
    def _prune_ids(self) -> AsyncScript:
        return self._client.register_script(PRUNE_IDS_LUA)

    def _namespace_key(self, namespace: str) -> str:
        return f"{self._prefix}nsids:{tenant_digest(namespace)}"

    def _legacy_namespace_key(self, namespace: str) -> str:
        return f"{self._prefix}ns:{tenant_digest(namespace)}"

    async def index_session(self, owner: SessionOwner) -> None:
        """``HSET owners`` + ``ZADD`` to the namespace's zset, in one transaction."""
        previous = await self.session_owner(owner.session_id)
        with map_redis_errors("index_session"):
            async with self._client.pipeline(transaction=True) as pipe:
                if previous is not None and previous.namespace != owner.namespace:
                    pipe.zrem(self._namespace_key(previous.namespace), owner.session_id)
                    pipe.srem(self._legacy_namespace_key(previous.namespace), owner.session_id)
                pipe.hset(f"{self._prefix}owners", owner.session_id, owner.to_json())
                pipe.zadd(self._namespace_key(owner.namespace), {owner.session_id: 0})
                await pipe.execute()

    async def session_owner(self, session_id: str) -> SessionOwner | None:
        """``HGET owners``; ``None`` if missing or unreadable."""
        validate_session_id(session_id)
        with map_redis_errors("session_owner"):
            raw = await self._client.hget(f"{self._prefix}owners", session_id)
        return None if raw is None else _decode_owner(raw)

    async def sessions_of(
        self, namespace: str, *, after: str | None = None, limit: int | None = None
    ) -> list[SessionOwner]:
        """A page of the namespace's zset (``PAGE_IDS_LUA``), then ``HMGET owners``.

        Entries that are unreadable or now another namespace's are skipped, and the
        zset is read on past them until ``limit`` are found or it ends: a short page
        has to mean the end, else the listing would stop there. Ids without an owner
        (an older orchestrator's unindex) are taken out of the zset (``PRUNE_IDS_LUA``).
        """
        check_page_limit(limit)
        keys = [self._namespace_key(namespace), self._legacy_namespace_key(namespace)]
        owners: list[SessionOwner] = []
        start = after
        with map_redis_errors("sessions_of"):
            while limit is None or len(owners) < limit:
                wanted = -1 if limit is None else limit - len(owners)
                replies = await self._page_ids(
                    keys=keys, args=["-" if start is None else f"({start}", wanted]
                )
                session_ids = [text(reply) for reply in replies]
                if not session_ids:
                    break
                raws = await self._client.hmget(f"{self._prefix}owners", session_ids)
                missing: list[str] = []
                for session_id, raw in zip(session_ids, raws, strict=True):
                    if raw is None:
                        missing.append(session_id)
                        continue
                    found = _decode_owner(raw)
                    if found is not None and found.namespace == namespace:
                        owners.append(found)
                if missing:
                    await self._prune_ids(keys=[keys[0], f"{self._prefix}owners"], args=missing)
                if wanted < 0 or len(session_ids) < wanted:
                    break
                start = session_ids[-1]
        return owners

    async def unindex_session(self, session_id: str) -> None:
        """``HDEL owners`` and ``ZREM`` (and ``SREM`` from a legacy set) from its namespace's."""
        previous = await self.session_owner(session_id)
        with map_redis_errors("unindex_session"):
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.hdel(f"{self._prefix}owners", session_id)
                if previous is not None:
                    pipe.zrem(self._namespace_key(previous.namespace), session_id)
                    pipe.srem(self._legacy_namespace_key(previous.namespace), session_id)
                await pipe.execute()


def _decode_owner(raw: bytes | str) -> SessionOwner | None:
    try:
        return SessionOwner.from_json(raw)
    except (msgspec.DecodeError, ValueError):
        logger.warning("a session index entry is unreadable; skipping it")
        return None
