"""The E2B table in Redis: its key layout, the move of older orchestrators' per-tenant
zsets into ``e2b_nsids`` and the listing by start time filled in from it, pages that
read only about ``limit`` rows and read past ids they cannot use, and the indexes of
running rows put right after an older orchestrator's writes."""

from __future__ import annotations

import hashlib
import inspect
from collections import Counter
from typing import Any

import msgspec
import pytest
import redis.asyncio

from sandcell_orchestrator.registry import E2bSandboxRow, E2bStartKey, RedisRegistry
from sandcell_orchestrator.registry import redis_e2b_scripts as scripts
from sandcell_orchestrator.registry.e2b import KILLED_E2B_TTL_S
from tests.orchestrator.registry.test_e2b_table import new_row


def _hash(namespace: str) -> str:
    return hashlib.sha256(namespace.encode()).hexdigest()


async def _keys(client: redis.asyncio.Redis, prefix: str) -> list[str]:
    return sorted([key.decode() async for key in client.scan_iter(match=f"{prefix}*")])


async def _legacy_add(client: redis.asyncio.Redis, prefix: str, row: E2bSandboxRow) -> None:
    """What an orchestrator before ``e2b_nsids`` wrote for ``add_e2b_sandbox``."""
    await client.hset(
        f"{prefix}e2b:{row.sandbox_id}",
        mapping={"rev": str(row.revision), "ns": row.namespace, "row": row.to_json()},
    )
    await client.zadd(f"{prefix}e2b_all", {row.sandbox_id: row.started_at_s})
    await client.zadd(f"{prefix}e2b_ns:{_hash(row.namespace)}", {row.sandbox_id: row.started_at_s})


async def _legacy_remove(client: redis.asyncio.Redis, prefix: str, row: E2bSandboxRow) -> None:
    """What an older orchestrator's ``remove_e2b_sandbox`` does (it knows no ``e2b_nsids``)."""
    await client.zrem(f"{prefix}e2b_all", row.sandbox_id)
    await client.zrem(f"{prefix}e2b_ns:{_hash(row.namespace)}", row.sandbox_id)
    await client.delete(f"{prefix}e2b:{row.sandbox_id}")


async def _every_page(registry: RedisRegistry, namespace: str, *, limit: int) -> list[str]:
    """The ids of the namespace's pages by start time, each after the last row of the
    one before, up to the first short page."""
    seen: list[str] = []
    after: E2bStartKey | None = None
    while True:
        rows = await registry.e2b_sandboxes_by_start(namespace, after=after, limit=limit)
        assert all(row.namespace == namespace for row in rows)
        seen += [row.sandbox_id for row in rows]
        if len(rows) < limit:
            return seen
        after = (rows[-1].started_at_s, rows[-1].sandbox_id)


def _rows(namespace: str, count: int) -> list[E2bSandboxRow]:
    """``count`` rows, in start order (their ids in no order)."""
    return [new_row(namespace, started_at_s=10_000.0 + n) for n in range(count)]


async def test_key_layout(client: redis.asyncio.Redis, prefix: str) -> None:
    """A row is its hash, an ``e2b_all`` member scored by its start, a member (score
    0) of its namespace's ``e2b_nsids:<sha256>``, one scored by its start of
    ``e2b_nsstart:<sha256>`` and, while it runs, one of ``e2b_ends`` scored by its end
    and one of ``e2b_nsrun:<sha256>`` scored by its start; a removal takes all six away
    and leaves ``e2b_killed:<id>`` with a TTL."""
    registry = RedisRegistry(client, prefix=prefix)
    row = new_row("tenant a", started_at_s=123.0)
    assert await registry.add_e2b_sandbox(row)
    nsids = f"{prefix}e2b_nsids:{_hash('tenant a')}"
    nsstart = f"{prefix}e2b_nsstart:{_hash('tenant a')}"
    ends = f"{prefix}e2b_ends"
    nsrun = f"{prefix}e2b_nsrun:{_hash('tenant a')}"
    assert await _keys(client, prefix) == sorted(
        [f"{prefix}e2b:{row.sandbox_id}", f"{prefix}e2b_all", nsids, nsstart, ends, nsrun]
    )
    assert await client.zrange(nsrun, 0, -1, withscores=True) == [(row.sandbox_id.encode(), 123.0)]
    assert await client.zrange(ends, 0, -1, withscores=True) == [
        (row.sandbox_id.encode(), row.end_at_s)
    ]
    assert await client.zrange(nsstart, 0, -1, withscores=True) == [
        (row.sandbox_id.encode(), 123.0)
    ]
    assert await client.hgetall(f"{prefix}e2b:{row.sandbox_id}") == {
        b"rev": b"1",
        b"ns": b"tenant a",
        b"row": row.to_json(),
    }
    assert await client.zrange(nsids, 0, -1, withscores=True) == [(row.sandbox_id.encode(), 0.0)]
    assert await client.zrange(f"{prefix}e2b_all", 0, -1, withscores=True) == [
        (row.sandbox_id.encode(), 123.0)
    ]
    assert await registry.remove_e2b_sandbox(row.sandbox_id)
    # What stays is the id's killed mark, on a TTL (a kill racing a pause: e2b/kept.py).
    killed = f"{prefix}e2b_killed:{row.sandbox_id}"
    assert await _keys(client, prefix) == [killed]
    assert 0 < await client.ttl(killed) <= KILLED_E2B_TTL_S


async def test_an_older_orchestrators_zset_is_moved_on_listing_and_nothing_is_lost(
    client: redis.asyncio.Redis, prefix: str
) -> None:
    """A tenant's rows as older orchestrators wrote them (``e2b_ns:<sha256>`` scored by
    start time), some added by this one: the first listing moves the old zset into
    ``e2b_nsids`` and deletes it, and pages give every row once, by start time. A row
    removed before the move stays removed; another tenant's old zset is not touched by
    this tenant's listing; one an older worker adds later (a rolling upgrade) is moved
    on the next listing, and one it removes after the move is skipped and pruned, from
    ``e2b_nsids`` too (else every later listing would read that zset whole)."""
    registry = RedisRegistry(client, prefix=prefix)
    legacy = f"{prefix}e2b_ns:{_hash('tenant-a')}"
    nsids = f"{prefix}e2b_nsids:{_hash('tenant-a')}"
    nsstart = f"{prefix}e2b_nsstart:{_hash('tenant-a')}"
    rows = _rows("tenant-a", 14)
    theirs = _rows("tenant-b", 3)
    for row in rows[:10]:
        await _legacy_add(client, prefix, row)
    for row in theirs:
        await _legacy_add(client, prefix, row)
    for row in rows[10:12]:
        assert await registry.add_e2b_sandbox(row)
    assert await registry.remove_e2b_sandbox(rows[4].sandbox_id)
    assert await client.zscore(legacy, rows[4].sandbox_id) is None
    assert await client.exists(legacy) == 1

    first = await registry.e2b_sandboxes_by_start("tenant-a", limit=3)
    assert first == [rows[0], rows[1], rows[2]]
    assert await client.exists(legacy) == 0
    expected = [row for n, row in enumerate(rows[:12]) if n != 4]
    assert await client.zrange(nsids, 0, -1, withscores=True) == [
        (row.sandbox_id.encode(), 0.0) for row in sorted(expected, key=lambda r: r.sandbox_id)
    ]
    ids = [row.sandbox_id for row in expected]
    assert await _every_page(registry, "tenant-a", limit=3) == ids
    assert await client.exists(f"{prefix}e2b_ns:{_hash('tenant-b')}") == 1
    assert await registry.e2b_sandboxes_by_start("tenant-b", limit=10) == theirs
    assert await client.exists(f"{prefix}e2b_ns:{_hash('tenant-b')}") == 0

    # A rolling upgrade: an older worker adds one (to the old zset) and removes one.
    await _legacy_add(client, prefix, rows[12])
    await _legacy_remove(client, prefix, rows[1])
    assert await client.zscore(nsids, rows[1].sandbox_id) == 0.0
    ids = [i for i in ids if i != rows[1].sandbox_id] + [rows[12].sandbox_id]
    assert await _every_page(registry, "tenant-a", limit=4) == ids
    assert await client.exists(legacy) == 0
    assert await client.zscore(nsids, rows[1].sandbox_id) is None
    assert await client.zcard(nsids) == await client.zcard(nsstart) == len(ids)
    # The table itself is whole: updates and removals of moved rows work.
    moved = msgspec.structs.replace(rows[0], state="paused", revision=2)
    assert await registry.update_e2b_sandbox(moved)
    assert await registry.remove_e2b_sandbox(rows[12].sandbox_id)
    assert (await registry.e2b_sandboxes_by_start("tenant-a", limit=1)) == [moved]
    assert rows[12].sandbox_id not in await _every_page(registry, "tenant-a", limit=100)


async def _nsids_era_add(client: redis.asyncio.Redis, prefix: str, row: E2bSandboxRow) -> None:
    """What an orchestrator before ``e2b_nsstart`` wrote for ``add_e2b_sandbox``."""
    await client.hset(
        f"{prefix}e2b:{row.sandbox_id}",
        mapping={"rev": str(row.revision), "ns": row.namespace, "row": row.to_json()},
    )
    await client.zadd(f"{prefix}e2b_all", {row.sandbox_id: row.started_at_s})
    await client.zadd(f"{prefix}e2b_nsids:{_hash(row.namespace)}", {row.sandbox_id: 0})


async def test_rows_an_older_orchestrator_added_are_listed_by_start_time(
    client: redis.asyncio.Redis, prefix: str
) -> None:
    """Rows added before ``e2b_nsstart`` (or by an older worker during a rolling
    upgrade), also those of the orchestrators before ``e2b_nsids``, are in the listing
    by start time, in order, once: the listing moves the oldest zset into
    ``e2b_nsids`` and adds what ``e2b_nsstart`` lacks, scored from ``e2b_all``. An id an
    older worker removed (it leaves the member in ``e2b_nsstart``) is skipped and
    pruned."""
    registry = RedisRegistry(client, prefix=prefix)
    nsstart = f"{prefix}e2b_nsstart:{_hash('tenant-a')}"
    rows = [new_row("tenant-a", started_at_s=1_765_000_000.25 + 0.5 * n) for n in range(9)]
    for n, row in enumerate(rows):
        if n % 3 == 0:
            assert await registry.add_e2b_sandbox(row)
        elif n % 3 == 1:
            await _nsids_era_add(client, prefix, row)
        else:
            await _legacy_add(client, prefix, row)
    assert await client.zcard(nsstart) == 3
    assert await registry.e2b_sandboxes_by_start("tenant-a", limit=4) == rows[:4]
    assert await client.zcard(nsstart) == 9
    assert await client.exists(f"{prefix}e2b_ns:{_hash('tenant-a')}") == 0
    assert await client.zcard(f"{prefix}e2b_nsids:{_hash('tenant-a')}") == 9
    newest = await registry.e2b_sandboxes_by_start("tenant-a", limit=20, newest_first=True)
    assert newest == rows[::-1]
    # An older worker's kill: the hash, e2b_all and e2b_nsids, not e2b_nsstart.
    gone = rows[5]
    await client.delete(f"{prefix}e2b:{gone.sandbox_id}")
    await client.zrem(f"{prefix}e2b_all", gone.sandbox_id)
    await client.zrem(f"{prefix}e2b_nsids:{_hash('tenant-a')}", gone.sandbox_id)
    after = (rows[3].started_at_s, rows[3].sandbox_id)
    assert await registry.e2b_sandboxes_by_start("tenant-a", after=after, limit=3) == [
        rows[4],
        rows[6],
        rows[7],
    ]
    assert await client.zscore(nsstart, gone.sandbox_id) is None


async def test_the_running_indexes_are_put_right_after_an_older_orchestrators_writes(
    client: redis.asyncio.Redis, prefix: str
) -> None:
    """``e2b_ends`` and ``e2b_nsrun`` entries an older orchestrator left wrong (it knows
    neither: its kill, its pause, its later end) are not answered, and are taken out
    or re-scored by the reads that meet them (``e2b_running_count`` reads no row: it
    counts them until then); a running row it added (in neither) is indexed by
    ``e2b_index`` (the full sweep's); a fix read at a revision the row has left is not
    applied."""
    registry = RedisRegistry(client, prefix=prefix)
    ends, nsrun = f"{prefix}e2b_ends", f"{prefix}e2b_nsrun:{_hash('tenant-a')}"
    killed, paused, extended, due = (
        msgspec.structs.replace(new_row("tenant-a", started_at_s=10.0 + n), end_at_s=100.0 + n)
        for n in range(4)
    )
    for row in (killed, paused, extended, due):
        assert await registry.add_e2b_sandbox(row)
    # The older orchestrator's writes: the hash (and its own zsets) only.
    await client.delete(f"{prefix}e2b:{killed.sandbox_id}")
    now_paused = msgspec.structs.replace(paused, state="paused", revision=2)
    now_extended = msgspec.structs.replace(extended, end_at_s=900.0, revision=2)
    for row in (now_paused, now_extended):
        await client.hset(
            f"{prefix}e2b:{row.sandbox_id}", mapping={"rev": "2", "row": row.to_json()}
        )
    added = msgspec.structs.replace(new_row("tenant-a", started_at_s=50.0), end_at_s=50.0)
    await _nsids_era_add(client, prefix, added)

    assert await registry.e2b_running_count("tenant-a") == 4
    assert await registry.e2b_due(500.0, limit=10) == [due]
    assert await client.zrange(ends, 0, -1, withscores=True) == [
        (due.sandbox_id.encode(), due.end_at_s),
        (extended.sandbox_id.encode(), 900.0),
    ]
    # The sweep's read put the paused row's entry right, not the killed one's: the count
    # (which reads no row) runs high until the rows are read.
    assert await registry.e2b_running_count("tenant-a") == 3
    assert await registry.e2b_running_of("tenant-a") == [now_extended, due]
    assert await registry.e2b_running_count("tenant-a") == 2
    assert await client.zrange(nsrun, 0, -1) == [
        extended.sandbox_id.encode(),
        due.sandbox_id.encode(),
    ]
    # The full sweep hands every row it read to ``e2b_index``: the unindexed one joins.
    await registry.e2b_index(await registry.e2b_sandboxes())
    assert await registry.e2b_running_of("tenant-a") == [now_extended, due, added]
    assert await registry.e2b_running_count("tenant-a") == 3
    assert await registry.e2b_due(500.0, limit=10) == [added, due]
    # Read at revision 1, written since (revision 2): not applied.
    await registry.e2b_index([extended])
    assert await client.zscore(ends, extended.sandbox_id) == 900.0


async def test_a_page_reads_past_ids_it_cannot_use(
    client: redis.asyncio.Redis, prefix: str
) -> None:
    """Ids whose row is gone, unreadable or another namespace's are skipped and the zset
    by start time read on past them: a page is short only at the end."""
    registry = RedisRegistry(client, prefix=prefix)
    rows = _rows("tenant-a", 9)
    for row in rows:
        assert await registry.add_e2b_sandbox(row)
    await client.delete(f"{prefix}e2b:{rows[1].sandbox_id}")
    await client.hset(f"{prefix}e2b:{rows[2].sandbox_id}", "row", b"{not json")
    stolen = msgspec.structs.replace(rows[3], namespace="tenant-b")
    await client.hset(f"{prefix}e2b:{rows[3].sandbox_id}", "row", stolen.to_json())
    usable = [rows[0].sandbox_id, *(row.sandbox_id for row in rows[4:])]
    page = await registry.e2b_sandboxes_by_start("tenant-a", limit=3)
    assert [row.sandbox_id for row in page] == usable[:3]
    assert await _every_page(registry, "tenant-a", limit=2) == usable
    assert await _every_page(registry, "tenant-a", limit=100) == usable


class _CountingRedis(redis.asyncio.Redis):
    """A redis-py client counting the E2B rows it reads (``HGET e2b:<id>``) and the ids
    its scripts' replies carry."""

    reads: Counter[str]

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        reply = await super().execute_command(*args, **options)
        self._count(args, reply)
        return reply

    def _count(self, args: tuple[Any, ...], reply: Any) -> None:
        command = str(args[0]).upper()
        if command == "HGET" and ":e2b:" in str(args[1]):
            self.reads["rows"] += 1
        elif command == "EVALSHA" and isinstance(reply, list):
            self.reads["ids"] += len(reply) // 2  # the listing's: each id with its score
        elif command == "ZRANGE" and isinstance(reply, list):
            self.reads["ids"] += len(reply)


class _CountingPipeline(redis.asyncio.client.Pipeline):
    """The pipeline of ``_CountingRedis``: its queued ``HGET``s counted as they are sent."""

    async def execute(self, raise_on_error: bool = True) -> list[Any]:
        counter = self._counter
        for args, _options in self.command_stack:
            counter._count(args, None)
        return await super().execute(raise_on_error)


def _counting_client(url: str) -> _CountingRedis:
    client = _CountingRedis.from_url(url)
    client.reads = Counter()

    def pipeline(transaction: bool = True, shard_hint: Any = None) -> _CountingPipeline:
        pipe = _CountingPipeline(
            client.connection_pool, client.response_callbacks, transaction, shard_hint
        )
        pipe._counter = client  # type: ignore[attr-defined]
        return pipe

    client.pipeline = pipeline  # type: ignore[method-assign]
    return client


async def test_a_page_reads_about_limit_rows_not_the_tenants_table(
    redis_url: str, prefix: str
) -> None:
    """With 60 rows of a tenant (and 20 of another), a page of 5 reads 5 ids and 5 rows,
    whichever page it is: never the tenant's whole table, never the other's. The count
    of its running rows reads no id and no row."""
    client = _counting_client(redis_url)
    try:
        registry = RedisRegistry(client, prefix=prefix)
        rows = _rows("tenant-a", 60)
        for row in [*rows, *_rows("tenant-b", 20)]:
            assert await registry.add_e2b_sandbox(row)
        after: E2bStartKey | None = None
        seen: list[str] = []
        while True:
            client.reads.clear()
            page = await registry.e2b_sandboxes_by_start("tenant-a", after=after, limit=5)
            assert client.reads["rows"] == len(page) <= 5, client.reads
            assert client.reads["ids"] <= 5, client.reads
            seen += [row.sandbox_id for row in page]
            if len(page) < 5:
                break
            after = (page[-1].started_at_s, page[-1].sandbox_id)
        assert seen == [row.sandbox_id for row in rows]
        client.reads.clear()
        assert await registry.e2b_running_count("tenant-a") == 60
        assert client.reads == Counter(), client.reads
    finally:
        await client.aclose()


async def test_pages_with_decode_responses(redis_url: str, prefix: str) -> None:
    """A shared client with decode_responses=True pages (and moves an old zset) the same."""
    client = redis.asyncio.Redis.from_url(redis_url, decode_responses=True)
    try:
        registry = RedisRegistry(client, prefix=prefix)
        rows = _rows("tenant-a", 5)
        for row in rows[:2]:
            await _legacy_add(client, prefix, row)
        for row in rows[2:]:
            assert await registry.add_e2b_sandbox(row)
        assert await _every_page(registry, "tenant-a", limit=2) == [r.sandbox_id for r in rows]
        assert await registry.e2b_sandbox(rows[0].sandbox_id) == rows[0]
    finally:
        await client.aclose()


@pytest.mark.parametrize("name", scripts.__all__)
def test_the_scripts_document_their_keys_and_args(name: str) -> None:
    """Each script names what KEYS and ARGV carry (in the source, above it)."""
    source = inspect.getsource(scripts)
    before = source[: source.index(f"{name} = ")].rsplit("\n\n", 1)[-1]
    assert "# KEYS[1]" in before
    assert "ARGV[1]" in before
