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

__all__ = ["DEFAULT_PREFIX", "RedisDatabase", "map_redis_errors", "text"]

DEFAULT_PREFIX = "sandcell:"


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
