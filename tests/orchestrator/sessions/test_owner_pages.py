"""``SessionOwners.page``: a listing page reads one page of the registry's index and one of
the store's owners, never the whole of either, and pages chained by ``next_after`` give
every session once, in id order, wherever (index, store, both) its owner is kept.

Every registry backend (Redis the real redis-server), the directory store and moto's S3.
"""

from __future__ import annotations

import random
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio

from sandcell_orchestrator.registry import (
    InProcessRegistry,
    RedisRegistry,
    SessionIndex,
    SessionOwner,
    SessionRegistry,
    SqliteRegistry,
)
from sandcell_orchestrator.sessions.owners import SessionOwners, owner_key
from sandcell_orchestrator.snapshots import SnapshotStore
from sandcell_orchestrator.snapshots.whole import put_whole
from sandcell_protocol import runtime_session_id

TENANT, OTHER = "tenant-a", "tenant-b"


class _CountingIndex:
    """The registry's index, recording how many owners each ``sessions_of`` returned."""

    def __init__(self, inner: SessionIndex) -> None:
        self._inner = inner
        self.reads: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def sessions_of(self, namespace: str, **page: Any) -> list[SessionOwner]:
        owners = await self._inner.sessions_of(namespace, **page)
        self.reads.append(len(owners))
        return owners


class _CountingRedis(redis.asyncio.Redis):
    """A redis-py client counting the session ids its replies and ``HMGET``s carry."""

    ids: Counter[str]

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        reply = await super().execute_command(*args, **options)
        command = str(args[0]).upper()
        if command == "HMGET":
            self.ids[command] += len(args) - 2  # HMGET key field...
        elif command in {"SMEMBERS", "EVALSHA", "ZRANGEBYLEX"} and isinstance(reply, list | set):
            self.ids[command] += len(reply)
        return reply


@pytest.fixture(params=["memory", "sqlite", "redis"])
async def index(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[SessionRegistry]:
    backend: SessionRegistry
    if request.param == "memory":
        backend = InProcessRegistry()
    elif request.param == "sqlite":
        backend = SqliteRegistry(tmp_path / "registry.sqlite3")
    else:
        url: str = request.getfixturevalue("redis_url")
        backend = RedisRegistry.from_url(url, prefix=f"pages-{uuid.uuid4().hex}:")
    yield backend
    await backend.close()


def _owner(session_id: str, namespace: str = TENANT) -> SessionOwner:
    return SessionOwner(session_id=session_id, namespace=namespace, user_id="u", hint="h")


async def _keep(owners: SessionOwners, owner: SessionOwner, where: str) -> None:
    if where in {"index", "both"}:
        await owners.index.index_session(owner)
    if where in {"store", "both"}:
        key = owner_key(owner.namespace, owner.session_id)
        await put_whole(owners.store, key, owner.to_json(), max_bytes=1 << 16)


async def _every_page(owners: SessionOwners, *, limit: int) -> list[list[str]]:
    pages: list[list[str]] = []
    after: str | None = None
    while True:
        page, after = await owners.page(TENANT, after=after, limit=limit)
        assert all(owner.namespace == TENANT for owner in page)
        pages.append([owner.session_id for owner in page])
        if after is None:
            return pages
        assert after == pages[-1][-1]


def _layout(name: str, count: int) -> list[str]:
    """Where each of ``count`` sessions (in id order) has its owner kept."""
    if name == "index first":
        return ["index"] * (count // 2) + ["store"] * (count - count // 2)
    if name == "store first":
        return ["store"] * (count // 2) + ["index"] * (count - count // 2)
    rng = random.Random(f"{name}-{count}")
    return [rng.choice(["index", "store", "both"]) for _ in range(count)]


@pytest.mark.parametrize("layout", ["index first", "store first", "interleaved"])
async def test_pages_list_every_session_once_whether_indexed_stored_or_both(
    index: SessionRegistry, store: SnapshotStore, layout: str
) -> None:
    """30 sessions, each owner in the index, the store or both (and another tenant's in
    between): pages of any size chained by ``next_after`` give each once, in id order,
    each page no bigger than ``limit``, and each reads at most ``limit + 1`` entries of
    the index."""
    tag = layout.replace(" ", "-")
    ids = sorted(runtime_session_id(TENANT, "u", f"s{n}-{tag}") for n in range(30))
    counting = _CountingIndex(index)
    owners = SessionOwners(counting, store)
    for session_id, where in zip(ids, _layout(layout, len(ids)), strict=True):
        await _keep(owners, _owner(session_id), where)
    for n in range(10):
        other = _owner(runtime_session_id(OTHER, "u", f"o{n}"), OTHER)
        await _keep(owners, other, ["index", "store", "both"][n % 3])

    for limit in (1, 2, 3, 7, 29, 30, 31, 1000):
        counting.reads.clear()
        pages = await _every_page(owners, limit=limit)
        assert [session_id for page in pages for session_id in page] == ids, limit
        assert all(len(page) <= limit for page in pages), limit
        assert max(counting.reads) <= limit + 1, (limit, counting.reads)
        assert len(pages) == -(-len(ids) // limit), limit  # no empty page at the end


async def test_a_listing_page_reads_at_most_limit_plus_one_ids_of_redis(
    redis_url: str, dir_store: SnapshotStore
) -> None:
    """With 50 sessions indexed, a page of 5 reads (of the session index in Redis) no more
    than 6 ids and 6 owner entries, whatever the page: never the tenant's whole index."""
    client = _CountingRedis.from_url(redis_url)
    client.ids = Counter()
    registry = RedisRegistry(client, prefix=f"pages-{uuid.uuid4().hex}:")
    try:
        owners = SessionOwners(registry, dir_store)
        ids = sorted(runtime_session_id(TENANT, "u", f"r{n}") for n in range(50))
        for session_id in ids:
            await registry.index_session(_owner(session_id))
        after: str | None = None
        seen: list[str] = []
        while True:
            client.ids.clear()
            page, after = await owners.page(TENANT, after=after, limit=5)
            assert client.ids["HMGET"] <= 6, client.ids
            assert all(n <= 6 for n in client.ids.values()), client.ids
            seen += [owner.session_id for owner in page]
            if after is None:
                break
        assert seen == ids
    finally:
        keys = [key async for key in client.scan_iter(match=f"{registry.prefix}*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()
