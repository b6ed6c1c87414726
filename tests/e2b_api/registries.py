"""``backend``: every registry backend an E2B test runs against (Redis the real
redis-server, each test under a prefix of its own, its keys deleted after). A test
module imports ``backend`` (and ``redis_url``, which it uses) to have the fixture;
``e2b_row`` makes a row to put in one."""

from __future__ import annotations

import secrets
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sandcell_orchestrator.registry import (
    E2bSandboxRow,
    InProcessRegistry,
    RedisRegistry,
    SessionRegistry,
    SqliteRegistry,
)
from sandcell_orchestrator.sessions.manager import sandbox_session_key
from tests.orchestrator.conftest import redis_url

__all__ = ["backend", "e2b_row", "redis_url"]


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


def e2b_row(
    namespace: str = "tenant-a",
    *,
    state: str = "running",
    started_at_s: float = 1_765_000_000.0,
    end_at_s: float | None = None,
    metadata: dict[str, str] | None = None,
) -> E2bSandboxRow:
    """A row of the E2B table with a fresh id and session key, as a create writes one
    (its end 300 s after its start unless given)."""
    return E2bSandboxRow(
        sandbox_id="".join(secrets.choice(_ID_ALPHABET) for _ in range(20)),
        namespace=namespace,
        template="base",
        session_id=sandbox_session_key(str(uuid.uuid4())),
        access_token="access-secret",
        traffic_token="traffic-secret",
        metadata=metadata or {},
        env={},
        egress=None,
        started_at_s=started_at_s,
        end_at_s=started_at_s + 300 if end_at_s is None else end_at_s,
        auto_pause=False,
        state=state,  # type: ignore[arg-type]
    )


_ID_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"
