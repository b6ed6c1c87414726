"""The session index in Redis: its key layout, the move of older orchestrators' sets into
the sorted sets a listing pages, and pages that read past entries they cannot use."""

from __future__ import annotations

import hashlib
import inspect
import uuid

import redis.asyncio

from sandcell_orchestrator.registry import RedisRegistry, SessionOwner
from sandcell_orchestrator.registry import redis_index as module
from sandcell_orchestrator.registry.redis_index import PAGE_IDS_LUA, PRUNE_IDS_LUA
from sandcell_protocol import runtime_session_id


def _hash(namespace: str) -> str:
    return hashlib.sha256(namespace.encode()).hexdigest()


def _owner(session_id: str, namespace: str) -> SessionOwner:
    return SessionOwner(session_id=session_id, namespace=namespace, user_id="u", hint="h")


def _ids(tag: str, count: int) -> list[str]:
    return sorted(runtime_session_id("t", "u", f"{tag}-{uuid.uuid4().hex}") for _ in range(count))


async def _every_page(registry: RedisRegistry, namespace: str, *, limit: int) -> list[str]:
    seen: list[str] = []
    after: str | None = None
    while True:
        page = [
            o.session_id for o in await registry.sessions_of(namespace, after=after, limit=limit)
        ]
        seen += page
        if len(page) < limit:
            return seen
        after = page[-1]


async def _legacy_index(client: redis.asyncio.Redis, prefix: str, owner: SessionOwner) -> None:
    """What an orchestrator before the sorted sets wrote for ``index_session``."""
    await client.hset(f"{prefix}owners", owner.session_id, owner.to_json())
    await client.sadd(f"{prefix}ns:{_hash(owner.namespace)}", owner.session_id)


async def test_key_layout(client: redis.asyncio.Redis, prefix: str) -> None:
    """An indexed session is an ``owners`` field and a member (score 0) of its namespace's
    ``nsids:<sha256>`` zset; re-indexing elsewhere moves it, unindexing removes both."""
    registry = RedisRegistry(client, prefix=prefix)
    (sid,) = _ids("k", 1)
    await registry.index_session(_owner(sid, "tenant a"))
    keys = sorted([key.decode() async for key in client.scan_iter(match=f"{prefix}*")])
    assert keys == sorted([f"{prefix}owners", f"{prefix}nsids:{_hash('tenant a')}"])
    assert await client.zrange(f"{prefix}nsids:{_hash('tenant a')}", 0, -1, withscores=True) == [
        (sid.encode(), 0.0)
    ]
    await registry.index_session(_owner(sid, "tenant b"))
    keys = sorted([key.decode() async for key in client.scan_iter(match=f"{prefix}*")])
    assert keys == sorted([f"{prefix}owners", f"{prefix}nsids:{_hash('tenant b')}"])
    await registry.unindex_session(sid)
    assert [key async for key in client.scan_iter(match=f"{prefix}*")] == []


async def test_an_older_orchestrators_set_is_moved_on_listing_and_nothing_is_lost(
    client: redis.asyncio.Redis, prefix: str
) -> None:
    """A namespace indexed as older orchestrators did (a set, ``ns:<sha256>``), partly
    re-indexed by this one: the first listing moves the set into the zset and deletes
    it, and pages give every session once; removals made before the move (unindexed,
    moved to another namespace) stay removed; an id an older worker adds to the set
    later (a rolling upgrade) is moved on the next listing."""
    registry = RedisRegistry(client, prefix=prefix)
    legacy = f"{prefix}ns:{_hash('tenant-a')}"
    ids = _ids("l", 12)
    for sid in ids[:10]:
        await _legacy_index(client, prefix, _owner(sid, "tenant-a"))
    await registry.index_session(_owner(ids[10], "tenant-a"))
    await registry.index_session(_owner(ids[3], "tenant-a"))  # already in the set
    await registry.unindex_session(ids[4])
    await registry.index_session(_owner(ids[5], "tenant-b"))
    assert await client.exists(legacy) == 1

    first = await registry.sessions_of("tenant-a", limit=3)
    assert [o.session_id for o in first] == [ids[0], ids[1], ids[2]]
    assert first[0] == _owner(ids[0], "tenant-a")
    assert await client.exists(legacy) == 0
    expected = [sid for sid in ids[:11] if sid not in {ids[4], ids[5]}]
    zset = await client.zrange(f"{prefix}nsids:{_hash('tenant-a')}", 0, -1, withscores=True)
    assert zset == [(sid.encode(), 0.0) for sid in expected]
    assert await _every_page(registry, "tenant-a", limit=3) == expected
    assert [o.session_id for o in await registry.sessions_of("tenant-b")] == [ids[5]]

    await _legacy_index(client, prefix, _owner(ids[11], "tenant-a"))
    assert await _every_page(registry, "tenant-a", limit=4) == [*expected, ids[11]]
    assert await client.exists(legacy) == 0


async def test_a_page_reads_past_entries_it_cannot_use(
    client: redis.asyncio.Redis, prefix: str
) -> None:
    """Zset members whose owner is gone, unreadable or another namespace's are skipped
    and the zset read on past them: a page is short only at the end."""
    registry = RedisRegistry(client, prefix=prefix)
    ids = _ids("s", 9)
    for sid in ids:
        await registry.index_session(_owner(sid, "tenant-a"))
    await client.hdel(f"{prefix}owners", ids[1])
    await client.hset(f"{prefix}owners", ids[2], b"{not json")
    await client.hset(f"{prefix}owners", ids[3], _owner(ids[3], "tenant-b").to_json())
    usable = [ids[0], *ids[4:]]
    page = await registry.sessions_of("tenant-a", limit=3)
    assert [o.session_id for o in page] == usable[:3]
    assert await _every_page(registry, "tenant-a", limit=2) == usable
    assert [o.session_id for o in await registry.sessions_of("tenant-a")] == usable


async def test_an_older_workers_removal_is_pruned_from_the_zset(
    client: redis.asyncio.Redis, prefix: str
) -> None:
    """An older orchestrator's unindex during a rolling upgrade (``HDEL owners`` and
    ``SREM`` of the set it knows) leaves the id in the zset a newer listing moved it
    into: the next listing skips it and takes it out, so no later listing reads it
    again. The script checks the owner itself: an id indexed again meanwhile stays."""
    registry = RedisRegistry(client, prefix=prefix)
    zset, legacy = f"{prefix}nsids:{_hash('tenant-a')}", f"{prefix}ns:{_hash('tenant-a')}"
    ids = _ids("p", 5)
    for sid in ids:
        await _legacy_index(client, prefix, _owner(sid, "tenant-a"))
    assert [o.session_id for o in await registry.sessions_of("tenant-a")] == ids
    for sid in (ids[1], ids[3]):  # the older worker's unindex_session
        await client.hdel(f"{prefix}owners", sid)
        await client.srem(legacy, sid)
    assert len(await client.zrange(zset, 0, -1)) == 5
    kept = [ids[0], ids[2], ids[4]]
    assert [o.session_id for o in await registry.sessions_of("tenant-a", limit=2)] == kept[:2]
    # That page read up to ids[2]: ids[1] is out; ids[3], past it, waits for a page that reads it.
    assert await client.zrange(zset, 0, -1) == [s.encode() for s in (ids[0], *ids[2:])]
    assert await _every_page(registry, "tenant-a", limit=2) == kept
    assert await client.zrange(zset, 0, -1) == [sid.encode() for sid in kept]

    prune = client.register_script(PRUNE_IDS_LUA)
    assert await prune(keys=[zset, f"{prefix}owners"], args=[ids[0]]) == 0
    assert await client.zscore(zset, ids[0]) == 0.0


async def test_pages_with_decode_responses(redis_url: str, prefix: str) -> None:
    """A shared client with decode_responses=True pages (and moves a legacy set) the same."""
    client = redis.asyncio.Redis.from_url(redis_url, decode_responses=True)
    try:
        registry = RedisRegistry(client, prefix=prefix)
        ids = _ids("d", 5)
        for sid in ids[:2]:
            await _legacy_index(client, prefix, _owner(sid, "tenant-a"))
        for sid in ids[2:]:
            await registry.index_session(_owner(sid, "tenant-a"))
        assert await _every_page(registry, "tenant-a", limit=2) == ids
    finally:
        await client.aclose()


def test_the_script_documents_its_keys_and_args() -> None:
    """``PAGE_IDS_LUA`` names what KEYS and ARGV carry (in the source, above it)."""
    source = inspect.getsource(module)
    before = source[: source.index("PAGE_IDS_LUA = ")].rsplit("\n\n", 1)[-1]
    assert "# KEYS[1]" in before
    assert "ARGV[1]" in before
    assert "KEYS[2]" in PAGE_IDS_LUA
