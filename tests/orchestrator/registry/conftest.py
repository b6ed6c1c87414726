"""Fixtures for the registry contract suite: one registry per backend, and a backdoor.

The Redis backend talks to the real redis-server that ``scripts/services``
starts (``SANDCELL_TEST_REDIS_URL``); each test gets its own key prefix, deleted
afterwards. Run by hand without that variable, the suite starts a private
redis-server if the binary is installed, and fails otherwise: a registry suite
that silently skipped Redis would pass while proving nothing about production.
"""

from __future__ import annotations

import contextlib
import sqlite3
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio

from sandcell_orchestrator.errors import RegistryError
from sandcell_orchestrator.registry import (
    InProcessRegistry,
    Lease,
    RedisRegistry,
    SessionRecord,
    SessionRegistry,
    SqliteRegistry,
)
from sandcell_protocol import runtime_session_id


@dataclass
class Backdoor:
    """Out-of-band changes a real deployment suffers: corruption, a vanished lock."""

    registry: SessionRegistry

    async def corrupt_record(self, session_id: str, raw: bytes) -> None:
        if isinstance(self.registry, SqliteRegistry):
            # Another process's connection: what a second sandcell would do.
            await self.registry.current_generation(session_id)  # creates the schema
            with contextlib.closing(sqlite3.connect(self.registry.path)) as db, db:
                db.execute("INSERT OR REPLACE INTO records VALUES (?, ?)", (session_id, raw))
            return
        if isinstance(self.registry, InProcessRegistry):
            self.registry._records[session_id] = raw
            return
        assert isinstance(self.registry, RedisRegistry)
        prefix = self.registry.prefix
        await self.registry._client.set(f"{prefix}record:{session_id}", raw)
        await self.registry._client.sadd(f"{prefix}sessions", session_id)

    async def drop_lock(self, session_id: str) -> None:
        if isinstance(self.registry, SqliteRegistry):
            with contextlib.closing(sqlite3.connect(self.registry.path)) as db, db:
                db.execute("DELETE FROM locks WHERE session_id = ?", (session_id,))
            return
        if isinstance(self.registry, InProcessRegistry):
            self.registry._locks.pop(session_id, None)
            return
        assert isinstance(self.registry, RedisRegistry)
        await self.registry._client.delete(f"{self.registry.prefix}lock:{session_id}")


def _new_session_id() -> str:
    return runtime_session_id("tenant", "user", uuid.uuid4().hex)


def _make_record(session_id: str, *, generation: int, **changes: object) -> SessionRecord:
    fields: dict[str, object] = {
        "session_id": session_id,
        "provider": "local",
        "sandbox_id": "sbx-1",
        "sandbox_uuid": "0b6b1c2e-7d0e-4f4e-9a37-1d2c3b4a5f60",
        "endpoint": "http://127.0.0.1:8123",
        "generation": generation,
        "checkpoint_key": f"checkpoints/{session_id}.tar.gz",
        "state": "active",
        "created_at_s": 1_700_000_000.0,
        "updated_at_s": 1_700_000_000.0,
    }
    fields.update(changes)
    return SessionRecord(**fields)  # type: ignore[arg-type]


class FlakyRenew:
    """Delegates to ``inner``, but its first ``failures`` renewals (all if None) raise."""

    def __init__(self, inner: SessionRegistry, *, failures: int | None) -> None:
        self._inner = inner
        self._failures = failures
        self.renew_calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def renew(self, lease: Lease, *, ttl_ms: int) -> bool:
        self.renew_calls += 1
        if self._failures is None or self.renew_calls <= self._failures:
            raise RegistryError("injected: connection reset")
        return await self._inner.renew(lease, ttl_ms=ttl_ms)


@pytest.fixture(params=["memory", "sqlite", "redis"])
async def registry(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[SessionRegistry]:
    """Each contract test runs against every backend."""
    if request.param == "memory":
        memory = InProcessRegistry()
        yield memory
        await memory.close()
        return
    if request.param == "sqlite":
        embedded = SqliteRegistry(tmp_path / "registry.sqlite3")
        yield embedded
        await embedded.close()
        return
    url = request.getfixturevalue("redis_url")
    prefix = f"sandcell-test:{uuid.uuid4().hex}:"
    client = redis.asyncio.Redis.from_url(url)
    registry = RedisRegistry(client, prefix=prefix)
    try:
        yield registry
    finally:
        await registry.close()
        keys = [key async for key in client.scan_iter(match=f"{prefix}*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()


@pytest.fixture
def backdoor(registry: SessionRegistry) -> Backdoor:
    return Backdoor(registry)


@pytest.fixture
def sid() -> str:
    """A fresh runtime session id."""
    return _new_session_id()


@pytest.fixture
def new_session_id() -> Callable[[], str]:
    """Factory of fresh runtime session ids."""
    return _new_session_id


@pytest.fixture
def make_record() -> Callable[..., SessionRecord]:
    """Factory of valid records: ``make_record(session_id, generation=1, **changes)``."""
    return _make_record


@pytest.fixture
def flaky_renew() -> type[FlakyRenew]:
    """The FlakyRenew wrapper class."""
    return FlakyRenew


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[redis.asyncio.Redis]:
    """A client of the test Redis (the Redis backend tests read keys directly)."""
    client = redis.asyncio.Redis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
async def prefix(client: redis.asyncio.Redis) -> AsyncIterator[str]:
    """A key prefix of the test's own, its keys deleted afterwards."""
    prefix = f"sandcell-test:{uuid.uuid4().hex}:"
    yield prefix
    keys = [key async for key in client.scan_iter(match=f"{prefix}*")]
    if keys:
        await client.delete(*keys)
