"""A snapshot delete cut short is finished by the next listing, on moto's S3 and a directory.

A delete removes the meta (the id is unknown from then on), the workspace, then the
index entry. An entry left without its meta is a delete cut short: the listing that
finds it does not show it and deletes what is left (the workspace, then the entry),
after checking the meta is gone indeed (a snapshot added after the metas were listed
has an entry and a meta).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sandcell_orchestrator.e2b.sandbox import new_sandbox_id
from sandcell_orchestrator.e2b.saved import SavedSnapshots, SnapshotMeta
from sandcell_orchestrator.snapshots import (
    DirectorySnapshotStore,
    S3SnapshotStore,
    SnapshotStore,
    SnapshotUnavailableError,
)
from sandcell_orchestrator.snapshots.whole import put_whole
from tests.orchestrator.conftest import S3Server, s3_server

__all__ = ["s3_server"]

TENANT = "tenant-a"


class _DeleteFails:
    """A store whose deletes of keys containing ``failing`` fail (an S3 outage in the
    middle of a delete); everything else is the real store's."""

    def __init__(self, store: SnapshotStore) -> None:
        self._store = store
        self.failing: str | None = None

    def __getattr__(self, name: str) -> object:
        return getattr(self._store, name)

    async def delete(self, key: str) -> None:
        if self.failing is not None and self.failing in key:
            raise SnapshotUnavailableError("delete: store unreachable")
        await self._store.delete(key)


@pytest.fixture(params=["directory", "s3"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[SnapshotStore]:
    backend: SnapshotStore
    if request.param == "directory":
        backend = DirectorySnapshotStore(tmp_path / "snapshots")
    else:
        server: S3Server = request.getfixturevalue("s3_server")
        backend = S3SnapshotStore(server.settings(f"e2b-index-{uuid.uuid4().hex[:8]}"))
    async with backend:
        yield backend


async def _taken(saved: SavedSnapshots, *, name: str | None = None) -> SnapshotMeta:
    meta = SnapshotMeta(
        snapshot_id=new_sandbox_id(),
        namespace=TENANT,
        template="base",
        sandbox_id="s" * 20,
        session_id="rt_" + "0" * 64,
        created_at_s=1.0,
        name=name,
    )
    await put_whole(saved.store, saved.data_key(TENANT, meta.snapshot_id), b"w", max_bytes=8)
    assert await saved.add(meta) is True
    return meta


async def _keys(store: SnapshotStore) -> list[str]:
    return sorted(entry.key for entry in await store.list("e2b-snapshot"))


async def test_a_delete_cut_short_is_finished_by_the_next_listing(store: SnapshotStore) -> None:
    """The workspace's delete fails after the meta's: the delete raises, the snapshot is
    unknown and unlisted, and the next listing removes its workspace and its entry."""
    failing = _DeleteFails(store)
    saved = SavedSnapshots(failing, max_per_tenant=5)  # type: ignore[arg-type]  # a double
    kept = await _taken(saved)
    cut = await _taken(saved, name="app")
    failing.failing = "e2b-snapshot-data/"
    with pytest.raises(SnapshotUnavailableError):
        await saved.delete(TENANT, cut.snapshot_id)
    assert await saved.get(TENANT, cut.snapshot_id) is None
    # Still failing: not listed, the delete not finished yet (the next listing tries).
    assert [s.snapshot_id for s in await saved.summaries(TENANT)] == [kept.snapshot_id]
    assert any(cut.snapshot_id in key for key in await _keys(store))
    failing.failing = None
    assert [s.snapshot_id for s in await saved.summaries(TENANT)] == [kept.snapshot_id]
    assert [key for key in await _keys(store) if cut.snapshot_id in key] == []
    assert await saved.named(TENANT, "app") == []
    # The kept snapshot's three objects are all still there.
    assert len([key for key in await _keys(store) if kept.snapshot_id in key]) == 3


async def test_an_entry_whose_meta_came_after_the_metas_listing_stays(
    store: SnapshotStore,
) -> None:
    """An entry without a listed meta whose meta exists (written after the metas were
    listed, or past their page) is no delete cut short: nothing of it is removed."""
    saved = SavedSnapshots(store, max_per_tenant=1)
    first = await _taken(saved)
    # Past the cap's page (``ids`` lists at most cap + 1): a second and a third meta,
    # written behind ``add``'s back, as by an orchestrator with a larger cap.
    others = [await _taken(SavedSnapshots(store, max_per_tenant=5)) for _ in range(2)]
    assert await saved.summaries(TENANT)
    for meta in [first, *others]:
        assert await saved.get(TENANT, meta.snapshot_id) == meta
        assert len([key for key in await _keys(store) if meta.snapshot_id in key]) == 3


async def test_a_finished_delete_leaves_nothing(store: SnapshotStore) -> None:
    saved = SavedSnapshots(store, max_per_tenant=5)
    meta = await _taken(saved, name="app")
    assert await saved.delete(TENANT, meta.snapshot_id) is True
    assert await _keys(store) == []
    assert await saved.summaries(TENANT) == []
