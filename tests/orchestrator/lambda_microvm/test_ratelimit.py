"""Per-operation token buckets, in process and in a real Redis."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

import anyio
import pytest
import redis.asyncio

from sandcell_orchestrator.errors import SandboxUnavailableError
from sandcell_orchestrator.providers.ratelimit import (
    InProcessRateLimiter,
    RateLimiter,
    RedisRateLimiter,
)
from tests.fixtures.runner_process import free_port


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


async def test_burst_then_paced() -> None:
    """A full bucket admits ``burst`` calls at once, then one per 1/tps seconds."""
    fake = FakeTime()
    limiter = InProcessRateLimiter(tps=2, clock=fake.clock, sleep=fake.sleep)
    assert isinstance(limiter, RateLimiter)
    for _ in range(4):
        await limiter.acquire("RunMicrovm")
    assert fake.slept == [0.5, 0.5]


async def test_operations_have_separate_buckets() -> None:
    fake = FakeTime()
    limiter = InProcessRateLimiter(tps=1, clock=fake.clock, sleep=fake.sleep)
    await limiter.acquire("RunMicrovm")
    await limiter.acquire("GetMicrovm")
    assert fake.slept == []


async def test_reservations_queue_first_come_first_served() -> None:
    """Concurrent callers each get a later slot; none is refused within max_wait_s."""
    fake = FakeTime()
    limiter = InProcessRateLimiter(tps=10, burst=1, clock=fake.clock, sleep=fake.sleep)
    waits = [limiter.reserve("GetMicrovm") for _ in range(5)]
    assert waits == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])


async def test_a_wait_longer_than_max_wait_is_refused_and_reserves_nothing() -> None:
    fake = FakeTime()
    limiter = InProcessRateLimiter(tps=1, burst=1, max_wait_s=2, clock=fake.clock, sleep=fake.sleep)
    for _ in range(3):
        limiter.reserve("RunMicrovm")
    with pytest.raises(SandboxUnavailableError) as caught:
        limiter.reserve("RunMicrovm")
    assert caught.value.retryable
    fake.now += 1
    assert limiter.reserve("RunMicrovm") == pytest.approx(2.0)


# -- Redis ------------------------------------------------------------------------------


@pytest.fixture
async def redis_client(redis_url: str) -> AsyncIterator[redis.asyncio.Redis]:
    client = redis.asyncio.Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def test_workers_share_one_budget_in_redis(redis_client: redis.asyncio.Redis) -> None:
    """Two limiters (two workers) on one prefix: together they stay under the TPS."""
    prefix = f"sandcell-test:{uuid.uuid4().hex}:"
    one = RedisRateLimiter(redis_client, tps=5, burst=1, prefix=prefix)
    two = RedisRateLimiter(redis_client, tps=5, burst=1, prefix=prefix)
    started = time.monotonic()
    async with anyio.create_task_group() as tg:
        for limiter in (one, two) * 3:
            tg.start_soon(limiter.acquire, "RunMicrovm")
    # Six calls at 5/s with a burst of 1: the last one at ~1.0 s.
    assert time.monotonic() - started >= 0.9
    # The bucket expires once it would be full again: nothing accumulates in Redis.
    await anyio.sleep(1.1)
    assert not await redis_client.exists(prefix + "RunMicrovm")


async def test_redis_refuses_past_max_wait(redis_client: redis.asyncio.Redis) -> None:
    prefix = f"sandcell-test:{uuid.uuid4().hex}:"
    limiter = RedisRateLimiter(redis_client, tps=1, burst=1, max_wait_s=0.5, prefix=prefix)
    await limiter.acquire("GetMicrovm")
    with pytest.raises(SandboxUnavailableError):
        await limiter.acquire("GetMicrovm")
    await redis_client.delete(prefix + "GetMicrovm")


async def test_redis_down_falls_back_to_an_in_process_bucket(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Rate limiting is about speed: an unreachable Redis must not fail the call."""
    limiter = RedisRateLimiter.from_url(f"redis://127.0.0.1:{free_port()}/0", tps=100)
    try:
        with anyio.fail_after(10):
            await limiter.acquire("RunMicrovm")
    finally:
        await limiter.close()
        await limiter.close()
    assert "in-process bucket" in caplog.text
