"""``E2bSandboxes.expire`` (the timeout sweep every worker runs twice a second) reads
the registry's due rows (``e2b_due``), not its whole E2B table, but for its first
sweep and one every ``FULL_SWEEP_S``, which catch rows an older orchestrator wrote
(missing from the index); an auto-pause at the timeout that keeps failing is retried a
bounded number of times, then the sandbox is killed. Every registry backend (Redis
the real redis-server); rows are written directly: the sweep kills them (no runner is
started)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from sandcell_orchestrator.e2b.sandbox import E2bSandbox
from sandcell_orchestrator.e2b.sandboxes import (
    FULL_SWEEP_S,
    TIMEOUT_PAUSE_ATTEMPTS,
    E2bSandboxes,
)
from sandcell_orchestrator.providers.local import LocalProvider, LocalSettings
from sandcell_orchestrator.registry import (
    E2bSandboxRow,
    SessionRegistry,
)
from sandcell_orchestrator.sessions.manager import SandboxManager
from sandcell_orchestrator.snapshots import DirectorySnapshotStore, SnapshotUnavailableError
from tests.e2b_api.registries import backend, e2b_row, redis_url

__all__ = ["backend", "redis_url"]

NOW = 1_765_000_000.0


class _Table:
    """The registry, counting whole-table reads and hiding ``unindexed`` rows from
    ``e2b_due``, as rows an older orchestrator wrote are missing from the index."""

    def __init__(self, inner: SessionRegistry) -> None:
        self._inner = inner
        self.whole_reads = 0
        self.due_rows: list[int] = []
        self.unindexed: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def e2b_sandboxes(self) -> list[E2bSandboxRow]:
        self.whole_reads += 1
        rows: list[E2bSandboxRow] = await self._inner.e2b_sandboxes()
        return rows

    async def e2b_due(self, now_s: float, *, limit: int) -> list[E2bSandboxRow]:
        rows: list[E2bSandboxRow] = await self._inner.e2b_due(now_s, limit=limit)
        rows = [row for row in rows if row.sandbox_id not in self.unindexed]
        self.due_rows.append(len(rows))
        return rows


def _row(end_at_s: float) -> E2bSandboxRow:
    return e2b_row(started_at_s=end_at_s - 300, end_at_s=end_at_s)


async def test_a_sweep_reads_the_due_rows_and_the_whole_table_now_and_then(
    backend: SessionRegistry, tmp_path: Path
) -> None:
    clock = [NOW]
    table = _Table(backend)
    async with DirectorySnapshotStore(tmp_path / "snapshots") as store:
        provider = LocalProvider(LocalSettings(runtime_dir=tmp_path / "rt"))
        manager = SandboxManager(provider, table, store)  # type: ignore[arg-type]
        sandboxes = E2bSandboxes(manager, keep_at_exit=True, wall_clock=lambda: clock[0])
        try:
            running = [_row(NOW + 10_000 + n) for n in range(30)]
            first_due, first_old = _row(NOW - 5), _row(NOW - 1)
            for row in [*running, first_due, first_old]:
                assert await backend.add_e2b_sandbox(row)
            table.unindexed.add(first_old.sandbox_id)

            # The first sweep reads the table: both due rows go, indexed or not.
            assert await sandboxes.expire() == 2
            assert table.whole_reads == 1
            assert await backend.e2b_sandbox(first_old.sandbox_id) is None

            due, old = _row(NOW + 1), _row(NOW + 2)
            for row in (due, old):
                assert await backend.add_e2b_sandbox(row)
            table.unindexed.add(old.sandbox_id)
            clock[0] = NOW + 3
            # Later sweeps read the due rows only: the unindexed one waits.
            assert await sandboxes.expire() == 1
            assert await sandboxes.expire() == 0
            assert table.whole_reads == 1
            assert table.due_rows == [1, 0]
            assert await backend.e2b_sandbox(due.sandbox_id) is None
            assert await backend.e2b_sandbox(old.sandbox_id) is not None

            # ``FULL_SWEEP_S`` on, the table again: the unindexed row goes too.
            clock[0] = NOW + FULL_SWEEP_S
            assert await sandboxes.expire() == 1
            assert table.whole_reads == 2
            assert await backend.e2b_sandbox(old.sandbox_id) is None
            survivors = await backend.e2b_sandboxes()
            assert {row.sandbox_id for row in survivors} == {row.sandbox_id for row in running}
        finally:
            await sandboxes.aclose()
            await manager.aclose(destroy_sandboxes=False)
            await provider.close()


async def test_an_auto_pause_that_keeps_failing_is_killed_after_its_attempts(
    backend: SessionRegistry, tmp_path: Path
) -> None:
    """A store that stays down: the timeout's auto-pause is tried
    ``TIMEOUT_PAUSE_ATTEMPTS`` times, 30 s apart, then the sandbox is killed and counted
    (it used to be retried every 30 s for ever, running on past its timeout)."""
    clock = [NOW]
    attempts: list[str] = []
    async with DirectorySnapshotStore(tmp_path / "snapshots") as store:
        provider = LocalProvider(LocalSettings(runtime_dir=tmp_path / "rt"))
        manager = SandboxManager(provider, backend, store)
        sandboxes = E2bSandboxes(manager, keep_at_exit=True, wall_clock=lambda: clock[0])

        async def pause(sandbox: E2bSandbox) -> bool:
            attempts.append(sandbox.sandbox_id)
            raise SnapshotUnavailableError("the store is unreachable")

        sandboxes.pause = pause  # type: ignore[method-assign]
        try:
            row = msgspec.structs.replace(_row(NOW - 1), auto_pause=True)
            assert await backend.add_e2b_sandbox(row)
            for attempt in range(1, TIMEOUT_PAUSE_ATTEMPTS):
                assert await sandboxes.expire() == 1
                assert len(attempts) == attempt
                # Not tried again before its retry time.
                assert await sandboxes.expire() == 0
                assert await backend.e2b_sandbox(row.sandbox_id) is not None
                clock[0] += 30
            assert await sandboxes.expire() == 1
            assert len(attempts) == TIMEOUT_PAUSE_ATTEMPTS
            assert await backend.e2b_sandbox(row.sandbox_id) is None
            rendered = manager.metrics.render()
            assert 'sandcell_e2b_timeout_pause_kills_total{reason="failed"} 1' in rendered
        finally:
            await sandboxes.aclose()
            await manager.aclose(destroy_sandboxes=False)
            await provider.close()
