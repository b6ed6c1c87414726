"""A kill on one worker racing a pause on the other: no paused "ghost" is left.

The pausing worker writes the kept row to the store (``KeptRows.keep``) before its
compare-and-set; here that store write is held until the other worker's kill has
dropped the kept row, removed the registry row and destroyed the sandbox. The late
kept row must not bring the sandbox back: the pause answers 404, the kept row is
gone, and a lookup or listing on either worker finds nothing (a 404, as for any
missing sandbox).

Two workers over one redis-server and one S3 (moto), ``two_workers.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec
import pytest

from sandcell_orchestrator.e2b.errors import E2bError
from sandcell_orchestrator.e2b.kept import KeptRows
from sandcell_orchestrator.registry import E2bSandboxRow, RedisRegistry
from tests.e2b_api.two_workers import Worker, running_sandbox, two_workers
from tests.orchestrator.conftest import S3Server, redis_url, s3_server

__all__ = ["redis_url", "s3_server"]

OWNER = "tenant-a"
_WAIT_S = 60.0
"""A bound on each wait, so a broken run fails instead of hanging (not a timing check)."""


class _HeldKept(KeptRows):
    """The real kept rows; ``keep`` stops before its store write until ``release``."""

    def __init__(self, kept: KeptRows) -> None:
        super().__init__(kept.store)
        self.held = asyncio.Event()
        self.release = asyncio.Event()

    async def keep(self, row: E2bSandboxRow) -> None:
        self.held.set()
        await self.release.wait()
        await super().keep(row)


_Worker = Worker[RedisRegistry]


@pytest.fixture
async def workers(redis_url: str, s3_server: S3Server) -> AsyncIterator[tuple[_Worker, _Worker]]:
    async with two_workers(RedisRegistry, redis_url, s3_server, name="e2b-ghost-") as pair:
        yield pair


async def _missing(worker: _Worker, sandbox_id: str) -> None:
    """Neither listed nor found: exactly the 404 of any missing sandbox."""
    listed, _after = await worker.sandboxes.listing.page(OWNER, after=None, limit=10)
    assert sandbox_id not in [sandbox.sandbox_id for sandbox in listed]
    with pytest.raises(E2bError) as caught:
        await worker.sandboxes.get(sandbox_id, owner=OWNER)
    assert (caught.value.status, caught.value.code) == (404, "not_found")


async def test_a_kill_during_a_pauses_kept_row_write_leaves_no_paused_ghost(
    workers: tuple[_Worker, _Worker],
) -> None:
    """Worker one pauses and is held before it writes the kept row; worker two kills
    the sandbox to the end; one's kept row then lands, its compare-and-set finds the
    row gone: the pause is a 404, and no lookup rebuilds the killed sandbox."""
    one, two = workers
    made = await running_sandbox(one, OWNER)
    sandbox_id = made.sandbox_id
    held = _HeldKept(one.sandboxes.kept)
    one.sandboxes.views.kept = held
    pause = asyncio.create_task(one.sandboxes.pause(made))
    stopped = asyncio.create_task(held.held.wait())
    await asyncio.wait({stopped, pause}, timeout=_WAIT_S, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    assert held.held.is_set(), pause.exception() if pause.done() else "never reached keep"

    await two.sandboxes.kill(await two.sandboxes.get(sandbox_id, owner=OWNER))

    held.release.set()
    with pytest.raises(E2bError) as caught:
        async with asyncio.timeout(_WAIT_S):
            await pause
    assert (caught.value.status, caught.value.code) == (404, "not_found")

    assert await two.sandboxes.kept.read(OWNER, sandbox_id) is None
    await _missing(two, sandbox_id)
    await _missing(one, sandbox_id)
    assert await two.registry.e2b_sandbox(sandbox_id) is None


async def test_a_ghost_kept_row_is_dropped_by_the_lookup_that_would_rebuild_it(
    workers: tuple[_Worker, _Worker],
) -> None:
    """A kept row of a killed id (a pauser that wrote it after the kill, then stopped
    before its compare-and-set) is not rebuilt: the listing leaves it out and drops
    it, the lookup is a 404."""
    one, two = workers
    made = await running_sandbox(one, OWNER)
    sandbox_id = made.sandbox_id
    ghost = msgspec.structs.replace(made.row, state="paused", revision=made.row.revision + 1)
    await two.sandboxes.kill(await two.sandboxes.get(sandbox_id, owner=OWNER))
    await one.sandboxes.kept.keep(ghost)

    await _missing(one, sandbox_id)
    assert await one.sandboxes.kept.read(OWNER, sandbox_id) is None
    assert await one.registry.e2b_sandbox(sandbox_id) is None
