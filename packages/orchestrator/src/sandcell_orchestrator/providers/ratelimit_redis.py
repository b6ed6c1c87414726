"""``RedisRateLimiter``: the token buckets of ``ratelimit`` in Redis, shared by every worker.

The Redis backend of ``RateLimiter`` (redis is imported only here); the bucket
logic is ``RATE_LIMIT_LUA``, run atomically on Redis's own clock.
"""

from __future__ import annotations

import logging
import math

import anyio
import redis.asyncio
import redis.exceptions

from .ratelimit import RATE_LIMIT_LUA, InProcessRateLimiter, Sleep, _refused

__all__ = ["RedisRateLimiter"]

log = logging.getLogger(__name__)


class RedisRateLimiter:
    """A token bucket per operation in Redis, shared by every worker using ``prefix``."""

    def __init__(
        self,
        client: redis.asyncio.Redis,
        *,
        tps: float,
        burst: float | None = None,
        max_wait_s: float = 10.0,
        prefix: str = "sandcell:tps:",
        owns_client: bool = False,
        sleep: Sleep = anyio.sleep,
    ) -> None:
        if tps <= 0:
            raise ValueError("tps must be positive")
        self.tps = tps
        self.burst = max(1.0, burst if burst is not None else tps)
        self.max_wait_s = max_wait_s
        self.prefix = prefix
        self._client = client
        self._owns_client = owns_client
        self._sleep = sleep
        self._script = client.register_script(RATE_LIMIT_LUA)
        self._fallback = InProcessRateLimiter(tps=tps, burst=burst, max_wait_s=max_wait_s)
        self._closed = False

    @classmethod
    def from_url(cls, url: str, *, tps: float, prefix: str = "sandcell:tps:") -> RedisRateLimiter:
        """A limiter with its own connection pool (closed by ``close``)."""
        client = redis.asyncio.Redis.from_url(url)
        return cls(client, tps=tps, prefix=prefix, owns_client=True)

    def __repr__(self) -> str:
        return f"RedisRateLimiter(prefix={self.prefix!r}, tps={self.tps}, burst={self.burst})"

    async def acquire(self, operation: str) -> None:
        """Return when a call to ``operation`` fits the shared budget."""
        # Idle buckets refill completely after burst/tps seconds; keep them a little longer.
        ttl_ms = max(1_000, math.ceil(self.burst / self.tps * 1000) * 2)
        try:
            wait_ms = int(
                await self._script(
                    keys=[self.prefix + operation],
                    args=[self.tps, self.burst, int(self.max_wait_s * 1000), ttl_ms],
                )
            )
        except (redis.exceptions.RedisError, OSError) as exc:
            log.warning(
                "rate limiter: Redis unavailable (%s); using an in-process bucket for %s",
                type(exc).__name__,
                operation,
            )
            await self._fallback.acquire(operation)
            return
        if wait_ms < 0:
            raise _refused(operation, self.max_wait_s)
        if wait_ms > 0:
            await self._sleep(wait_ms / 1000)

    async def close(self) -> None:
        """Close the connection pool if this limiter made it; idempotent."""
        if self._owns_client and not self._closed:
            self._closed = True
            await self._client.aclose()
