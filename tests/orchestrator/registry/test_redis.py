"""RedisRegistry specifics: the documented key layout, error mapping, client handling."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest
import redis.asyncio

from sandcell_orchestrator.errors import RegistryError
from sandcell_orchestrator.registry import RedisRegistry, SessionRecord
from sandcell_orchestrator.registry.redis import (
    DELETE_LUA,
    PUT_LUA,
    RELEASE_LUA,
    RENEW_LUA,
)

MakeRecord = Callable[..., SessionRecord]


async def test_key_layout(
    client: redis.asyncio.Redis, prefix: str, sid: str, make_record: MakeRecord
) -> None:
    """Keys are exactly those the module docstring documents, all under the prefix."""
    registry = RedisRegistry(client, prefix=prefix)
    lease = await registry.acquire_lock(sid, ttl_ms=10_000)
    assert lease is not None
    record = make_record(sid, generation=await registry.next_generation(sid))
    await registry.put(lease, record)
    await registry.touch(sid, at_s=123.5)

    keys = sorted([key.decode() async for key in client.scan_iter(match=f"{prefix}*")])
    assert keys == sorted(
        [
            f"{prefix}gen:{sid}",
            f"{prefix}last_seen",
            f"{prefix}lock:{sid}",
            f"{prefix}record:{sid}",
            f"{prefix}sessions",
        ]
    )
    assert await client.get(f"{prefix}lock:{sid}") == lease.token.encode()
    assert 0 < await client.pttl(f"{prefix}lock:{sid}") <= 10_000
    assert SessionRecord.from_json(await client.get(f"{prefix}record:{sid}")) == record
    assert await client.get(f"{prefix}gen:{sid}") == b"1"
    assert await client.smembers(f"{prefix}sessions") == {sid.encode()}
    assert await client.zscore(f"{prefix}last_seen", sid) == 123.5

    await registry.delete(lease, sid, generation=1)
    assert await registry.release(lease)
    keys = sorted([key.decode() async for key in client.scan_iter(match=f"{prefix}*")])
    assert keys == [f"{prefix}gen:{sid}"]


def test_scripts_document_their_keys_and_args() -> None:
    """Every Lua script names what KEYS and ARGV carry (in the source, above it)."""
    import inspect

    from sandcell_orchestrator.registry import redis as module

    source = inspect.getsource(module)
    for name, script in [
        ("RENEW_LUA", RENEW_LUA),
        ("RELEASE_LUA", RELEASE_LUA),
        ("PUT_LUA", PUT_LUA),
        ("DELETE_LUA", DELETE_LUA),
    ]:
        before = source[: source.index(f"{name} = ")].rsplit("\n\n", 1)[-1]
        assert "# KEYS[1]" in before, name
        assert "ARGV[1]" in before, name
        assert "KEYS[1]" in script


async def test_works_with_decode_responses(
    redis_url: str, prefix: str, sid: str, make_record: MakeRecord
) -> None:
    """A shared client configured with decode_responses=True works the same."""
    client = redis.asyncio.Redis.from_url(redis_url, decode_responses=True)
    try:
        registry = RedisRegistry(client, prefix=prefix)
        lease = await registry.acquire_lock(sid, ttl_ms=10_000)
        assert lease is not None
        assert await registry.renew(lease, ttl_ms=10_000)
        record = make_record(sid, generation=await registry.next_generation(sid))
        await registry.put(lease, record)
        await registry.touch(sid, at_s=1.0)
        assert await registry.get(sid) == record
        assert await registry.list_records() == [record]
        assert await registry.idle_sessions(older_than_s=0, now_s=2.0) == [sid]
        assert await registry.current_generation(sid) == 1
        assert await registry.release(lease)
    finally:
        await client.aclose()


async def test_corrupt_generation_counter_fails_closed(
    client: redis.asyncio.Redis, prefix: str, sid: str, make_record: MakeRecord
) -> None:
    """A garbage counter is an error, never generation 0 (that would unfence stale writers)."""
    registry = RedisRegistry(client, prefix=prefix)
    lease = await registry.acquire_lock(sid, ttl_ms=10_000)
    assert lease is not None
    await client.set(f"{prefix}gen:{sid}", b"not a number")
    with pytest.raises(RegistryError, match="corrupt"):
        await registry.current_generation(sid)
    with pytest.raises(RegistryError):
        await registry.next_generation(sid)
    with pytest.raises(RegistryError):
        await registry.put(lease, make_record(sid, generation=5))
    assert await registry.get(sid) is None


async def test_unreachable_redis_raises_registry_error(sid: str) -> None:
    """Connection failures come out as RegistryError (retryable), never as redis-py's own."""
    registry = RedisRegistry.from_url("redis://127.0.0.1:1/0", socket_timeout_s=0.5)
    try:
        with pytest.raises(RegistryError) as caught:
            await registry.acquire_lock(sid, ttl_ms=1_000)
        assert caught.value.retryable
        assert isinstance(caught.value.__cause__, redis.exceptions.ConnectionError)
        with pytest.raises(RegistryError):
            await registry.get(sid)
    finally:
        await registry.close()


def test_repr_hides_the_url() -> None:
    """The client's URL may carry a password; the registry's repr does not show it."""
    registry = RedisRegistry.from_url("redis://:hunter2@127.0.0.1:1/0", prefix="p:")
    assert "hunter2" not in repr(registry)
    assert repr(registry) == "RedisRegistry(prefix='p:')"


async def test_close_leaves_a_shared_client_open(
    client: redis.asyncio.Redis, prefix: str, sid: str
) -> None:
    """A registry built on a caller's client does not close it."""
    registry = RedisRegistry(client, prefix=prefix)
    await registry.close()
    assert await client.ping()


def test_embedded_default_does_not_import_redis() -> None:
    """Importing the registry package (and the in-process backend) leaves redis unloaded."""
    code = (
        "import sys\n"
        "from sandcell_orchestrator.registry import InProcessRegistry, hold_session\n"
        "assert 'redis' not in sys.modules, sorted(m for m in sys.modules if 'redis' in m)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
