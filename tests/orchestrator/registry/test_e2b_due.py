"""The E2B table's index of running sandboxes by end (``e2b_due``: what the timeout
sweep reads twice a second on every worker, instead of every row), on every backend:
a running row is due once its end has passed, soonest first; a pause, a kill or a
later end takes it out, a resume or an earlier end puts it (back) in."""

from __future__ import annotations

import secrets

import msgspec
import pytest

from sandcell_orchestrator.registry import E2bSandboxRow, SessionRegistry
from tests.orchestrator.registry.test_e2b_table import new_row


def _ending(namespace: str, end_at_s: float, *, state: str = "running") -> E2bSandboxRow:
    row = new_row(namespace, started_at_s=end_at_s - 300)
    return msgspec.structs.replace(row, end_at_s=end_at_s, state=state)  # type: ignore[arg-type]


def _ids(rows: list[E2bSandboxRow]) -> list[str]:
    return [row.sandbox_id for row in rows]


async def test_running_rows_are_due_once_they_end_soonest_first(
    registry: SessionRegistry,
) -> None:
    ns, other = f"ns-{secrets.token_hex(4)}", f"other {secrets.token_hex(4)}"
    soon, later, theirs = _ending(ns, 100.0), _ending(ns, 200.0), _ending(other, 150.0)
    paused = _ending(ns, 50.0, state="paused")
    for row in (later, paused, theirs, soon):
        assert await registry.add_e2b_sandbox(row)
    assert await registry.e2b_due(99.0, limit=10) == []
    assert await registry.e2b_due(100.0, limit=10) == [soon]
    assert _ids(await registry.e2b_due(1e9, limit=10)) == _ids([soon, theirs, later])
    assert await registry.e2b_due(1e9, limit=2) == [soon, theirs]
    assert await registry.e2b_due(1e9, limit=0) == []
    with pytest.raises(ValueError, match="limit"):
        await registry.e2b_due(1e9, limit=-1)


async def test_pauses_resumes_new_ends_and_kills_move_a_row_in_and_out(
    registry: SessionRegistry,
) -> None:
    ns = f"ns-{secrets.token_hex(4)}"
    row = _ending(ns, 100.0)
    assert await registry.add_e2b_sandbox(row)
    assert await registry.e2b_due(100.0, limit=10) == [row]

    extended = msgspec.structs.replace(row, end_at_s=500.0, revision=2)
    assert await registry.update_e2b_sandbox(extended)
    assert await registry.e2b_due(499.0, limit=10) == []
    assert await registry.e2b_due(500.0, limit=10) == [extended]

    paused = msgspec.structs.replace(extended, state="paused", revision=3)
    assert await registry.update_e2b_sandbox(paused)
    assert await registry.e2b_due(1e9, limit=10) == []

    resumed = msgspec.structs.replace(paused, state="running", end_at_s=800.0, revision=4)
    assert await registry.update_e2b_sandbox(resumed)
    assert await registry.e2b_due(1e9, limit=10) == [resumed]

    # A write that loses its compare-and-set moves nothing.
    stale = msgspec.structs.replace(resumed, state="paused", revision=4)
    assert not await registry.update_e2b_sandbox(stale)
    assert await registry.e2b_due(1e9, limit=10) == [resumed]

    assert await registry.remove_e2b_sandbox(row.sandbox_id)
    assert await registry.e2b_due(1e9, limit=10) == []
