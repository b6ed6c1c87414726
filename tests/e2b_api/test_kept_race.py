"""A paused sandbox's kept row (``e2b/kept.py``) when a change of the paused row on one
worker races its resume on the other, then a wipe of the registry.

The change read the paused row and is held just before it keeps the paused row it is
about to write in the store; the other worker resumes the sandbox meanwhile (its kept
row deleted after the resume's write). The change then keeps its row, after that
delete, and its compare-and-set fails; it re-reads a running row and lands on it: the
kept row it wrote must go too, or a later wipe would bring back as paused a sandbox
that was running. Paused again, the kept row holds the change, and
after a wipe (every key of the workers' registry prefix deleted) the sandbox is found
paused with it and resumes.

Two workers' ``E2bSandboxes`` in this process over one redis-server and one S3
(``test_network_race``'s set-up).
"""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio

from sandcell_orchestrator.e2b.errors import E2bError
from sandcell_orchestrator.e2b.kept import KeptRows
from sandcell_orchestrator.registry import E2bSandboxRow
from tests.e2b_api.test_network_race import (
    OWNER,
    _Gate,
    _paused_sandbox,
    _released,
    _while_held,
    _Worker,
    workers,
)
from tests.orchestrator.conftest import redis_url, s3_server

__all__ = ["redis_url", "s3_server", "workers"]


class _HeldKept(KeptRows):
    """The real kept rows; the first ``keep`` is held until the gate is released."""

    def __init__(self, inner: KeptRows) -> None:
        super().__init__(inner.store)
        self.gate: _Gate | None = _Gate(lambda _row: True)

    async def keep(self, row: E2bSandboxRow) -> None:
        gate, self.gate = self.gate, None
        if gate is not None:
            gate.held.set()
            await gate.release.wait()
        await super().keep(row)


async def test_a_timeout_change_racing_a_resume_leaves_no_stale_kept_row(
    workers: tuple[_Worker, _Worker], redis_url: str
) -> None:
    """Two's timeout change of the paused sandbox is held before it keeps its row; one
    resumes it; two's row is kept after that, and its change lands on the running row.
    No kept row is left; paused again, a wipe finds it paused with two's end, and it
    resumes (``test_wiped_redis``: with its files)."""
    one, two = workers
    sandbox_id = await _paused_sandbox(one)
    try:
        changing = await two.sandboxes.get(sandbox_id, owner=OWNER)
        held = _HeldKept(two.sandboxes.kept)
        two.sandboxes.kept = two.sandboxes.views.kept = held
        assert held.gate is not None
        gate = held.gate
        change = asyncio.create_task(two.sandboxes.set_timeout(changing, 3_000))
        await _while_held(gate, change)
        assert await two.sandboxes.kept.read(OWNER, sandbox_id) is not None

        resumed = await one.sandboxes.connect(
            await one.sandboxes.get(sandbox_id, owner=OWNER), timeout_s=None
        )
        assert resumed.state == "running"

        await _released(gate, change)
        assert changing.state == "running"
        end_at_s = changing.end_at_s
        assert await one.sandboxes.kept.read(OWNER, sandbox_id) is None

        paused = await one.sandboxes.get(sandbox_id, owner=OWNER)
        assert await one.sandboxes.pause(paused) is True
        assert (await one.sandboxes.kept.read(OWNER, sandbox_id)) == paused.row

        prefix = two.registry.prefix
        client = redis.asyncio.Redis.from_url(redis_url)
        keys = [key async for key in client.scan_iter(match=f"{prefix}*")]
        await client.delete(*keys)
        await client.aclose()

        with pytest.raises(E2bError) as missing:
            await two.sandboxes.get(sandbox_id, owner="tenant-b")
        assert missing.value.status == 404
        found = await two.sandboxes.get(sandbox_id, owner=OWNER)
        assert found.state == "paused"
        assert found.end_at_s == end_at_s
        assert found.row.revision > paused.row.revision
        back = await two.sandboxes.connect(found, timeout_s=None)
        assert back.state == "running"
        assert back.handle is not None
    finally:
        await one.sandboxes.kill(await one.sandboxes.get(sandbox_id, owner=OWNER))
    assert await one.sandboxes.kept.read(OWNER, sandbox_id) is None
