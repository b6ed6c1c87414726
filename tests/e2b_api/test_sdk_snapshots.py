"""E2B's snapshots through the real ``e2b`` SDK: ``create_snapshot``, ``Sandbox.create``
from the snapshot id, ``list_snapshots``, ``delete_snapshot``, and the tenant wall."""

from __future__ import annotations

import pytest
from e2b import Sandbox
from e2b.exceptions import SandboxException, SandboxNotFoundException

from tests.e2b_api.conftest import KEY_B, E2bServe


def test_snapshot_create_from_list_and_delete(e2b_serve: E2bServe) -> None:
    """A snapshot keeps the workspace (the source runs on); a sandbox made from it has
    the files; it is listed until deleted, and a create from a deleted one is a 404."""
    opts = e2b_serve.opts()
    source = Sandbox.create(**opts)
    made: Sandbox | None = None
    try:
        source.files.write("keep/me.txt", "in the snapshot")
        info = source.create_snapshot()
        assert info.snapshot_id.endswith(":default")
        # The source keeps running, and what it writes after is not in the snapshot.
        source.files.write("keep/later.txt", "after the snapshot")
        assert source.is_running() is True

        listed = Sandbox.list_snapshots(**opts).next_items()
        assert info.snapshot_id in {s.snapshot_id for s in listed}
        mine = Sandbox.list_snapshots(sandbox_id=source.sandbox_id, **opts).next_items()
        assert [s.snapshot_id for s in mine] == [info.snapshot_id]
        assert Sandbox.list_snapshots(sandbox_id="z" * 20, **opts).next_items() == []

        made = Sandbox.create(info.snapshot_id, **opts)
        assert made.sandbox_id != source.sandbox_id
        assert made.files.read("keep/me.txt") == "in the snapshot"
        assert made.files.exists("keep/later.txt") is False
        assert made.commands.run("cat keep/me.txt").stdout == "in the snapshot"
        made.kill()
        made = None

        assert Sandbox.delete_snapshot(info.snapshot_id, **opts) is True
        assert Sandbox.delete_snapshot(info.snapshot_id, **opts) is False
        listed = Sandbox.list_snapshots(**opts).next_items()
        assert info.snapshot_id not in {s.snapshot_id for s in listed}
        # The SDK's create turns E2B's 404 for an unknown template into this.
        with pytest.raises(SandboxException, match=r"^404: template .* not found$"):
            Sandbox.create(info.snapshot_id, **opts)
    finally:
        if made is not None:
            made.kill()
        source.kill()


def test_another_tenants_snapshot_is_unknown(e2b_serve: E2bServe) -> None:
    """Tenant B gets, for A's snapshot, exactly what it gets for an id nobody made."""
    opts, other = e2b_serve.opts(), e2b_serve.opts(KEY_B)
    source = Sandbox.create(**opts)
    try:
        source.files.write("secret.txt", "tenant a's")
        info = source.create_snapshot()
        unknown = "q" * 20 + ":default"
        assert Sandbox.list_snapshots(**other).next_items() == []
        with pytest.raises(SandboxException, match=r"^404") as seen:
            Sandbox.create(info.snapshot_id, **other)
        with pytest.raises(SandboxException, match=r"^404") as missing:
            Sandbox.create(unknown, **other)
        assert str(seen.value).replace(info.snapshot_id, "ID") == str(missing.value).replace(
            unknown, "ID"
        )
        assert Sandbox.delete_snapshot(info.snapshot_id, **other) is False
        # Still A's, untouched by B's attempts.
        assert Sandbox.delete_snapshot(info.snapshot_id, **opts) is True
    finally:
        source.kill()


def test_fork_makes_sandboxes_with_the_files(e2b_serve: E2bServe) -> None:
    """``fork(count=2)``: two new sandboxes with the source's files (the source runs on);
    the fork's snapshot is not left behind; another tenant's fork is a 404."""
    opts = e2b_serve.opts()
    source = Sandbox.create(**opts)
    forks: list[Sandbox] = []
    try:
        source.files.write("forked.txt", "from the source")
        results = source.fork(count=2, timeout=120)
        forks = [r for r in results if isinstance(r, Sandbox)]
        assert len(forks) == 2, results
        assert len({f.sandbox_id for f in forks} | {source.sandbox_id}) == 3
        for fork in forks:
            assert fork.files.read("forked.txt") == "from the source"
        assert source.is_running() is True
        assert Sandbox.list_snapshots(**opts).next_items() == []
        with pytest.raises(SandboxNotFoundException):
            Sandbox.fork(source.sandbox_id, **e2b_serve.opts(KEY_B))
    finally:
        for fork in forks:
            fork.kill()
        source.kill()
