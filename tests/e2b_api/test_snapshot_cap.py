"""``SavedSnapshots`` on a directory store: the per-tenant cap and the tenant wall."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandcell_orchestrator.e2b.sandbox import new_sandbox_id
from sandcell_orchestrator.e2b.saved import (
    SavedSnapshots,
    SnapshotMeta,
    parse_snapshot_name,
    snapshot_ref,
    team_slug,
)
from sandcell_orchestrator.snapshots.directory import DirectorySnapshotStore
from sandcell_orchestrator.snapshots.whole import put_whole


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
