"""The room check of every create and resume (``SANDCELL_E2B_MAX_SANDBOXES``) counts a
tenant's running rows (``e2b_running_count``) and reads them only at the limit: a
count that runs high (an index entry an older orchestrator's pause left, in Redis and
SQLite) refuses nothing the rows allow, and the read puts the entry right. Every
registry backend (Redis the real redis-server); rows are written directly and the
manager launches nothing (an admitted create stops at its launch)."""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path
from typing import Any

import msgspec
import pytest

from sandcell_orchestrator.e2b.errors import E2bError
from sandcell_orchestrator.e2b.sandboxes import E2bSandboxes
from sandcell_orchestrator.providers.base import SandboxSpec
from sandcell_orchestrator.providers.local import LocalProvider, LocalSettings
from sandcell_orchestrator.registry import (
    E2bSandboxRow,
    InProcessRegistry,
    RedisRegistry,
    SessionRegistry,
    SqliteRegistry,
)
from sandcell_orchestrator.sessions.manager import SandboxManager
from sandcell_orchestrator.snapshots import DirectorySnapshotStore
from tests.e2b_api.registries import backend, e2b_row, redis_url

__all__ = ["backend", "redis_url"]

LIMIT = 3


class _Admitted(Exception):
    """Raised where an admitted create would launch its sandbox."""


class _NoLaunch(SandboxManager):
    async def acquire(self, session_id: str, spec: SandboxSpec, *, owner: str) -> Any:
        raise _Admitted


class _Table:
    """The registry, counting the reads of a tenant's running rows."""

    def __init__(self, inner: SessionRegistry) -> None:
        self._inner = inner
        self.row_reads = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def e2b_running_of(self, namespace: str) -> list[E2bSandboxRow]:
        self.row_reads += 1
        rows: list[E2bSandboxRow] = await self._inner.e2b_running_of(namespace)
        return rows


def _row(state: str = "running") -> E2bSandboxRow:
    return e2b_row(state=state, end_at_s=1_765_000_300.0)


async def _older_orchestrators_pause(registry: SessionRegistry, row: E2bSandboxRow) -> None:
    """The row paused as an orchestrator before the running indexes writes it: the row
    alone, its index entries left as they were."""
    paused = msgspec.structs.replace(row, state="paused", revision=row.revision + 1)
    if isinstance(registry, RedisRegistry):
        key = f"{registry.prefix}e2b:{row.sandbox_id}"
        await registry._client.hset(key, mapping={"rev": "2", "row": paused.to_json()})
    else:
        assert isinstance(registry, SqliteRegistry)
        with contextlib.closing(sqlite3.connect(registry.path)) as db, db:
            db.execute(
                "UPDATE e2b_sandboxes SET revision = ?, raw = ? WHERE sandbox_id = ?",
                (paused.revision, paused.to_json(), row.sandbox_id),
            )


async def test_the_room_check_reads_the_rows_only_at_the_limit(
    backend: SessionRegistry, tmp_path: Path
) -> None:
    table = _Table(backend)
    async with DirectorySnapshotStore(tmp_path / "snapshots") as store:
        provider = LocalProvider(LocalSettings(runtime_dir=tmp_path / "rt"))
        manager = _NoLaunch(provider, table, store)  # type: ignore[arg-type]
        sandboxes = E2bSandboxes(manager, max_running_per_tenant=LIMIT, keep_at_exit=True)

        async def create() -> None:
            await sandboxes.create(
                owner="tenant-a",
                template="base",
                timeout_s=None,
                metadata={},
                env={},
                auto_pause=False,
            )

        try:
            running = [_row() for _ in range(LIMIT - 1)]
            for row in [*running, _row("paused"), _row("paused")]:
                assert await backend.add_e2b_sandbox(row)
            # Below the limit (paused rows do not count): admitted on the count alone.
            with pytest.raises(_Admitted):
                await create()
            assert table.row_reads == 0

            assert await backend.add_e2b_sandbox(_row())
            with pytest.raises(E2bError) as refused:
                await create()
            assert refused.value.status == 429
            assert table.row_reads == 1

            if isinstance(backend, InProcessRegistry):
                return  # an in-process table has no older writer
            # An older orchestrator pauses one: the count still says the limit, the
            # rows do not. The read admits the create and puts the index right.
            await _older_orchestrators_pause(backend, running[0])
            assert await backend.e2b_running_count("tenant-a") == LIMIT
            with pytest.raises(_Admitted):
                await create()
            assert table.row_reads == 2
            if isinstance(backend, RedisRegistry):
                assert await backend.e2b_running_count("tenant-a") == LIMIT - 1
        finally:
            await sandboxes.aclose()
            await manager.aclose(destroy_sandboxes=False)
            await provider.close()
