"""The E2B table's indexes of running sandboxes, on every backend: by end
(``e2b_due``: what the timeout sweep reads twice a second on every worker, instead of
every row): a running row is due once its end has passed, soonest first; a pause, a
kill or a later end takes it out, a resume or an earlier end puts it (back) in; and
by namespace (``e2b_running_of`` and its count: the room check and the v1 listing)."""

from __future__ import annotations

import contextlib
import secrets
import sqlite3
from pathlib import Path

import msgspec
import pytest

from sandcell_orchestrator.registry import E2bSandboxRow, SessionRegistry, SqliteRegistry
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


async def test_a_namespaces_running_rows_are_read_alone(registry: SessionRegistry) -> None:
    """``e2b_running_of``: the namespace's running rows by start time, not its paused
    ones nor another namespace's (``e2b_running_count``: how many); a pause takes a row
    out, a resume puts it back, a kill takes it out; ``e2b_index`` of rows as they are
    changes nothing."""
    ns, other = f"ns-{secrets.token_hex(4)}", f"other {secrets.token_hex(4)}"
    late, early = _ending(ns, 900.0), _ending(ns, 500.0)
    paused, theirs = _ending(ns, 100.0, state="paused"), _ending(other, 300.0)
    for row in (late, paused, theirs, early):
        assert await registry.add_e2b_sandbox(row)
    assert await registry.e2b_running_count(ns) == 2
    assert await registry.e2b_running_of(ns) == [early, late]
    assert await registry.e2b_running_count(other) == 1
    assert await registry.e2b_running_of(other) == [theirs]
    assert await registry.e2b_running_count("nobody") == 0
    assert await registry.e2b_running_of("nobody") == []

    now_paused = msgspec.structs.replace(early, state="paused", revision=2)
    assert await registry.update_e2b_sandbox(now_paused)
    assert await registry.e2b_running_count(ns) == 1
    assert await registry.e2b_running_of(ns) == [late]
    resumed = msgspec.structs.replace(paused, state="running", revision=2)
    assert await registry.update_e2b_sandbox(resumed)
    assert await registry.e2b_running_count(ns) == 2
    assert await registry.e2b_running_of(ns) == [resumed, late]
    assert await registry.remove_e2b_sandbox(late.sandbox_id)
    assert await registry.e2b_running_count(ns) == 1
    assert await registry.e2b_running_of(ns) == [resumed]

    await registry.e2b_index([resumed, now_paused, theirs])
    # A stale read (revision 1 of a row now at 2) is not applied.
    await registry.e2b_index([early, paused])
    assert await registry.e2b_running_count(ns) == 1
    assert await registry.e2b_running_of(ns) == [resumed]
    assert _ids(await registry.e2b_due(1e9, limit=10)) == _ids([resumed, theirs])
    await registry.e2b_index([])


async def test_sqlite_rows_from_before_the_index_are_indexed_by_e2b_index(tmp_path: Path) -> None:
    """A running row written before ``e2b_ends`` (none in it) is neither due nor running
    to the indexes until the full sweep gives it to ``e2b_index``."""
    registry = SqliteRegistry(tmp_path / "registry.sqlite3")
    try:
        row = _ending("tenant-a", 100.0)
        assert await registry.add_e2b_sandbox(row)
        with contextlib.closing(sqlite3.connect(registry.path)) as db, db:
            db.execute("DELETE FROM e2b_ends")
        assert await registry.e2b_due(1e9, limit=10) == []
        assert await registry.e2b_running_count("tenant-a") == 0
        assert await registry.e2b_running_of("tenant-a") == []
        await registry.e2b_index(await registry.e2b_sandboxes())
        assert await registry.e2b_due(1e9, limit=10) == [row]
        assert await registry.e2b_running_count("tenant-a") == 1
        assert await registry.e2b_running_of("tenant-a") == [row]
    finally:
        await registry.close()
