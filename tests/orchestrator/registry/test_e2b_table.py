"""The registry's E2B sandbox table (issue 20: E2B sandboxes across workers), against
every backend: rows added once, found by id and namespace, changed by compare-and-set
on their revision, removed; tokens and env never in a row's repr."""

from __future__ import annotations

import contextlib
import secrets
import sqlite3
from pathlib import Path

import msgspec
import pytest

from sandcell_orchestrator.registry import E2bSandboxRow, SessionRegistry, SqliteRegistry
from sandcell_protocol import EgressPolicy


def new_row(namespace: str = "tenant-a", started_at_s: float = 1_700_000_000.0) -> E2bSandboxRow:
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    return E2bSandboxRow(
        sandbox_id="".join(secrets.choice(alphabet) for _ in range(20)),
        namespace=namespace,
        template="base",
        session_id="rt_" + "0" * 64,
        access_token="access-secret",
        traffic_token="traffic-secret",
        metadata={"k": "v"},
        env={"SECRET_ENV": "hush"},
        egress=EgressPolicy(mode="allow", allow=("pypi.org",)),
        started_at_s=started_at_s,
        end_at_s=started_at_s + 300,
        auto_pause=False,
        state="running",
    )


async def test_rows_are_added_once_and_found_by_id_and_namespace(
    registry: SessionRegistry,
) -> None:
    """A second add of one id is refused (also into another namespace); a namespace's
    listing and its running rows are its own, the whole table everyone's, by start time."""
    ns, other = f"ns-{secrets.token_hex(4)}", f"other {secrets.token_hex(4)}:x"
    late, early, theirs = new_row(ns, 20.0), new_row(ns, 10.0), new_row(other, 5.0)
    for row in (late, early, theirs):
        assert await registry.add_e2b_sandbox(row)
    assert not await registry.add_e2b_sandbox(msgspec.structs.replace(late, namespace=other))
    assert await registry.e2b_sandbox(late.sandbox_id) == late
    assert await registry.e2b_sandboxes_by_start(ns, limit=10) == [early, late]
    assert await registry.e2b_sandboxes_by_start(other, limit=10) == [theirs]
    assert await registry.e2b_running_of(ns) == [early, late]
    assert await registry.e2b_running_of(other) == [theirs]
    assert await registry.e2b_running_count(ns) == 2
    assert await registry.e2b_running_count(other) == 1
    assert await registry.e2b_sandboxes() == [theirs, early, late]
    assert await registry.e2b_sandbox(new_row().sandbox_id) is None
    assert await registry.e2b_sandboxes_by_start("nobody", limit=10) == []
    assert await registry.e2b_running_count("nobody") == 0


async def test_updates_are_compare_and_set_on_the_revision(registry: SessionRegistry) -> None:
    """Only the next revision of what is stored replaces it; another namespace never does."""
    row = new_row(f"ns-{secrets.token_hex(4)}")
    assert await registry.add_e2b_sandbox(row)
    paused = msgspec.structs.replace(row, state="paused", revision=2)
    assert await registry.update_e2b_sandbox(paused)
    # A writer that read revision 1 too is refused: it would undo the pause unseen.
    stale = msgspec.structs.replace(row, end_at_s=row.end_at_s + 60, revision=2)
    assert not await registry.update_e2b_sandbox(stale)
    skipping = msgspec.structs.replace(paused, revision=4)
    assert not await registry.update_e2b_sandbox(skipping)
    moved = msgspec.structs.replace(paused, namespace="thief", revision=3)
    assert not await registry.update_e2b_sandbox(moved)
    assert await registry.e2b_sandbox(row.sandbox_id) == paused


async def test_removed_rows_are_gone_everywhere(registry: SessionRegistry) -> None:
    """Remove answers whether there was a row; a removed row is in no listing."""
    ns = f"ns-{secrets.token_hex(4)}"
    row = new_row(ns)
    assert await registry.add_e2b_sandbox(row)
    assert await registry.remove_e2b_sandbox(row.sandbox_id)
    assert not await registry.remove_e2b_sandbox(row.sandbox_id)
    assert await registry.e2b_sandbox(row.sandbox_id) is None
    assert await registry.e2b_sandboxes_by_start(ns, limit=10) == []
    assert await registry.e2b_running_of(ns) == []
    assert await registry.e2b_running_count(ns) == 0
    assert await registry.e2b_due(1e12, limit=10) == []
    assert await registry.e2b_sandboxes() == []
    assert not await registry.update_e2b_sandbox(msgspec.structs.replace(row, revision=2))


async def test_a_removal_marks_the_id_killed(registry: SessionRegistry) -> None:
    """Remove marks the id killed, with a row or without one (a kill of a row a wipe
    took); an id never removed is not, a re-added one still is (a kill racing a pause's
    kept row: ``e2b/kept.py``)."""
    row, other, never = new_row(), new_row(), new_row()
    assert await registry.add_e2b_sandbox(row)
    assert not await registry.e2b_sandbox_killed(row.sandbox_id)
    assert await registry.remove_e2b_sandbox(row.sandbox_id)
    assert await registry.e2b_sandbox_killed(row.sandbox_id)
    assert await registry.add_e2b_sandbox(row)
    assert await registry.e2b_sandbox_killed(row.sandbox_id)
    assert not await registry.remove_e2b_sandbox(other.sandbox_id)
    assert await registry.e2b_sandbox_killed(other.sandbox_id)
    assert not await registry.e2b_sandbox_killed(never.sandbox_id)


@pytest.mark.parametrize("sandbox_id", ["", "UPPERCASE0123456789A", "a" * 21, "../" + "a" * 17])
async def test_ids_of_another_shape_never_reach_a_key(
    registry: SessionRegistry, sandbox_id: str
) -> None:
    """An id this service never hands out is a ValueError, before any storage key."""
    with pytest.raises(ValueError, match="sandbox_id"):
        await registry.e2b_sandbox(sandbox_id)
    with pytest.raises(ValueError, match="sandbox_id"):
        await registry.remove_e2b_sandbox(sandbox_id)
    with pytest.raises(ValueError, match="sandbox_id"):
        await registry.e2b_sandbox_killed(sandbox_id)


def test_a_row_hides_its_secrets() -> None:
    """Tokens and env are the sandbox's secrets: never in a repr (logs, tracebacks)."""
    shown = repr(new_row())
    for secret in ("access-secret", "traffic-secret", "hush"):
        assert secret not in shown


async def test_a_rebuilt_row_is_added_at_its_own_revision(registry: SessionRegistry) -> None:
    """A row rebuilt from the store after a wipe goes on past its last revision: writes
    based on any older revision are refused, the next one lands."""
    row = msgspec.structs.replace(new_row(f"ns-{secrets.token_hex(4)}"), state="paused")
    rebuilt = msgspec.structs.replace(row, revision=7)
    assert await registry.add_e2b_sandbox(rebuilt)
    assert await registry.e2b_sandbox(row.sandbox_id) == rebuilt
    assert not await registry.update_e2b_sandbox(msgspec.structs.replace(row, revision=2))
    assert not await registry.update_e2b_sandbox(msgspec.structs.replace(row, revision=7))
    resumed = msgspec.structs.replace(rebuilt, state="running", revision=8)
    assert await registry.update_e2b_sandbox(resumed)
    assert await registry.e2b_sandbox(row.sandbox_id) == resumed


async def test_a_removed_row_leaves_the_pages(registry: SessionRegistry) -> None:
    """A row removed between two pages by start time is in neither the next page nor any
    later one; the pages around it stay full."""
    ns = f"ns-{secrets.token_hex(4)}"
    rows = [new_row(ns, started_at_s=100.0 + n) for n in range(6)]
    for row in rows:
        assert await registry.add_e2b_sandbox(row)
    first = await registry.e2b_sandboxes_by_start(ns, limit=2)
    assert first == rows[:2]
    assert await registry.remove_e2b_sandbox(rows[3].sandbox_id)
    after = (first[-1].started_at_s, first[-1].sandbox_id)
    rest = await registry.e2b_sandboxes_by_start(ns, after=after, limit=3)
    assert rest == [rows[2], rows[4], rows[5]]


async def test_sqlite_reads_past_unreadable_rows(tmp_path: Path) -> None:
    """A row SQLite holds but cannot decode is skipped and the range read on past it: a
    page by start time is short only at the end. The count of running rows reads no
    row, so it counts it: a room check at the limit confirms by ``e2b_running_of``."""
    registry = SqliteRegistry(tmp_path / "registry.sqlite3")
    try:
        rows = [new_row("tenant-a", started_at_s=100.0 + n) for n in range(7)]
        for row in rows:
            assert await registry.add_e2b_sandbox(row)
        with contextlib.closing(sqlite3.connect(registry.path)) as db, db:
            for broken in (rows[1], rows[2]):
                db.execute(
                    "UPDATE e2b_sandboxes SET raw = ? WHERE sandbox_id = ?",
                    (b"{not json", broken.sandbox_id),
                )
        usable = [rows[0], *rows[3:]]
        assert await registry.e2b_sandboxes_by_start("tenant-a", limit=3) == usable[:3]
        pages = [await registry.e2b_sandboxes_by_start("tenant-a", limit=2)]
        while len(pages[-1]) == 2:
            after = (pages[-1][-1].started_at_s, pages[-1][-1].sandbox_id)
            pages.append(await registry.e2b_sandboxes_by_start("tenant-a", after=after, limit=2))
        assert pages == [usable[n : n + 2] for n in range(0, 6, 2)]
        assert await registry.e2b_running_of("tenant-a") == usable
        assert await registry.e2b_running_count("tenant-a") == 7
    finally:
        await registry.close()
