"""The E2B table's listing by start time (``e2b_sandboxes_by_start``, the order of E2B's
``GET /v2/sandboxes``), its presence check and its merge marks, against every backend.

Pages chained by the last row's ``(started_at_s, sandbox_id)`` give every row once, in
that order or its reverse, ties on the start time by id, every page but the last full;
a page past a row removed since goes on where that row was; another namespace's rows
never show."""

from __future__ import annotations

import secrets

import anyio
import msgspec
import pytest

from sandcell_orchestrator.registry import E2bSandboxRow, E2bStartKey, SessionRegistry
from tests.orchestrator.registry.test_e2b_table import new_row


def _key(row: E2bSandboxRow) -> E2bStartKey:
    return (row.started_at_s, row.sandbox_id)


async def _every_page(
    registry: SessionRegistry, namespace: str, *, limit: int, newest_first: bool
) -> list[list[str]]:
    pages: list[list[str]] = []
    after: E2bStartKey | None = None
    while True:
        rows = await registry.e2b_sandboxes_by_start(
            namespace, after=after, limit=limit, newest_first=newest_first
        )
        pages.append([row.sandbox_id for row in rows])
        if len(rows) < limit:
            return pages
        after = _key(rows[-1])


def _mixed(namespace: str) -> list[E2bSandboxRow]:
    """Rows whose start times are not in id order, four of them at one start time,
    sorted by ``(started_at_s, sandbox_id)``."""
    rows = [new_row(namespace, started_at_s=1_765_000_000.0 + 0.000_001 * n) for n in range(9)]
    rows += [new_row(namespace, started_at_s=1_765_000_000.123456) for _ in range(4)]
    rows += [new_row(namespace, started_at_s=1_700_000_000.5 + n) for n in range(5)]
    return sorted(rows, key=_key)


async def test_pages_by_start_time_either_way_give_every_row_once(
    registry: SessionRegistry,
) -> None:
    ns, other = f"ns-{secrets.token_hex(4)}", f"other {secrets.token_hex(4)}"
    mine = _mixed(ns)
    theirs = [new_row(other, started_at_s=1_765_000_000.0 + n) for n in range(6)]
    for row in [*theirs[:3], *mine, *theirs[3:]]:
        assert await registry.add_e2b_sandbox(row)
    ids = [row.sandbox_id for row in mine]

    assert await registry.e2b_sandboxes_by_start(ns, limit=100) == mine
    assert await registry.e2b_sandboxes_by_start(ns, limit=100, newest_first=True) == mine[::-1]
    for limit in (1, 2, 3, 5, 17, 18, 19, 100):
        for newest_first in (False, True):
            pages = await _every_page(registry, ns, limit=limit, newest_first=newest_first)
            listed = [sandbox_id for page in pages for sandbox_id in page]
            assert listed == (ids[::-1] if newest_first else ids), (limit, newest_first)
            assert all(len(page) == limit for page in pages[:-1]), (limit, newest_first)
    # From the middle of the ties, either way.
    assert await registry.e2b_sandboxes_by_start(ns, after=_key(mine[10]), limit=3) == mine[11:14]
    assert await registry.e2b_sandboxes_by_start(
        ns, after=_key(mine[10]), limit=3, newest_first=True
    ) == [mine[9], mine[8], mine[7]]
    assert await registry.e2b_sandboxes_by_start(ns, after=_key(mine[-1]), limit=5) == []
    assert await registry.e2b_sandboxes_by_start(ns, limit=0) == []
    assert await registry.e2b_sandboxes_by_start("nobody", limit=5) == []
    assert [r.sandbox_id for r in await registry.e2b_sandboxes_by_start(other, limit=9)] == [
        r.sandbox_id for r in sorted(theirs, key=_key)
    ]
    with pytest.raises(ValueError, match="limit"):
        await registry.e2b_sandboxes_by_start(ns, limit=-1)


@pytest.mark.parametrize("newest_first", [False, True])
async def test_a_page_past_a_removed_row_goes_on_where_it_was(
    registry: SessionRegistry, newest_first: bool
) -> None:
    """The next page's ``after`` is the last row of the page before; that row (one of
    the ties, or not) killed in between, the page still starts right past it."""
    ns = f"ns-{secrets.token_hex(4)}"
    rows = _mixed(ns)
    ordered = rows[::-1] if newest_first else rows
    for row in rows:
        assert await registry.add_e2b_sandbox(row)
    for at in range(len(ordered) - 1):
        gone = ordered[at]
        assert await registry.remove_e2b_sandbox(gone.sandbox_id)
        page = await registry.e2b_sandboxes_by_start(
            ns, after=_key(gone), limit=3, newest_first=newest_first
        )
        assert page == ordered[at + 1 : at + 4], at
        assert await registry.add_e2b_sandbox(msgspec.structs.replace(gone, revision=2))


async def test_presence_is_told_without_the_rows(registry: SessionRegistry) -> None:
    ns = f"ns-{secrets.token_hex(4)}"
    here, gone, never = new_row(ns), new_row(ns), new_row(ns)
    for row in (here, gone):
        assert await registry.add_e2b_sandbox(row)
    assert await registry.remove_e2b_sandbox(gone.sandbox_id)
    ids = [here.sandbox_id, gone.sandbox_id, never.sandbox_id]
    assert await registry.e2b_sandboxes_present(ids) == {here.sandbox_id}
    assert await registry.e2b_sandboxes_present([]) == set()
    many = [new_row(ns) for _ in range(1200)]
    assert await registry.e2b_sandboxes_present([r.sandbox_id for r in many] + ids) == {
        here.sandbox_id
    }
    with pytest.raises(ValueError):
        await registry.e2b_sandboxes_present(["../x"])


async def test_a_merge_mark_is_per_namespace_and_runs_out(registry: SessionRegistry) -> None:
    ns, other = f"ns-{secrets.token_hex(4)}", f"other {secrets.token_hex(4)}"
    assert not await registry.e2b_kept_merged(ns)
    await registry.mark_e2b_kept_merged(ns, ttl_s=3600)
    assert await registry.e2b_kept_merged(ns)
    assert not await registry.e2b_kept_merged(other)
    await registry.mark_e2b_kept_merged(other, ttl_s=0.05)
    assert await registry.e2b_kept_merged(other)
    await anyio.sleep(0.2)
    assert not await registry.e2b_kept_merged(other)
    assert await registry.e2b_kept_merged(ns)
