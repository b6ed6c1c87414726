"""The E2B sandbox table in Redis (``E2bSandboxTable`` of ``RedisRegistry``).

<prefix>e2b:<id>             hash  rev, ns, row (E2bSandboxRow JSON) of one sandbox
<prefix>e2b_all              zset  id -> started_at_s, every sandbox
<prefix>e2b_ends             zset  id -> end_at_s, every running sandbox (the timeout
                                   sweep reads the ones due, not every row)
<prefix>e2b_nsrun:<sha256>   zset  id -> started_at_s, one namespace's running sandboxes
                                   (the room check counts them, the v1 listing reads them)
<prefix>e2b_nsids:<sha256>   zset  one namespace's ids (hashed: any text), all scored 0:
                                   what ``e2b_nsstart`` is filled in from
<prefix>e2b_nsstart:<sha256> zset  the same ids scored by started_at_s: the E2B
                                   listing's order, start time then id
<prefix>e2b_kept_merged:<sha256>  string  set (with a TTL) once a listing found the
                                   namespace's kept rows all in the table
<prefix>e2b_ns:<sha256>      zset  the same scored by started_at_s, as orchestrators
                                   before ``e2b_nsids`` kept it
<prefix>e2b_killed:<id>      string  set (with a TTL) by the removal of the id's row:
                                   a kill, not a wipe (``e2b_sandbox_killed``)

The E2B listing goes by start time: ``e2b_nsstart``, paged from a row's ``(score, id)``
by the row's rank while it is there, by its score once it is gone. Orchestrators
before it kept only ``e2b_nsids`` (and ``e2b_all``), and no read pages ``e2b_nsids``
any more: it stays as the source the listing's script (``PAGE_E2B_BY_START_LUA``)
fills ``e2b_nsstart`` from, adding every id it lacks (scored from ``e2b_all``)
whenever it holds fewer, for the rows such an orchestrator added (also during a
rolling upgrade). A zset left by an even older orchestrator (``e2b_ns``, or added to
by one still running) is moved into ``e2b_nsids``, and deleted, by that script too,
atomically, so no id is lost; a removal takes the id out of every key, so the move
cannot bring a removed id back.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import cached_property

from redis.commands.core import AsyncScript

from ..tenants import tenant_digest
from .e2b import (
    KILLED_E2B_TTL_S,
    E2bSandboxRow,
    E2bStartKey,
    decode_row,
    validate_e2b_sandbox_id,
)
from .index import check_page_limit
from .redis_db import RedisDatabase, map_redis_errors, text
from .redis_e2b_scripts import (
    ADD_E2B_LUA,
    INDEX_E2B_LUA,
    PAGE_E2B_BY_START_LUA,
    PRUNE_E2B_IDS_LUA,
    REMOVE_E2B_LUA,
    UPDATE_E2B_LUA,
)

__all__ = ["RedisE2bTable"]

logger = logging.getLogger(__name__)


class RedisE2bTable(RedisDatabase):
    """``E2bSandboxTable`` on one hash per sandbox and sorted sets of ids (the key
    layout above), changed by the scripts of ``redis_e2b_scripts``."""

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
        return f"{self._prefix}e2b_nsids:{tenant_digest(namespace)}"

    def _e2b_by_start_key(self, namespace: str) -> str:
        return f"{self._prefix}e2b_nsstart:{tenant_digest(namespace)}"

    def _e2b_running_key(self, namespace: str) -> str:
        return f"{self._prefix}e2b_nsrun:{tenant_digest(namespace)}"

    def _e2b_kept_merged_key(self, namespace: str) -> str:
        return f"{self._prefix}e2b_kept_merged:{tenant_digest(namespace)}"

    def _e2b_killed_key(self, sandbox_id: str) -> str:
        return f"{self._prefix}e2b_killed:{validate_e2b_sandbox_id(sandbox_id)}"

    def _legacy_e2b_ns_key(self, namespace: str) -> str:
        return f"{self._prefix}e2b_ns:{tenant_digest(namespace)}"

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

    async def e2b_sandboxes(self) -> list[E2bSandboxRow]:
        """``e2b_all``'s ids, then each row (ids whose row is gone are skipped)."""
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
                found += await self._rows_of(namespace, ids, index=keys[0])
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
            read = await self._read_indexed(ids, key, namespace=namespace)
        return [row for row in read if row.state == "running"]

    async def e2b_running_count(self, namespace: str) -> int:
        """``ZCARD`` of the namespace's running zset: no row is read.

        An entry an older orchestrator left wrong (its pause or kill of the row, which
        knows no ``e2b_nsrun``) is counted, not put right: telling it apart takes the
        row, and reading every row of the zset is what the count is there to spare the
        room check of every create. Counting it is safe: the count only ever runs high,
        and a room check at the limit confirms by ``e2b_running_of``, which puts the
        entry right, so it refuses no create the rows would allow."""
        with map_redis_errors("e2b_running_count"):
            count = await self._client.zcard(self._e2b_running_key(namespace))
        return int(count)

    async def e2b_index(self, rows: Sequence[E2bSandboxRow]) -> None:
        """``INDEX_E2B_LUA`` for ``rows`` as they were read (500 to a script)."""
        with map_redis_errors("e2b_index"):
            for first in range(0, len(rows), 500):
                await self._index(rows[first : first + 500])

    async def _read_indexed(
        self,
        ids: list[str],
        index: str,
        *,
        namespace: str | None = None,
        ends: dict[str, float] | None = None,
    ) -> list[E2bSandboxRow]:
        """The rows of ``ids`` (entries of the zset ``index``; of ``e2b_ends`` with
        their scores, ``ends``), with the entries that do not match their row put right:
        a gone row's taken out (``_rows_of``), a paused row's
        or one whose end is not its score re-indexed at its revision (``INDEX_E2B_LUA``)."""
        rows = await self._rows_of(namespace, ids, index=index)
        wrong = [
            row
            for row in rows
            if row.state != "running" or (ends is not None and ends[row.sandbox_id] != row.end_at_s)
        ]
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

    async def _rows_of(
        self, namespace: str | None, ids: list[str], *, index: str
    ) -> list[E2bSandboxRow]:
        """The rows of ``ids`` (a page of the zset ``index``) that are readable and
        ``namespace``'s (any with ``None``); the ids whose hash is gone are taken out of
        ``index`` (``PRUNE_E2B_IDS_LUA``: an older orchestrator's removal leaves them)."""
        rows: list[E2bSandboxRow] = []
        missing: list[str] = []
        for sandbox_id, raw in zip(ids, await self._rows(ids), strict=True):
            if raw is None:
                missing.append(sandbox_id)
                continue
            row = _decoded(sandbox_id, raw)
            if row is not None and namespace in (None, row.namespace):
                rows.append(row)
        if missing:
            await self._prune_e2b_ids(
                keys=[index, *(self._e2b_key(i) for i in missing)], args=missing
            )
        return rows

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


def _decoded(sandbox_id: str, raw: bytes | str) -> E2bSandboxRow | None:
    row = decode_row(sandbox_id, raw)
    if row is None:
        logger.warning("e2b sandbox row %s is unreadable; treating it as missing", sandbox_id)
    return row
