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
    """A second add of one id is refused; listings are per namespace, by start time."""
    ns, other = f"ns-{secrets.token_hex(4)}", f"other {secrets.token_hex(4)}:x"
    late, early, theirs = new_row(ns, 20.0), new_row(ns, 10.0), new_row(other, 5.0)
    for row in (late, early, theirs):
        assert await registry.add_e2b_sandbox(row)
    assert not await registry.add_e2b_sandbox(msgspec.structs.replace(late, namespace=other))
    assert await registry.e2b_sandbox(late.sandbox_id) == late
    assert await registry.e2b_sandboxes(ns) == [early, late]
    assert await registry.e2b_sandboxes(other) == [theirs]
    everyone = [r.sandbox_id for r in await registry.e2b_sandboxes()]
    assert [r for r in everyone if r in {late.sandbox_id, early.sandbox_id}] == [
        early.sandbox_id,
        late.sandbox_id,
    ]
    assert await registry.e2b_sandbox(new_row().sandbox_id) is None
    assert await registry.e2b_sandboxes("nobody") == []


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
    assert await registry.e2b_sandboxes(ns) == []
    assert row.sandbox_id not in {r.sandbox_id for r in await registry.e2b_sandboxes()}
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


async def _every_page(registry: SessionRegistry, namespace: str, *, limit: int) -> list[list[str]]:
    """``e2b_sandboxes_of`` pages of ``limit``, each after the last id of the one before,
    up to the first short page."""
    pages: list[list[str]] = []
    after: str | None = None
    while True:
        rows = await registry.e2b_sandboxes_of(namespace, after=after, limit=limit)
        assert all(row.namespace == namespace for row in rows)
        pages.append([row.sandbox_id for row in rows])
        if len(rows) < limit:
            return pages
        after = rows[-1].sandbox_id


async def test_a_namespace_pages_by_sandbox_id_after_and_limit(registry: SessionRegistry) -> None:
    """``e2b_sandboxes_of``: the namespace's rows above ``after``, in id order (not start
    time), the first ``limit``; pages chained by the last id give each row once, every
    page but the last full, and never another namespace's row (interleaved by id)."""
    ns, other = f"ns-{secrets.token_hex(4)}", f"other {secrets.token_hex(4)}"
    mine = [new_row(ns, started_at_s=float(1_000 - n)) for n in range(25)]
    theirs = [new_row(other) for _ in range(10)]
    for row in mine + theirs:
        assert await registry.add_e2b_sandbox(row)
    by_id = sorted(mine, key=lambda row: row.sandbox_id)
    ids = [row.sandbox_id for row in by_id]

    assert await registry.e2b_sandboxes_of(ns) == by_id
    assert await registry.e2b_sandboxes_of(ns, after=ids[9], limit=3) == by_id[10:13]
    assert await registry.e2b_sandboxes_of(ns, after=ids[-1]) == []
    assert await registry.e2b_sandboxes_of(ns, limit=0) == []
    assert await registry.e2b_sandboxes_of("nobody", limit=5) == []
    for limit in (1, 2, 3, 7, 24, 25, 26, 100):
        pages = await _every_page(registry, ns, limit=limit)
        assert [sandbox_id for page in pages for sandbox_id in page] == ids, limit
        assert all(len(page) == limit for page in pages[:-1]), limit
    assert [r.sandbox_id for r in await registry.e2b_sandboxes_of(other)] == sorted(
        row.sandbox_id for row in theirs
    )
    # The start-time listing (the timeout sweep, the room check) is unchanged.
    assert await registry.e2b_sandboxes(ns) == sorted(mine, key=lambda row: row.started_at_s)
    with pytest.raises(ValueError, match="limit"):
        await registry.e2b_sandboxes_of(ns, limit=-1)


async def test_a_removed_row_leaves_the_pages(registry: SessionRegistry) -> None:
    """A row removed between two pages is in neither the next page nor any later one;
    the pages around it stay full."""
    ns = f"ns-{secrets.token_hex(4)}"
    rows = sorted((new_row(ns) for _ in range(6)), key=lambda row: row.sandbox_id)
    for row in rows:
        assert await registry.add_e2b_sandbox(row)
    first = await registry.e2b_sandboxes_of(ns, limit=2)
    assert first == rows[:2]
    assert await registry.remove_e2b_sandbox(rows[3].sandbox_id)
    rest = await registry.e2b_sandboxes_of(ns, after=first[-1].sandbox_id, limit=3)
    assert rest == [rows[2], rows[4], rows[5]]


async def test_sqlite_pages_read_past_unreadable_rows(tmp_path: Path) -> None:
    """A row SQLite holds but cannot decode is skipped and the range read on past it: a
    page is short only at the end."""
    registry = SqliteRegistry(tmp_path / "registry.sqlite3")
    try:
        rows = sorted((new_row("tenant-a") for _ in range(7)), key=lambda row: row.sandbox_id)
        for row in rows:
            assert await registry.add_e2b_sandbox(row)
        with contextlib.closing(sqlite3.connect(registry.path)) as db, db:
            for broken in (rows[1], rows[2]):
                db.execute(
                    "UPDATE e2b_sandboxes SET raw = ? WHERE sandbox_id = ?",
                    (b"{not json", broken.sandbox_id),
                )
        usable = [rows[0], *rows[3:]]
        assert await registry.e2b_sandboxes_of("tenant-a", limit=3) == usable[:3]
        assert await _every_page(registry, "tenant-a", limit=2) == [
            [row.sandbox_id for row in usable[n : n + 2]] for n in range(0, 6, 2)
        ]
    finally:
        await registry.close()
