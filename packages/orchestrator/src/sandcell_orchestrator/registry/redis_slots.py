"""Fleet-wide slots in Redis (``SlotCounter`` of ``RedisRegistry``).

    <prefix>slots:<scope>  zset    token -> expiry (Redis server time, ms); the key
                                   itself expires with its last slot

Expiry is read from the Redis server's clock (``TIME``), the one clock every
worker shares, so skewed worker clocks neither free slots early nor keep them.
"""

from __future__ import annotations

from functools import cached_property

from redis.commands.core import AsyncScript

from .core import check_ttl
from .redis_db import RedisDatabase, map_redis_errors
from .slots import validate_slot_scope

__all__ = ["ACQUIRE_SLOT_LUA", "RENEW_SLOT_LUA", "RedisSlots"]

# KEYS[1] the scope's zset
# ARGV[1] token, ARGV[2] limit, ARGV[3] ttl in ms
# Returns 1 if the slot was taken, 0 if ``limit`` live slots are held.
ACQUIRE_SLOT_LUA = """
local now = redis.call('time')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
redis.call('zremrangebyscore', KEYS[1], '-inf', now_ms)
if redis.call('zcard', KEYS[1]) >= tonumber(ARGV[2]) then
    return 0
end
redis.call('zadd', KEYS[1], now_ms + tonumber(ARGV[3]), ARGV[1])
local last = redis.call('zrange', KEYS[1], -1, -1, 'WITHSCORES')
redis.call('pexpireat', KEYS[1], tonumber(last[2]))
return 1
"""

# KEYS[1] the scope's zset
# ARGV[1] token, ARGV[2] ttl in ms
# Returns 1 if the live slot was extended, 0 if it lapsed (or was never taken).
RENEW_SLOT_LUA = """
local now = redis.call('time')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local until_ms = redis.call('zscore', KEYS[1], ARGV[1])
if not until_ms or tonumber(until_ms) <= now_ms then
    return 0
end
redis.call('zadd', KEYS[1], now_ms + tonumber(ARGV[2]), ARGV[1])
local last = redis.call('zrange', KEYS[1], -1, -1, 'WITHSCORES')
redis.call('pexpireat', KEYS[1], tonumber(last[2]))
return 1
"""

# KEYS[1] the scope's zset
# ARGV[1] (none used)
# Returns how many live slots the scope has.
COUNT_SLOTS_LUA = """
local now = redis.call('time')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
redis.call('zremrangebyscore', KEYS[1], '-inf', now_ms)
return redis.call('zcard', KEYS[1])
"""


class RedisSlots(RedisDatabase):
    """``SlotCounter`` on one sorted set per scope."""

    @cached_property
    def _acquire_slot(self) -> AsyncScript:
        return self._client.register_script(ACQUIRE_SLOT_LUA)

    @cached_property
    def _renew_slot(self) -> AsyncScript:
        return self._client.register_script(RENEW_SLOT_LUA)

    @cached_property
    def _count_slots(self) -> AsyncScript:
        return self._client.register_script(COUNT_SLOTS_LUA)

    def _slots_key(self, scope: str) -> str:
        return f"{self._prefix}slots:{validate_slot_scope(scope)}"

    async def acquire_slot(self, scope: str, *, token: str, limit: int, ttl_ms: int) -> bool:
        """``ACQUIRE_SLOT_LUA``: drop lapsed slots, then take one if there is room."""
        check_ttl(ttl_ms)
        with map_redis_errors("acquire_slot"):
            taken = await self._acquire_slot(
                keys=[self._slots_key(scope)], args=[token, limit, ttl_ms]
            )
        return bool(taken)

    async def renew_slot(self, scope: str, *, token: str, ttl_ms: int) -> bool:
        """``RENEW_SLOT_LUA``."""
        check_ttl(ttl_ms)
        with map_redis_errors("renew_slot"):
            renewed = await self._renew_slot(keys=[self._slots_key(scope)], args=[token, ttl_ms])
        return bool(renewed)

    async def release_slot(self, scope: str, *, token: str) -> None:
        """``ZREM``."""
        with map_redis_errors("release_slot"):
            await self._client.zrem(self._slots_key(scope), token)

    async def slots_held(self, scope: str) -> int:
        """``COUNT_SLOTS_LUA``."""
        with map_redis_errors("slots_held"):
            return int(await self._count_slots(keys=[self._slots_key(scope)], args=[]))
