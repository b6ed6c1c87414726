"""``backend``: every registry backend an E2B test runs against (Redis the real
redis-server, each test under a prefix of its own, its keys deleted after). A test
module imports ``backend`` (and ``redis_url``, which it uses) to have the fixture."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sandcell_orchestrator.registry import (
    InProcessRegistry,
    RedisRegistry,
    SessionRegistry,
    SqliteRegistry,
)
from tests.orchestrator.conftest import redis_url

__all__ = ["backend", "redis_url"]


@pytest.fixture(params=["memory", "sqlite", "redis"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[SessionRegistry]:
    registry: SessionRegistry
    if request.param == "memory":
        registry = InProcessRegistry()
    elif request.param == "sqlite":
        registry = SqliteRegistry(tmp_path / "registry.sqlite3")
    else:
        url: str = request.getfixturevalue("redis_url")
        registry = RedisRegistry.from_url(url, prefix=f"e2b-{uuid.uuid4().hex}:")
    yield registry
    if isinstance(registry, RedisRegistry):
        client = registry._client
        keys = [key async for key in client.scan_iter(match=f"{registry.prefix}*")]
        if keys:
            await client.delete(*keys)
    await registry.close()
