"""Per-operation token buckets that keep control-plane calls under a TPS budget.

Cloud control planes limit each API per account, not per process, so with
several orchestrator workers the bucket lives in Redis (``RedisRateLimiter``, in
``ratelimit_redis``,
one Lua script per acquisition, Redis's own clock); embedded, it lives in this
process (``InProcessRateLimiter``). Both reserve a slot and sleep until it comes
round, so callers are served first come, first served, and a caller whose slot
is further away than ``max_wait_s`` is refused with a retryable
``SandboxUnavailableError`` instead of queueing without bound.

Rate limiting is about speed, not state: when Redis is unreachable the Redis
limiter falls back to an in-process bucket rather than failing the call.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import anyio

from ..errors import SandboxUnavailableError

if TYPE_CHECKING:
    from .ratelimit_redis import RedisRateLimiter

__all__ = [
    "RATE_LIMIT_LUA",
    "InProcessRateLimiter",
    "RateLimiter",
    "RedisRateLimiter",
]

log = logging.getLogger(__name__)

Sleep = Callable[[float], Awaitable[None]]


@runtime_checkable
class RateLimiter(Protocol):
    """Waits until an ``operation`` may be called; raises if the wait would be too long."""

    async def acquire(self, operation: str) -> None:
        """Return when a call to ``operation`` fits the budget."""
        ...

    async def close(self) -> None:
        """Release connections; idempotent."""
        ...


def _refused(operation: str, wait_s: float) -> SandboxUnavailableError:
    return SandboxUnavailableError(
        f"{operation}: control-plane call budget exhausted (next slot in {wait_s:.1f}s); "
        "retry later"
    )


@dataclass(slots=True)
class _Bucket:
    tokens: float
    updated: float


class InProcessRateLimiter:
    """A token bucket per operation, in this process (one event loop)."""

    def __init__(
        self,
        *,
        tps: float,
        burst: float | None = None,
        max_wait_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Sleep = anyio.sleep,
    ) -> None:
        if tps <= 0:
            raise ValueError("tps must be positive")
        self.tps = tps
        self.burst = max(1.0, burst if burst is not None else tps)
        self.max_wait_s = max_wait_s
        self._clock = clock
        self._sleep = sleep
        self._buckets: dict[str, _Bucket] = {}

    def __repr__(self) -> str:
        return f"InProcessRateLimiter(tps={self.tps}, burst={self.burst})"

    def reserve(self, operation: str) -> float:
        """Take a slot now and return how long to wait for it (no slot taken if refused)."""
        now = self._clock()
        bucket = self._buckets.get(operation)
        if bucket is None:
            bucket = self._buckets[operation] = _Bucket(tokens=self.burst, updated=now)
        bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.updated) * self.tps)
        bucket.updated = now
        wait_s = max(0.0, (1.0 - bucket.tokens) / self.tps)
        if wait_s > self.max_wait_s:
            raise _refused(operation, wait_s)
        # Going negative is the reservation: later callers queue behind this one.
        bucket.tokens -= 1.0
        return wait_s

    async def acquire(self, operation: str) -> None:
        """Return when a call to ``operation`` fits the budget."""
        wait_s = self.reserve(operation)
        if wait_s > 0:
            await self._sleep(wait_s)

    async def close(self) -> None:
        """Nothing to release."""


# KEYS[1] the operation's bucket (a hash: tokens, ts_ms)
# ARGV[1] rate in tokens per second, ARGV[2] burst capacity,
# ARGV[3] longest acceptable wait in ms, ARGV[4] key TTL in ms
# Returns the ms to wait before calling (0 = now), or -1 if that would exceed
# ARGV[3] (then nothing is reserved). Redis's clock is the one every worker shares.
RATE_LIMIT_LUA = """
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local now_parts = redis.call('TIME')
local now = tonumber(now_parts[1]) * 1000 + math.floor(tonumber(now_parts[2]) / 1000)
local tokens = tonumber(redis.call('HGET', KEYS[1], 'tokens'))
local updated = tonumber(redis.call('HGET', KEYS[1], 'ts_ms'))
if tokens == nil or updated == nil then
    tokens = burst
    updated = now
end
tokens = math.min(burst, tokens + math.max(0, now - updated) * rate / 1000)
local wait = 0
if tokens < 1 then
    wait = math.ceil((1 - tokens) * 1000 / rate)
end
if wait > tonumber(ARGV[3]) then
    return -1
end
tokens = tokens - 1
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts_ms', tostring(now))
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return wait
"""


def __getattr__(name: str) -> object:
    # The Redis bucket loads on first use: a MicroVM provider without a Redis URL
    # (and the embedded default) must not import redis.
    if name == "RedisRateLimiter":
        from .ratelimit_redis import RedisRateLimiter

        return RedisRateLimiter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
