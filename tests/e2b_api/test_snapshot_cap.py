"""``SavedSnapshots`` on a directory store: the per-tenant cap and the tenant wall."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from pathlib import Path

import msgspec
import pytest

from sandcell_orchestrator.e2b.sandbox import new_sandbox_id
from sandcell_orchestrator.e2b.saved import (
    SavedSnapshots,
    SnapshotMeta,
    parse_snapshot_name,
    snapshot_ref,
    team_slug,
)
from sandcell_orchestrator.snapshots import Snapshot, SnapshotEntry, SnapshotUnavailableError
from sandcell_orchestrator.snapshots.directory import DirectorySnapshotStore
from sandcell_orchestrator.snapshots.whole import put_whole
from sandcell_orchestrator.tenants import tenant_digest


def _meta(store: SavedSnapshots, namespace: str) -> SnapshotMeta:
    return SnapshotMeta(
        snapshot_id=new_sandbox_id(),
        namespace=namespace,
        template="base",
        sandbox_id="s" * 20,
        session_id="rt_" + "0" * 64,
        created_at_s=1.0,
    )


async def test_the_cap_counts_one_tenants_snapshots_only(tmp_path: Path) -> None:
    saved = SavedSnapshots(DirectorySnapshotStore(tmp_path), max_per_tenant=2)
    for _ in range(2):
        meta = _meta(saved, "tenant-a")
        await put_whole(
            saved.store, saved.data_key("tenant-a", meta.snapshot_id), b"w", max_bytes=8
        )
        await saved.add(meta)
        assert await saved.get("tenant-b", meta.snapshot_id) is None
        assert await saved.delete("tenant-b", meta.snapshot_id) is False
    assert await saved.has_room("tenant-a") is False
    assert await saved.has_room("tenant-b") is True
    first = (await saved.ids("tenant-a"))[0]
    assert await saved.delete("tenant-a", first) is True
    assert await saved.has_room("tenant-a") is True
    assert not await saved.store.exists(saved.data_key("tenant-a", first))


def test_wire_ids() -> None:
    bare = "a" * 20
    assert snapshot_ref(bare + ":default") == bare
    assert snapshot_ref(bare) == bare
    assert snapshot_ref(bare + ":v2") is None
    assert snapshot_ref("base") is None
    assert snapshot_ref("A" * 20) is None


def test_names_parse_as_e2bs() -> None:
    """E2B's ``id.ParseName``: trimmed, lowercased, ``default`` as no tag."""
    name = parse_snapshot_name(" Team-A/App:V2 ")
    assert (name.namespace, name.alias, name.tag, name.tagged) == ("team-a", "app", "v2", True)
    name = parse_snapshot_name("app:default")
    assert (name.namespace, name.alias, name.tag, name.tagged) == (None, "app", None, True)
    for bad, why in (("a b", "template ID"), ("a:b c", "tag"), ("x.y/a", "namespace")):
        with pytest.raises(ValueError, match=f"^invalid {why}: "):
            parse_snapshot_name(bad)
    assert team_slug("Tenant.A:1") == "tenant-a-1"


async def test_a_workers_snapshots_being_taken_hold_their_places(tmp_path: Path) -> None:
    """``claim`` counts the snapshots this worker is taking: at the cap no claim is
    given, however many are asked for before any meta is written."""
    saved = SavedSnapshots(DirectorySnapshotStore(tmp_path), max_per_tenant=2)
    assert await saved.claim("tenant-a") is True
    assert await saved.claim("tenant-a") is True
    assert await saved.claim("tenant-a") is False
    assert await saved.has_room("tenant-a") is False
    assert await saved.claim("tenant-b") is True
    saved.unclaim("tenant-a")
    assert await saved.claim("tenant-a") is True


async def test_two_workers_racing_for_the_last_place_keep_one(tmp_path: Path) -> None:
    """Two workers (one store) both claim a tenant's last place; the second to write its
    meta counts past the cap and removes its snapshot again: one is kept."""
    store = DirectorySnapshotStore(tmp_path)
    first, second = (SavedSnapshots(store, max_per_tenant=1) for _ in range(2))
    assert await first.claim("tenant-a") is True
    assert await second.claim("tenant-a") is True
    metas = [_meta(first, "tenant-a"), _meta(second, "tenant-a")]
    for meta in metas:
        await put_whole(store, first.data_key("tenant-a", meta.snapshot_id), b"w", max_bytes=8)
    assert await first.add(metas[0]) is True
    assert await second.add(metas[1]) is False
    assert await first.ids("tenant-a") == [metas[0].snapshot_id]
    assert not await store.exists(first.data_key("tenant-a", metas[1].snapshot_id))
    assert await first.get("tenant-a", metas[1].snapshot_id) is None


class _ListFails(DirectorySnapshotStore):
    """A directory store whose listings fail (an S3 outage after a put went through)."""

    failing = False

    async def list(
        self, prefix: str, *, start_after: str | None = None, limit: int | None = None
    ) -> list[SnapshotEntry]:
        if self.failing:
            raise SnapshotUnavailableError("listing: store unreachable")
        return await super().list(prefix, start_after=start_after, limit=limit)


async def test_a_recount_the_store_cannot_answer_keeps_the_snapshot(tmp_path: Path) -> None:
    """The place was claimed before the copy: if the count after the meta's write fails,
    the snapshot is kept (not a failure for a snapshot that then lists)."""
    store = _ListFails(tmp_path)
    saved = SavedSnapshots(store, max_per_tenant=1)
    assert await saved.claim("tenant-a") is True
    meta = _meta(saved, "tenant-a")
    await put_whole(store, saved.data_key("tenant-a", meta.snapshot_id), b"w", max_bytes=8)
    store.failing = True
    assert await saved.add(meta) is True
    store.failing = False
    assert await saved.get("tenant-a", meta.snapshot_id) == meta


class _CountsReads(DirectorySnapshotStore):
    """A directory store that counts the objects read (``get``)."""

    reads = 0

    def get(self, key: str, *, max_bytes: int) -> AbstractAsyncContextManager[Snapshot]:
        self.reads += 1
        return super().get(key, max_bytes=max_bytes)


async def _add(saved: SavedSnapshots, meta: SnapshotMeta) -> None:
    await put_whole(
        saved.store, saved.data_key(meta.namespace, meta.snapshot_id), b"w", max_bytes=8
    )
    assert await saved.add(meta) is True


async def test_a_listing_reads_no_metas(tmp_path: Path) -> None:
    """The listing's summaries come from the index entries' keys: two store listings,
    no reads; a meta with no entry (an older orchestrator's) is read once, its entry
    written; an entry whose meta is gone (a delete cut short) is not listed."""
    store = _CountsReads(tmp_path)
    saved = SavedSnapshots(store, max_per_tenant=10)
    metas = [
        msgspec.structs.replace(_meta(saved, "tenant-a"), created_at_s=1.5 + i, name=name)
        for i, name in enumerate([None, "app", "x" * 240])
    ]
    for meta in metas:
        await _add(saved, meta)
    store.reads = 0
    listed = await saved.summaries("tenant-a")
    assert sorted(s.snapshot_id for s in listed) == sorted(m.snapshot_id for m in metas)
    assert {s.snapshot_id: s for s in listed}[metas[1].snapshot_id] == metas[1].summary()
    # Only the name too long for a key component is read from its meta.
    assert store.reads == 1
    # An older orchestrator's snapshot: a meta and no index entry.
    legacy = _meta(saved, "tenant-a")
    await put_whole(
        store,
        f"e2b-snapshots/{tenant_digest('tenant-a')}/{legacy.snapshot_id}",
        msgspec.json.encode(legacy),
        max_bytes=1 << 16,
    )
    store.reads = 0
    assert legacy.snapshot_id in {s.snapshot_id for s in await saved.summaries("tenant-a")}
    assert store.reads == 2
    store.reads = 0
    await saved.summaries("tenant-a")
    assert store.reads == 1
    # A delete cut short after the meta: the entry left over is not listed.
    await store.delete(f"e2b-snapshots/{tenant_digest('tenant-a')}/{metas[1].snapshot_id}")
    assert metas[1].snapshot_id not in {s.snapshot_id for s in await saved.summaries("tenant-a")}
    assert await saved.summaries("tenant-b") == []
    assert [s.snapshot_id for s in await saved.named("tenant-a", "app")] == []
    assert await saved.delete("tenant-a", metas[0].snapshot_id) is True
    index = await store.list(f"e2b-snapshot-index/{tenant_digest('tenant-a')}/")
    assert not any(e.key.rsplit("/", 1)[1].startswith(metas[0].snapshot_id) for e in index)
