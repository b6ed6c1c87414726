"""The E2B sandbox table in Redis (``E2bSandboxTable`` of ``RedisRegistry``).

<prefix>e2b:<id>           hash  rev, ns, row (E2bSandboxRow JSON) of one sandbox
<prefix>e2b_all            zset  id -> started_at_s, every sandbox (the timeout sweep)
<prefix>e2b_ns:<sha256>    zset  id -> started_at_s, one namespace's (hashed: any text)
"""

from __future__ import annotations

import hashlib
import logging
from functools import cached_property

from redis.commands.core import AsyncScript

from .e2b import E2bSandboxRow, decode_row, validate_e2b_sandbox_id
from .redis_db import RedisDatabase, map_redis_errors, text

__all__ = ["ADD_E2B_LUA", "REMOVE_E2B_LUA", "UPDATE_E2B_LUA", "RedisE2bTable"]

logger = logging.getLogger(__name__)

# KEYS[1] row hash, KEYS[2] every sandbox's zset, KEYS[3] the namespace's zset
# ARGV[1] row JSON, ARGV[2] started_at_s, ARGV[3] sandbox id, ARGV[4] namespace,
# ARGV[5] the row's revision
# Returns 1 if added, 0 if the id is taken.
ADD_E2B_LUA = """
if redis.call('exists', KEYS[1]) == 1 then
    return 0
end
redis.call('hset', KEYS[1], 'rev', ARGV[5], 'ns', ARGV[4], 'row', ARGV[1])
redis.call('zadd', KEYS[2], ARGV[2], ARGV[3])
redis.call('zadd', KEYS[3], ARGV[2], ARGV[3])
return 1
"""

# KEYS[1] row hash
# ARGV[1] the revision expected, ARGV[2] the new revision, ARGV[3] row JSON, ARGV[4] namespace
# Returns 1 if replaced, 0 if the stored row is another revision, another namespace's or gone.
UPDATE_E2B_LUA = """
if redis.call('hget', KEYS[1], 'rev') == ARGV[1]
        and redis.call('hget', KEYS[1], 'ns') == ARGV[4] then
    redis.call('hset', KEYS[1], 'rev', ARGV[2], 'row', ARGV[3])
    return 1
end
return 0
"""

# KEYS[1] row hash, KEYS[2] every sandbox's zset, KEYS[3] the namespace's zset
# ARGV[1] sandbox id, ARGV[2] namespace (the row's: the namespace zset is its)
# Returns 1 if removed, 0 if there was no such row of that namespace.
REMOVE_E2B_LUA = """
redis.call('zrem', KEYS[2], ARGV[1])
redis.call('zrem', KEYS[3], ARGV[1])
if redis.call('hget', KEYS[1], 'ns') == ARGV[2] then
    redis.call('del', KEYS[1])
    return 1
end
return 0
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

    def _e2b_key(self, sandbox_id: str) -> str:
        return f"{self._prefix}e2b:{validate_e2b_sandbox_id(sandbox_id)}"

    @property
    def _e2b_all_key(self) -> str:
        return f"{self._prefix}e2b_all"

    def _e2b_ns_key(self, namespace: str) -> str:
        return f"{self._prefix}e2b_ns:{hashlib.sha256(namespace.encode()).hexdigest()}"

    async def add_e2b_sandbox(self, row: E2bSandboxRow) -> bool:
        """Store a row at its revision (``ADD_E2B_LUA``); ``False`` if the id is taken."""
        keys = [self._e2b_key(row.sandbox_id), self._e2b_all_key, self._e2b_ns_key(row.namespace)]
        with map_redis_errors("add_e2b_sandbox"):
            added = await self._add_e2b(
                keys=keys,
                args=[
                    row.to_json(),
                    row.started_at_s,
                    row.sandbox_id,
                    row.namespace,
                    str(row.revision),
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
        """The ids of the sorted set, then each row (ids whose row is gone are skipped)."""
        index = self._e2b_all_key if namespace is None else self._e2b_ns_key(namespace)
        with map_redis_errors("e2b_sandboxes"):
            members = await self._client.zrange(index, 0, -1)
            ids = [text(member) for member in members if isinstance(member, bytes | str)]
            if not ids:
                return []
            async with self._client.pipeline(transaction=False) as pipe:
                for sandbox_id in ids:
                    pipe.hget(self._e2b_key(sandbox_id), "row")
                raws = await pipe.execute()
        rows = [
            _decoded(sandbox_id, raw)
            for sandbox_id, raw in zip(ids, raws, strict=True)
            if raw is not None
        ]
        found = [r for r in rows if r is not None and namespace in (None, r.namespace)]
        return sorted(found, key=lambda r: (r.started_at_s, r.sandbox_id))

    async def update_e2b_sandbox(self, row: E2bSandboxRow) -> bool:
        """Compare-and-set on ``revision`` (``UPDATE_E2B_LUA``)."""
        key = self._e2b_key(row.sandbox_id)
        with map_redis_errors("update_e2b_sandbox"):
            done = await self._update_e2b(
                keys=[key],
                args=[str(row.revision - 1), str(row.revision), row.to_json(), row.namespace],
            )
        return bool(done)

    async def remove_e2b_sandbox(self, sandbox_id: str) -> bool:
        """Read the row's namespace, then ``REMOVE_E2B_LUA``."""
        key = self._e2b_key(sandbox_id)
        with map_redis_errors("remove_e2b_sandbox"):
            namespace = await self._client.hget(key, "ns")
            if namespace is None:
                await self._client.zrem(self._e2b_all_key, sandbox_id)
                return False
            ns = text(namespace)
            done = await self._remove_e2b(
                keys=[key, self._e2b_all_key, self._e2b_ns_key(ns)], args=[sandbox_id, ns]
            )
        return bool(done)


def _decoded(sandbox_id: str, raw: bytes | str) -> E2bSandboxRow | None:
    row = decode_row(sandbox_id, raw)
    if row is None:
        logger.warning("e2b sandbox row %s is unreadable; treating it as missing", sandbox_id)
    return row
