"""``RedisRegistry``: the session registry in Redis (production).

Key layout, every key under ``prefix`` (default ``"sandcell:"``); ``<sid>`` is a
runtime session id (``rt_`` + 64 hex digits, validated before it reaches a key):

    <prefix>lock:<sid>     string  the holder's random token; SET NX PX, expires
    <prefix>record:<sid>   string  the SessionRecord as JSON (msgspec)
    <prefix>gen:<sid>      string  generation counter (INCR); never deleted, so
                                   fencing survives a session's re-creation
    <prefix>sessions       set     ids that have a record (feeds list_records
                                   without a keyspace SCAN)
    <prefix>last_seen      zset    id -> wall-clock seconds of last use (idle sweeper)

and, in the feature modules beside this one: the session index
(``redis_index``: ``owners``, ``nsids:<sha256>``, and ``ns:<sha256>`` as older
orchestrators kept it), idempotency keys
(``redis_idempotency``: ``idem:<key>``) and the E2B sandbox table
(``redis_e2b``, its scripts in ``redis_e2b_scripts``: ``e2b:<id>``, ``e2b_all``,
``e2b_ends``, ``e2b_nsids:<sha256>``, ``e2b_nsstart:<sha256>``, ``e2b_nsrun:<sha256>``,
and ``e2b_ns:<sha256>`` as older orchestrators kept it) and fleet-wide
slots (``redis_slots``: ``slots:<scope>``).

Locks are taken with ``SET NX PX``; renew, release, and every write go through
the Lua scripts below, so "is the lock still mine, is my generation current"
and the write are one atomic step. The scripts touch a session's keys together
with the two shared keys, so this layout needs a single Redis (or a primary
behind Sentinel), not Redis Cluster.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any

import redis.asyncio

from ..errors import LockLostError, RegistryError
from .core import (
    FencedError,
    Lease,
    SessionRecord,
    _CorruptRecordLog,
    check_floor,
    check_ttl,
    validate_session_id,
)
from .idempotency import IdempotentAnswer
from .redis_db import DEFAULT_PREFIX, RedisDatabase, map_redis_errors, text
from .redis_e2b import RedisE2bTable
from .redis_idempotency import RedisIdempotency
from .redis_index import RedisSessionIndex
from .redis_slots import RedisSlots

__all__ = ["DEFAULT_PREFIX", "RedisRegistry"]

logger = logging.getLogger(__name__)

_MGET_CHUNK = 256

# KEYS[1] lock key
# ARGV[1] token, ARGV[2] ttl in ms
# Returns 1 if the TTL was reset, 0 if the lock is not ours.
RENEW_LUA = """
if redis.call('get', KEYS[1]) == ARGV[1] then
    return redis.call('pexpire', KEYS[1], ARGV[2])
end
return 0
"""

# KEYS[1] lock key
# ARGV[1] token
# Returns 1 if the lock was deleted, 0 if it is not ours.
RELEASE_LUA = """
if redis.call('get', KEYS[1]) == ARGV[1] then
    return redis.call('del', KEYS[1])
end
return 0
"""

# KEYS[1] generation key
# ARGV[1] floor: the result is greater than it, whatever the counter held
# Returns the new generation.
NEXT_GENERATION_LUA = """
local current = tonumber(redis.call('get', KEYS[1]) or '0')
local floor = tonumber(ARGV[1])
if current < floor then
    current = floor
end
current = current + 1
redis.call('set', KEYS[1], current)
return current
"""

# KEYS[1] lock key, KEYS[2] generation key, KEYS[3] record key, KEYS[4] sessions set,
# optionally KEYS[5] an idempotency key whose answer this write stores (the turn's)
# ARGV[1] token, ARGV[2] the record's generation, ARGV[3] record JSON, ARGV[4] session id;
# with KEYS[5]: ARGV[5] its claim token, ARGV[6] status, ARGV[7] body, ARGV[8] ttl in ms
# Returns {1, current}: written; {0, 0}: lock not ours; {-1, current}: stale generation.
# The answer is stored (as FINISH_IDEMPOTENCY_LUA would) only if the claim is still the
# caller's; one script, so the record and its turn's answer are written together or not.
PUT_LUA = """
if redis.call('get', KEYS[1]) ~= ARGV[1] then
    return {0, 0}
end
local current = tonumber(redis.call('get', KEYS[2]) or '0')
if tonumber(ARGV[2]) < current then
    return {-1, current}
end
redis.call('set', KEYS[3], ARGV[3])
redis.call('sadd', KEYS[4], ARGV[4])
if KEYS[5] and redis.call('hget', KEYS[5], 'token') == ARGV[5] then
    redis.call('hset', KEYS[5], 'done', '1', 'status', ARGV[6], 'body', ARGV[7])
    redis.call('pexpire', KEYS[5], ARGV[8])
end
return {1, current}
"""

# KEYS[1] lock key, KEYS[2] generation key, KEYS[3] record key, KEYS[4] sessions set,
# KEYS[5] last-seen zset
# ARGV[1] token, ARGV[2] the caller's generation, ARGV[3] session id
# Returns {1, current}: deleted; {0, 0}: lock not ours; {-1, current}: stale generation.
DELETE_LUA = """
if redis.call('get', KEYS[1]) ~= ARGV[1] then
    return {0, 0}
end
local current = tonumber(redis.call('get', KEYS[2]) or '0')
if tonumber(ARGV[2]) < current then
    return {-1, current}
end
redis.call('del', KEYS[3])
redis.call('srem', KEYS[4], ARGV[3])
redis.call('zrem', KEYS[5], ARGV[3])
return {1, current}
"""


class RedisRegistry(RedisSessionIndex, RedisIdempotency, RedisE2bTable, RedisSlots, RedisDatabase):
    """A ``SessionRegistry`` in Redis, through a redis-py asyncio client.

    Pass a client to share a connection pool (the caller closes it), or use
    ``from_url`` to have ``close()`` close the client too. Works with clients
    with or without ``decode_responses``.
    """

    def __init__(
        self,
        client: redis.asyncio.Redis,
        *,
        prefix: str = DEFAULT_PREFIX,
        owns_client: bool = False,
    ) -> None:
        super().__init__(client, prefix=prefix, owns_client=owns_client)
        self._renew = client.register_script(RENEW_LUA)
        self._release = client.register_script(RELEASE_LUA)
        self._put = client.register_script(PUT_LUA)
        self._delete = client.register_script(DELETE_LUA)
        self._next_generation = client.register_script(NEXT_GENERATION_LUA)
        self._corrupt = _CorruptRecordLog(logger)

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        socket_timeout_s: float = 5.0,
    ) -> RedisRegistry:
        """A registry with its own client for ``url`` (``redis://host:port/db``)."""
        client = redis.asyncio.Redis.from_url(
            url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s
        )
        return cls(client, prefix=prefix, owns_client=True)

    def __repr__(self) -> str:
        # The client's repr can carry the URL, and with it a password.
        return f"RedisRegistry(prefix={self._prefix!r})"

    def _key(self, kind: str, session_id: str) -> str:
        return f"{self._prefix}{kind}:{session_id}"

    @property
    def _sessions_key(self) -> str:
        return f"{self._prefix}sessions"

    @property
    def _last_seen_key(self) -> str:
        return f"{self._prefix}last_seen"

    async def acquire_lock(self, session_id: str, *, ttl_ms: int) -> Lease | None:
        """``SET lock token NX PX ttl_ms``; ``None`` if someone holds the lock."""
        validate_session_id(session_id)
        check_ttl(ttl_ms)
        token = secrets.token_hex(16)
        with map_redis_errors("acquire_lock"):
            taken = await self._client.set(self._key("lock", session_id), token, nx=True, px=ttl_ms)
        if not taken:
            return None
        return Lease(session_id=session_id, token=token, ttl_ms=ttl_ms)

    async def renew(self, lease: Lease, *, ttl_ms: int) -> bool:
        """Compare-and-``PEXPIRE``: reset the TTL if the lock is still ``lease``'s."""
        check_ttl(ttl_ms)
        with map_redis_errors("renew"):
            result = await self._renew(
                keys=[self._key("lock", lease.session_id)], args=[lease.token, ttl_ms]
            )
        return bool(result)

    async def release(self, lease: Lease) -> bool:
        """Compare-and-delete: drop the lock if it is still ``lease``'s."""
        with map_redis_errors("release"):
            result = await self._release(
                keys=[self._key("lock", lease.session_id)], args=[lease.token]
            )
        return bool(result)

    async def next_generation(self, session_id: str, *, above: int = 0) -> int:
        """``INCR`` the generation counter (``NEXT_GENERATION_LUA`` when given a floor)."""
        validate_session_id(session_id)
        check_floor(above)
        key = self._key("gen", session_id)
        with map_redis_errors("next_generation"):
            if above == 0:
                return await self._client.incr(key)
            return int(await self._next_generation(keys=[key], args=[above]))

    async def current_generation(self, session_id: str) -> int:
        """The generation counter; 0 if never incremented."""
        validate_session_id(session_id)
        with map_redis_errors("current_generation"):
            raw = await self._client.get(self._key("gen", session_id))
        if raw is None:
            return 0
        try:
            return int(raw)
        except ValueError:
            # Unlike a record, a counter cannot be treated as missing: that
            # would reset fencing to 0 and let stale writers back in.
            raise RegistryError(f"generation counter of {session_id} is corrupt") from None

    async def get(self, session_id: str) -> SessionRecord | None:
        """The record; ``None`` if missing or corrupt."""
        validate_session_id(session_id)
        with map_redis_errors("get"):
            raw = await self._client.get(self._key("record", session_id))
        return None if raw is None else self._corrupt.decode(session_id, raw)

    async def put(
        self, lease: Lease, record: SessionRecord, *, answer: IdempotentAnswer | None = None
    ) -> None:
        """Store ``record``, fenced by ``lease`` and ``record.generation``, and ``answer``
        with it (``PUT_LUA``)."""
        session_id = record.session_id
        if lease.session_id != session_id:
            raise ValueError("the lease is for another session")
        keys = [
            self._key("lock", session_id),
            self._key("gen", session_id),
            self._key("record", session_id),
            self._sessions_key,
        ]
        args: list[str | int | bytes] = [lease.token, record.generation, record.to_json()]
        args.append(session_id)
        if answer is not None:
            keys.append(self._idem_key(answer.key))
            args += [answer.token, answer.status, bytes(answer.body), answer.ttl_ms]
        with map_redis_errors("put"):
            result = await self._put(keys=keys, args=args)
        _raise_if_refused(result, session_id=session_id, generation=record.generation)
        self._corrupt.repaired(session_id)

    async def delete(self, lease: Lease, session_id: str, *, generation: int) -> None:
        """Remove the record and last-seen entry, fenced like ``put`` (``DELETE_LUA``)."""
        validate_session_id(session_id)
        if lease.session_id != session_id:
            raise ValueError("the lease is for another session")
        with map_redis_errors("delete"):
            result = await self._delete(
                keys=[
                    self._key("lock", session_id),
                    self._key("gen", session_id),
                    self._key("record", session_id),
                    self._sessions_key,
                    self._last_seen_key,
                ],
                args=[lease.token, generation, session_id],
            )
        _raise_if_refused(result, session_id=session_id, generation=generation)
        self._corrupt.repaired(session_id)

    async def touch(self, session_id: str, *, at_s: float) -> None:
        """``ZADD GT``: move the last-seen time forward, never back (skewed writers)."""
        validate_session_id(session_id)
        with map_redis_errors("touch"):
            await self._client.zadd(self._last_seen_key, {session_id: at_s}, gt=True)

    async def idle_sessions(self, *, older_than_s: float, now_s: float) -> list[str]:
        """Sessions last seen at or before ``now_s - older_than_s``, oldest first."""
        with map_redis_errors("idle_sessions"):
            members = await self._client.zrangebyscore(
                self._last_seen_key, "-inf", now_s - older_than_s
            )
        return [text(member) for member in members if isinstance(member, bytes | str)]

    async def list_records(self) -> list[SessionRecord]:
        """Every readable record, by session id (index set, then ``MGET`` in chunks)."""
        with map_redis_errors("list_records"):
            members = await self._client.smembers(self._sessions_key)
            session_ids = sorted(text(member) for member in members)
            records: list[SessionRecord] = []
            for start in range(0, len(session_ids), _MGET_CHUNK):
                chunk = session_ids[start : start + _MGET_CHUNK]
                raws = await self._client.mget([self._key("record", sid) for sid in chunk])
                for session_id, raw in zip(chunk, raws, strict=True):
                    record = None if raw is None else self._corrupt.decode(session_id, raw)
                    if record is not None:
                        records.append(record)
        return records


def _raise_if_refused(result: Any, *, session_id: str, generation: int) -> None:
    status, current = int(result[0]), int(result[1])
    if status == 1:
        return
    if status == 0:
        raise LockLostError(f"lock on {session_id} is no longer held by this lease")
    raise FencedError(
        f"generation {generation} of {session_id} is older than the current {current}",
        generation=generation,
        current_generation=current,
    )
