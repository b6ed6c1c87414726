"""``RedisDatabase``: the client, key prefix and error mapping of ``RedisRegistry``.

Each feature module (``redis``, ``redis_index``, ``redis_idempotency``,
``redis_e2b``) subclasses it; their Lua scripts are registered on first use.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import redis.asyncio
import redis.exceptions

from ..errors import RegistryError

__all__ = [
    "DEFAULT_PREFIX",
    "RedisDatabase",
    "legacy_move_lua",
    "map_redis_errors",
    "moving_page_lua",
    "text",
]

DEFAULT_PREFIX = "sandcell:"


def legacy_move_lua(legacy_members: str, *, ids: str = "KEYS[1]", legacy: str = "KEYS[2]") -> str:
    """Lua that moves a legacy key's ids into an ids zset (score 0) and deletes the key.

    ``ids`` and ``legacy`` name the two keys (Lua expressions); the legacy key is read
    by the Lua expression ``legacy_members`` (its type is the caller's: a set, a
    zset). The ids go in chunks of 1000 (Lua's ``unpack`` has a limit); in a script,
    so an id is in one key or the other, never neither."""
    return f"""
local legacy = {legacy_members}
for first = 1, #legacy, 1000 do
    local args = {{}}
    for i = first, math.min(first + 999, #legacy) do
        args[#args + 1] = 0
        args[#args + 1] = legacy[i]
    end
    redis.call('zadd', {ids}, unpack(args))
end
if #legacy > 0 then
    redis.call('del', {legacy})
end
"""


def moving_page_lua(legacy_members: str) -> str:
    """A script that moves a legacy key's ids into an ids zset, then pages the zset.

    KEYS[1] the ids zset (every score 0), KEYS[2] the legacy key, read by the Lua
    expression ``legacy_members`` (``legacy_move_lua``); ARGV[1] where the page starts
    (``-``, or ``(`` and the id it follows), ARGV[2] how many ids (-1: all). The move
    and the read are one script (the session index's pages by id).
    """
    return (
        legacy_move_lua(legacy_members)
        + "return redis.call('zrangebylex', KEYS[1], ARGV[1], '+', 'LIMIT', 0, ARGV[2])\n"
    )


@contextmanager
def map_redis_errors(operation: str) -> Iterator[None]:
    """Turn redis-py's errors into ``RegistryError``."""
    try:
        yield
    except (redis.exceptions.RedisError, OSError) as exc:
        # redis-py's messages name the host and the failure, never command arguments.
        raise RegistryError(f"redis {operation} failed: {type(exc).__name__}: {exc}") from exc


def text(value: bytes | str) -> str:
    """A reply as text, whether the client decodes responses or not."""
    return value.decode() if isinstance(value, bytes) else value


class RedisDatabase:
    """One redis-py asyncio client and the prefix every key of this registry starts with."""

    def __init__(
        self,
        client: redis.asyncio.Redis,
        *,
        prefix: str = DEFAULT_PREFIX,
        owns_client: bool = False,
    ) -> None:
        self._client = client
        self._prefix = prefix
        self._owns_client = owns_client
        self._closed = False

    @property
    def prefix(self) -> str:
        """The key prefix; see ``redis``'s module docstring for the layout under it."""
        return self._prefix

    async def close(self) -> None:
        """Close the client if this registry created it; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._owns_client:
            with map_redis_errors("close"):
                await self._client.aclose()
