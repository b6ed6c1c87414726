"""The E2B sandbox table in Redis (``E2bSandboxTable`` of ``RedisRegistry``).

<prefix>e2b:<id>             hash  rev, ns, row (E2bSandboxRow JSON) of one sandbox
<prefix>e2b_all              zset  id -> started_at_s, every sandbox
<prefix>e2b_ends             zset  id -> end_at_s, every running sandbox (the timeout
                                   sweep reads the ones due, not every row)
<prefix>e2b_nsrun:<sha256>   zset  id -> started_at_s, one namespace's running sandboxes
                                   (the room check and the v1 listing read these)
<prefix>e2b_nsids:<sha256>   zset  one namespace's ids (hashed: any text), all scored 0
                                   so they sort by id (ZRANGEBYLEX pages it)
<prefix>e2b_nsstart:<sha256> zset  the same ids scored by started_at_s: the E2B
                                   listing's order, start time then id
<prefix>e2b_kept_merged:<sha256>  string  set (with a TTL) once a listing found the
                                   namespace's kept rows all in the table
<prefix>e2b_ns:<sha256>      zset  the same scored by started_at_s, as orchestrators
                                   before ``e2b_nsids`` kept it
<prefix>e2b_killed:<id>      string  set (with a TTL) by the removal of the id's row:
                                   a kill, not a wipe (``e2b_sandbox_killed``)

A namespace's ids sorted by start time cannot be read a page at a time in id order;
the zset scored 0 can (the paging of whole tables, ``e2b_sandboxes_of``). The E2B
listing goes by start time: ``e2b_nsstart``, paged from a row's ``(score, id)`` by the
row's rank while it is there, by its score once it is gone. Rows added by an older
orchestrator are missing from it: the listing's script adds every id of ``e2b_nsids``
it lacks (scored from ``e2b_all``) whenever it holds fewer ids. A zset left by an older
orchestrator (or added to by one still running during a rolling upgrade) is moved
into the new one, and deleted, by the listing itself (``PAGE_E2B_IDS_LUA``),
atomically, so no id is lost or listed from both; a removal takes the id out of both
keys, so the move cannot bring a removed id back.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from functools import cached_property

from redis.commands.core import AsyncScript

from .e2b import (
    KILLED_E2B_TTL_S,
    E2bSandboxRow,
    E2bStartKey,
    decode_row,
    validate_e2b_sandbox_id,
)
from .index import check_page_limit
from .redis_db import RedisDatabase, legacy_move_lua, map_redis_errors, moving_page_lua, text

__all__ = [
    "ADD_E2B_LUA",
    "PAGE_E2B_BY_START_LUA",
    "PAGE_E2B_IDS_LUA",
    "PRUNE_E2B_IDS_LUA",
    "INDEX_E2B_LUA",
    "REMOVE_E2B_LUA",
    "UPDATE_E2B_LUA",
    "RedisE2bTable",
]

logger = logging.getLogger(__name__)

# KEYS[1] row hash, KEYS[2] every sandbox's zset, KEYS[3] the namespace's ids zset,
# KEYS[4] its zset by start time, KEYS[5] the running sandboxes' ends zset, KEYS[6] the
# namespace's running zset
# ARGV[1] row JSON, ARGV[2] started_at_s, ARGV[3] sandbox id, ARGV[4] namespace,
# ARGV[5] the row's revision, ARGV[6] its end_at_s if it is running, else ''
# Returns 1 if added, 0 if the id is taken.
ADD_E2B_LUA = """
if redis.call('exists', KEYS[1]) == 1 then
    return 0
end
redis.call('hset', KEYS[1], 'rev', ARGV[5], 'ns', ARGV[4], 'row', ARGV[1])
redis.call('zadd', KEYS[2], ARGV[2], ARGV[3])
redis.call('zadd', KEYS[3], 0, ARGV[3])
redis.call('zadd', KEYS[4], ARGV[2], ARGV[3])
if ARGV[6] ~= '' then
    redis.call('zadd', KEYS[5], ARGV[6], ARGV[3])
    redis.call('zadd', KEYS[6], ARGV[2], ARGV[3])
end
return 1
"""

# KEYS[1] row hash, KEYS[2] the running sandboxes' ends zset, KEYS[3] the namespace's
# running zset
# ARGV[1] the revision expected, ARGV[2] the new revision, ARGV[3] row JSON, ARGV[4] namespace,
# ARGV[5] sandbox id, ARGV[6] the new row's end_at_s if it is running, else '', ARGV[7] its
# started_at_s
# Returns 1 if replaced, 0 if the stored row is another revision, another namespace's or gone.
UPDATE_E2B_LUA = """
if redis.call('hget', KEYS[1], 'rev') == ARGV[1]
        and redis.call('hget', KEYS[1], 'ns') == ARGV[4] then
    redis.call('hset', KEYS[1], 'rev', ARGV[2], 'row', ARGV[3])
    if ARGV[6] ~= '' then
        redis.call('zadd', KEYS[2], ARGV[6], ARGV[5])
        redis.call('zadd', KEYS[3], ARGV[7], ARGV[5])
    else
        redis.call('zrem', KEYS[2], ARGV[5])
        redis.call('zrem', KEYS[3], ARGV[5])
    end
    return 1
end
return 0
"""

# KEYS[1] row hash, KEYS[2] every sandbox's zset, KEYS[3] the namespace's ids zset,
# KEYS[4] its legacy zset, KEYS[5] the id's killed mark, KEYS[6] its zset by start time,
# KEYS[7] the running sandboxes' ends zset, KEYS[8] the namespace's running zset
# ARGV[1] sandbox id, ARGV[2] namespace (the row's: the namespace zsets are its),
# ARGV[3] the mark's TTL in seconds
# Returns 1 if removed, 0 if there was no such row of that namespace. The mark is set
# either way, in the script: no worker sees the row gone without it.
REMOVE_E2B_LUA = """
redis.call('set', KEYS[5], '1', 'EX', ARGV[3])
redis.call('zrem', KEYS[2], ARGV[1])
redis.call('zrem', KEYS[3], ARGV[1])
redis.call('zrem', KEYS[4], ARGV[1])
redis.call('zrem', KEYS[6], ARGV[1])
redis.call('zrem', KEYS[7], ARGV[1])
redis.call('zrem', KEYS[8], ARGV[1])
if redis.call('hget', KEYS[1], 'ns') == ARGV[2] then
    redis.call('del', KEYS[1])
    return 1
end
return 0
"""

# KEYS[1] the namespace's ids zset, KEYS[2] its legacy zset (scored by start time)
# ARGV[1] where the page starts ('-', or '(' and the id it follows), ARGV[2] how many ids
# (-1: all)
# Moves the legacy zset's ids into the ids zset (score 0) and deletes the legacy one,
# then returns the page of ids. One script, so an id is in one key or the other, never
# neither.
PAGE_E2B_IDS_LUA = moving_page_lua("redis.call('zrange', KEYS[2], 0, -1)")

# KEYS[1] the namespace's zset by start time, KEYS[2] its ids zset, KEYS[3] every
# sandbox's zset (its scores are the start times), KEYS[4] its legacy zset
# ARGV[1] '1' newest first, else '0'; ARGV[2] the start time of the row the page follows
# ('' from the first), exactly as the row has it (a string: Lua's numbers print
# rounded); ARGV[3] that row's id; ARGV[4] how many ids
# Returns the page's ids, each followed by its score. First the legacy zset is moved
# into the ids zset (``PAGE_E2B_IDS_LUA``'s move), and the ids of the ids zset the
# start zset lacks are added to it (rows an older orchestrator added). Then the
# page: past the row's rank if the row is still there (ties on the start time go by
# id, the zset's own order); past its start time if it is gone, the ties at that very
# time read whole and filtered by id.
PAGE_E2B_BY_START_LUA = (
    legacy_move_lua("redis.call('zrange', KEYS[4], 0, -1)", ids="KEYS[2]", legacy="KEYS[4]")
    + """
local by_start, ids, all = KEYS[1], KEYS[2], KEYS[3]
if redis.call('zcard', by_start) < redis.call('zcard', ids) then
    local known = redis.call('zrange', ids, 0, -1)
    for i = 1, #known do
        if not redis.call('zscore', by_start, known[i]) then
            local started = redis.call('zscore', all, known[i])
            if started then
                redis.call('zadd', by_start, started, known[i])
            end
        end
    end
end
local newest, at, after, count = ARGV[1] == '1', ARGV[2], ARGV[3], tonumber(ARGV[4])
if count <= 0 then
    return {}
end
local range, by_score, beyond = 'zrange', 'zrangebyscore', '+inf'
if newest then
    range, by_score, beyond = 'zrevrange', 'zrevrangebyscore', '-inf'
end
if at == '' then
    return redis.call(range, by_start, 0, count - 1, 'WITHSCORES')
end
local rank
if newest then
    rank = redis.call('zrevrank', by_start, after)
else
    rank = redis.call('zrank', by_start, after)
end
if rank and tonumber(redis.call('zscore', by_start, after)) == tonumber(at) then
    return redis.call(range, by_start, rank + 1, rank + count, 'WITHSCORES')
end
local page = {}
local ties = redis.call(by_score, by_start, at, at)
for i = 1, #ties do
    if #page < 2 * count and ((newest and ties[i] < after) or (not newest and ties[i] > after)) then
        page[#page + 1] = ties[i]
        page[#page + 1] = at
    end
end
if #page < 2 * count then
    local rest = redis.call(
        by_score, by_start, '(' .. at, beyond, 'WITHSCORES', 'LIMIT', 0, count - #page / 2
    )
    for i = 1, #rest do
        page[#page + 1] = rest[i]
    end
end
return page
"""
)

# KEYS[1] the running sandboxes' ends zset; for each row i, KEYS[2i] its hash and
# KEYS[2i + 1] its namespace's running zset
# ARGV[4i-3..4i]: row i's id, the revision it was read at, and its end_at_s and
# started_at_s if it is running ('' and '' if not)
# Puts each row in the two zsets (running) or takes it out of them (paused), as its
# state calls for, only if its hash is still at the revision read: a write since set
# the entries itself, and is not undone. Rows an older orchestrator wrote (it knows
# neither zset) are indexed this way: by the full sweep, and where a read finds an
# entry that does not match its row. Returns how many rows were at their revision.
INDEX_E2B_LUA = """
local done = 0
for i = 1, (#KEYS - 1) / 2 do
    local id, seen, ends, started = ARGV[4 * i - 3], ARGV[4 * i - 2], ARGV[4 * i - 1], ARGV[4 * i]
    if redis.call('hget', KEYS[2 * i], 'rev') == seen then
        if ends ~= '' then
            redis.call('zadd', KEYS[1], ends, id)
            redis.call('zadd', KEYS[2 * i + 1], started, id)
        else
            redis.call('zrem', KEYS[1], id)
            redis.call('zrem', KEYS[2 * i + 1], id)
        end
        done = done + 1
    end
end
return done
"""

# KEYS[1] a zset of ids (a namespace's ids, by id, by start or running; the ends),
# KEYS[2..] row hashes a read found missing
# ARGV[1], ARGV[2]... their sandbox ids (ARGV[i]'s hash is KEYS[i + 1])
# Takes out of the zset each id whose hash is still missing: an older orchestrator's
# removal leaves the id there (it knows only its own zsets). Checked in the script, so
# a row added again meanwhile (rebuilt after a wipe) keeps its id.
PRUNE_E2B_IDS_LUA = """
local pruned = 0
for i = 1, #ARGV do
    if redis.call('exists', KEYS[i + 1]) == 0 then
        pruned = pruned + redis.call('zrem', KEYS[1], ARGV[i])
    end
end
return pruned
"""


class RedisE2bTable(RedisDatabase):
    """``E2bSandboxTable`` on one hash per sandbox and two sorted sets of ids."""

    @cached_property
    def _add_e2b(self) -> AsyncScript:
        return self._client.register_script(ADD_E2B_LUA)

    @cached_property
    def _update_e2b(self) -> AsyncScript:
        return self._client.register_script(UPDATE_E2B_LUA)

    @cached_property
    def _remove_e2b(self) -> AsyncScript:
        return self._client.register_script(REMOVE_E2B_LUA)

    @cached_property
    def _page_e2b_ids(self) -> AsyncScript:
        return self._client.register_script(PAGE_E2B_IDS_LUA)

    @cached_property
    def _page_e2b_by_start(self) -> AsyncScript:
        return self._client.register_script(PAGE_E2B_BY_START_LUA)

    @cached_property
    def _index_e2b(self) -> AsyncScript:
        return self._client.register_script(INDEX_E2B_LUA)

    @cached_property
    def _prune_e2b_ids(self) -> AsyncScript:
        return self._client.register_script(PRUNE_E2B_IDS_LUA)

    def _e2b_key(self, sandbox_id: str) -> str:
        return f"{self._prefix}e2b:{validate_e2b_sandbox_id(sandbox_id)}"

    @property
    def _e2b_all_key(self) -> str:
        return f"{self._prefix}e2b_all"

    @property
    def _e2b_ends_key(self) -> str:
        return f"{self._prefix}e2b_ends"

    def _e2b_ns_key(self, namespace: str) -> str:
        return f"{self._prefix}e2b_nsids:{_namespace_hash(namespace)}"

    def _e2b_by_start_key(self, namespace: str) -> str:
        return f"{self._prefix}e2b_nsstart:{_namespace_hash(namespace)}"

    def _e2b_running_key(self, namespace: str) -> str:
        return f"{self._prefix}e2b_nsrun:{_namespace_hash(namespace)}"

    def _e2b_kept_merged_key(self, namespace: str) -> str:
        return f"{self._prefix}e2b_kept_merged:{_namespace_hash(namespace)}"

    def _e2b_killed_key(self, sandbox_id: str) -> str:
        return f"{self._prefix}e2b_killed:{validate_e2b_sandbox_id(sandbox_id)}"

    def _legacy_e2b_ns_key(self, namespace: str) -> str:
        return f"{self._prefix}e2b_ns:{_namespace_hash(namespace)}"

    async def add_e2b_sandbox(self, row: E2bSandboxRow) -> bool:
        """Store a row at its revision (``ADD_E2B_LUA``); ``False`` if the id is taken."""
        keys = [
            self._e2b_key(row.sandbox_id),
            self._e2b_all_key,
            self._e2b_ns_key(row.namespace),
            self._e2b_by_start_key(row.namespace),
            self._e2b_ends_key,
            self._e2b_running_key(row.namespace),
        ]
        with map_redis_errors("add_e2b_sandbox"):
            added = await self._add_e2b(
                keys=keys,
                args=[
                    row.to_json(),
                    repr(row.started_at_s),
                    row.sandbox_id,
                    row.namespace,
                    str(row.revision),
                    _running_end(row),
                ],
            )
        return bool(added)

    async def e2b_sandbox(self, sandbox_id: str) -> E2bSandboxRow | None:
        """``HGET row``; ``None`` if missing or unreadable."""
        key = self._e2b_key(sandbox_id)
        with map_redis_errors("e2b_sandbox"):
            raw = await self._client.hget(key, "row")
        return None if raw is None else _decoded(sandbox_id, raw)

    async def e2b_sandboxes(self, namespace: str | None = None) -> list[E2bSandboxRow]:
        """``e2b_all``'s ids, then each row (ids whose row is gone are skipped); a
        namespace's: all of ``e2b_sandboxes_of``."""
        if namespace is not None:
            owned = await self.e2b_sandboxes_of(namespace)
            return sorted(owned, key=lambda r: (r.started_at_s, r.sandbox_id))
        with map_redis_errors("e2b_sandboxes"):
            members = await self._client.zrange(self._e2b_all_key, 0, -1)
            ids = [text(member) for member in members if isinstance(member, bytes | str)]
            raws = await self._rows(ids)
        rows = [
            _decoded(sandbox_id, raw)
            for sandbox_id, raw in zip(ids, raws, strict=True)
            if raw is not None
        ]
        found = [r for r in rows if r is not None]
        return sorted(found, key=lambda r: (r.started_at_s, r.sandbox_id))

    async def e2b_sandboxes_of(
        self, namespace: str, *, after: str | None = None, limit: int | None = None
    ) -> list[E2bSandboxRow]:
        """A page of the namespace's ids zset (``PAGE_E2B_IDS_LUA``), then each row.

        Ids whose row is gone (``PRUNE_E2B_IDS_LUA`` takes them out), unreadable or
        another namespace's are skipped, and the zset is read on past them until
        ``limit`` are found or it ends: a short page has to mean the end, else the
        listing would stop there."""
        check_page_limit(limit)
        keys = [self._e2b_ns_key(namespace), self._legacy_e2b_ns_key(namespace)]
        found: list[E2bSandboxRow] = []
        start = after
        with map_redis_errors("e2b_sandboxes_of"):
            while limit is None or len(found) < limit:
                wanted = -1 if limit is None else limit - len(found)
                replies = await self._page_e2b_ids(
                    keys=keys, args=["-" if start is None else f"({start}", wanted]
                )
                ids = [text(reply) for reply in replies]
                if not ids:
                    break
                missing: list[str] = []
                for sandbox_id, raw in zip(ids, await self._rows(ids), strict=True):
                    if raw is None:
                        missing.append(sandbox_id)
                        continue
                    row = _decoded(sandbox_id, raw)
                    if row is not None and row.namespace == namespace:
                        found.append(row)
                if missing:
                    await self._prune_e2b_ids(
                        keys=[keys[0], *(self._e2b_key(i) for i in missing)], args=missing
                    )
                if wanted < 0 or len(ids) < wanted:
                    break
                start = ids[-1]
        return found

    async def e2b_sandboxes_by_start(
        self,
        namespace: str,
        *,
        after: E2bStartKey | None = None,
        limit: int,
        newest_first: bool = False,
    ) -> list[E2bSandboxRow]:
        """A page of the namespace's zset by start time (``PAGE_E2B_BY_START_LUA``),
        then each row; ids whose row is gone are taken out of it (``PRUNE_E2B_IDS_LUA``)
        and skipped, as are unreadable rows and another namespace's, and the zset is
        read on past them until ``limit`` are found or it ends."""
        check_page_limit(limit)
        keys = [
            self._e2b_by_start_key(namespace),
            self._e2b_ns_key(namespace),
            self._e2b_all_key,
            self._legacy_e2b_ns_key(namespace),
        ]
        found: list[E2bSandboxRow] = []
        start = after
        with map_redis_errors("e2b_sandboxes_by_start"):
            while len(found) < limit:
                wanted = limit - len(found)
                at, after_id = ("", "") if start is None else (repr(start[0]), start[1])
                replies = await self._page_e2b_by_start(
                    keys=keys, args=["1" if newest_first else "0", at, after_id, wanted]
                )
                ids = [text(reply) for reply in replies[::2]]
                missing: list[str] = []
                for sandbox_id, raw in zip(ids, await self._rows(ids), strict=True):
                    if raw is None:
                        missing.append(sandbox_id)
                        continue
                    row = _decoded(sandbox_id, raw)
                    if row is not None and row.namespace == namespace:
                        found.append(row)
                if missing:
                    await self._prune_e2b_ids(
                        keys=[keys[0], *(self._e2b_key(i) for i in missing)], args=missing
                    )
                if len(ids) < wanted:
                    break
                # The zset's own score: the read goes on past the last id read, whatever
                # its row turned out to be.
                start = (float(text(replies[-1])), ids[-1])
        return found

    async def e2b_due(self, now_s: float, *, limit: int) -> list[E2bSandboxRow]:
        """``ZRANGEBYSCORE`` of ``e2b_ends`` up to ``now_s``, then each row.

        An entry that does not match its row (an older orchestrator's write, which
        knows no ``e2b_ends``: a removal, a pause, a later end) is put right
        (``_read_indexed``); its row is listed only if it is due."""
        check_page_limit(limit)
        with map_redis_errors("e2b_due"):
            entries = await self._client.zrangebyscore(
                self._e2b_ends_key, "-inf", repr(now_s), start=0, num=limit, withscores=True
            )
            ends = {
                text(entry[0]): float(entry[1])
                for entry in entries
                if isinstance(entry, list | tuple) and isinstance(entry[0], bytes | str)
            }
            read = await self._read_indexed(list(ends), self._e2b_ends_key, ends=ends)
        return [row for row in read if row.state == "running" and row.end_at_s <= now_s]

    async def e2b_running_of(self, namespace: str) -> list[E2bSandboxRow]:
        """The namespace's running zset, then each row (put right as ``e2b_due``'s)."""
        key = self._e2b_running_key(namespace)
        with map_redis_errors("e2b_running_of"):
            members = await self._client.zrange(key, 0, -1)
            ids = [text(member) for member in members if isinstance(member, bytes | str)]
            read = await self._read_indexed(ids, key)
        return [row for row in read if row.state == "running" and row.namespace == namespace]

    async def e2b_index(self, rows: Sequence[E2bSandboxRow]) -> None:
        """``INDEX_E2B_LUA`` for ``rows`` as they were read (500 to a script)."""
        with map_redis_errors("e2b_index"):
            for first in range(0, len(rows), 500):
                await self._index(rows[first : first + 500])

    async def _read_indexed(
        self, ids: list[str], index: str, *, ends: dict[str, float] | None = None
    ) -> list[E2bSandboxRow]:
        """The rows of ``ids`` (entries of the zset ``index``; of ``e2b_ends`` with
        their scores, ``ends``), with the entries that do not match their row put right:
        a gone (or unreadable) row's taken out (``PRUNE_E2B_IDS_LUA``), a paused row's
        or one whose end is not its score re-indexed at its revision (``INDEX_E2B_LUA``)."""
        rows: list[E2bSandboxRow] = []
        gone: list[str] = []
        wrong: list[E2bSandboxRow] = []
        for sandbox_id, raw in zip(ids, await self._rows(ids), strict=True):
            row = None if raw is None else _decoded(sandbox_id, raw)
            if row is None:
                gone.append(sandbox_id)
                continue
            rows.append(row)
            if row.state != "running" or (ends is not None and ends[sandbox_id] != row.end_at_s):
                wrong.append(row)
        if gone:
            await self._prune_e2b_ids(keys=[index, *(self._e2b_key(i) for i in gone)], args=gone)
        if wrong:
            await self._index(wrong)
        return rows

    async def _index(self, rows: Sequence[E2bSandboxRow]) -> None:
        if not rows:
            return
        keys = [self._e2b_ends_key]
        args: list[str] = []
        for row in rows:
            keys += [self._e2b_key(row.sandbox_id), self._e2b_running_key(row.namespace)]
            running = row.state == "running"
            args += [
                row.sandbox_id,
                str(row.revision),
                _running_end(row),
                repr(row.started_at_s) if running else "",
            ]
        await self._index_e2b(keys=keys, args=args)

    async def e2b_sandboxes_present(self, sandbox_ids: Sequence[str]) -> set[str]:
        """``EXISTS`` of each id's hash, pipelined (one round trip)."""
        ids = list(sandbox_ids)
        if not ids:
            return set()
        with map_redis_errors("e2b_sandboxes_present"):
            async with self._client.pipeline(transaction=False) as pipe:
                for sandbox_id in ids:
                    pipe.exists(self._e2b_key(sandbox_id))
                found: list[int] = await pipe.execute()
        return {sandbox_id for sandbox_id, n in zip(ids, found, strict=True) if n}

    async def e2b_kept_merged(self, namespace: str) -> bool:
        """``EXISTS`` of the namespace's merge mark."""
        with map_redis_errors("e2b_kept_merged"):
            return bool(await self._client.exists(self._e2b_kept_merged_key(namespace)))

    async def mark_e2b_kept_merged(self, namespace: str, *, ttl_s: float) -> None:
        """``SET`` the namespace's merge mark with a TTL of ``ttl_s`` (in milliseconds)."""
        with map_redis_errors("mark_e2b_kept_merged"):
            await self._client.set(
                self._e2b_kept_merged_key(namespace), b"1", px=max(1, int(ttl_s * 1000))
            )

    async def _rows(self, ids: list[str]) -> list[bytes | str | None]:
        """Each id's ``row`` field, in one round trip (``None`` where its hash is gone)."""
        if not ids:
            return []
        async with self._client.pipeline(transaction=False) as pipe:
            for sandbox_id in ids:
                pipe.hget(self._e2b_key(sandbox_id), "row")
            raws: list[bytes | str | None] = await pipe.execute()
        return raws

    async def update_e2b_sandbox(self, row: E2bSandboxRow) -> bool:
        """Compare-and-set on ``revision`` (``UPDATE_E2B_LUA``)."""
        key = self._e2b_key(row.sandbox_id)
        with map_redis_errors("update_e2b_sandbox"):
            done = await self._update_e2b(
                keys=[key, self._e2b_ends_key, self._e2b_running_key(row.namespace)],
                args=[
                    str(row.revision - 1),
                    str(row.revision),
                    row.to_json(),
                    row.namespace,
                    row.sandbox_id,
                    _running_end(row),
                    repr(row.started_at_s),
                ],
            )
        return bool(done)

    async def remove_e2b_sandbox(self, sandbox_id: str) -> bool:
        """Read the row's namespace, then ``REMOVE_E2B_LUA`` (which marks the id killed);
        with no row, the mark and the id's removal from the zset in one transaction."""
        key = self._e2b_key(sandbox_id)
        killed = self._e2b_killed_key(sandbox_id)
        with map_redis_errors("remove_e2b_sandbox"):
            namespace = await self._client.hget(key, "ns")
            if namespace is None:
                async with self._client.pipeline(transaction=True) as pipe:
                    pipe.set(killed, b"1", ex=KILLED_E2B_TTL_S)
                    pipe.zrem(self._e2b_all_key, sandbox_id)
                    pipe.zrem(self._e2b_ends_key, sandbox_id)
                    await pipe.execute()
                return False
            ns = text(namespace)
            keys = [
                key,
                self._e2b_all_key,
                self._e2b_ns_key(ns),
                self._legacy_e2b_ns_key(ns),
                killed,
                self._e2b_by_start_key(ns),
                self._e2b_ends_key,
                self._e2b_running_key(ns),
            ]
            done = await self._remove_e2b(keys=keys, args=[sandbox_id, ns, KILLED_E2B_TTL_S])
        return bool(done)

    async def e2b_sandbox_killed(self, sandbox_id: str) -> bool:
        """``EXISTS`` of the id's killed mark (its TTL is ``KILLED_E2B_TTL_S``)."""
        with map_redis_errors("e2b_sandbox_killed"):
            return bool(await self._client.exists(self._e2b_killed_key(sandbox_id)))


def _running_end(row: E2bSandboxRow) -> str:
    """The row's ``e2b_ends`` score: its end if it is running, else '' (no entry)."""
    return repr(row.end_at_s) if row.state == "running" else ""


def _namespace_hash(namespace: str) -> str:
    return hashlib.sha256(namespace.encode()).hexdigest()


def _decoded(sandbox_id: str, raw: bytes | str) -> E2bSandboxRow | None:
    row = decode_row(sandbox_id, raw)
    if row is None:
        logger.warning("e2b sandbox row %s is unreadable; treating it as missing", sandbox_id)
    return row
