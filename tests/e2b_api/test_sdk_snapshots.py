"""E2B's snapshots through the real ``e2b`` SDK: ``create_snapshot``, ``Sandbox.create``
from the snapshot id, ``list_snapshots``, ``delete_snapshot``, and the tenant wall."""

from __future__ import annotations

from typing import Any

import pytest
from e2b import Sandbox, SandboxQuery
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
        assert Sandbox.list_snapshots(sandbox_id=source.sandbox_id, **opts).next_items() == []
        with pytest.raises(SandboxNotFoundException):
            Sandbox.fork(source.sandbox_id, **e2b_serve.opts(KEY_B))
    finally:
        for fork in forks:
            fork.kill()
        source.kill()


def test_named_snapshots_as_e2b_names_them(e2b_serve: E2bServe) -> None:
    """``create_snapshot(name=)``: E2B's ``<team slug>/<name>:<tag>`` id and ``names``;
    a create by the bare name, the namespaced one or a tag; the name again moves the
    tag to the new snapshot; listing by name; delete by name removes every tag."""
    opts = e2b_serve.opts()
    source = Sandbox.create(**opts)
    try:
        source.files.write("v.txt", "one")
        first = source.create_snapshot(name="app")
        assert (first.snapshot_id, first.names) == ("tenant-a/app:default", ["tenant-a/app"])
        source.files.write("v.txt", "two")
        tagged = source.create_snapshot(name="tenant-a/app:v2")
        assert (tagged.snapshot_id, tagged.names) == ("tenant-a/app:v2", ["tenant-a/app"])
        for ref, want in (("app", "one"), ("tenant-a/app:default", "one"), ("app:v2", "two")):
            assert _read_from(ref, "v.txt", opts) == want, ref
        # The name and tag again: the newer snapshot answers it, the older is gone.
        source.files.write("v.txt", "three")
        again = source.create_snapshot(name="app")
        assert again.snapshot_id == "tenant-a/app:default"
        assert _read_from("app", "v.txt", opts) == "three"

        # One entry per name, its newest; an unnamed snapshot has no names.
        unnamed = source.create_snapshot()
        assert unnamed.names == []
        listed = Sandbox.list_snapshots(sandbox_id=source.sandbox_id, **opts).next_items()
        assert [(s.snapshot_id, s.names) for s in listed] == [
            (unnamed.snapshot_id, []),
            ("tenant-a/app:default", ["tenant-a/app"]),
        ]
        pages = Sandbox.list_snapshots(sandbox_id=source.sandbox_id, limit=1, **opts)
        assert [s.snapshot_id for s in pages.next_items()] == [unnamed.snapshot_id]
        assert pages.has_next is True
        assert [s.snapshot_id for s in pages.next_items()] == ["tenant-a/app:default"]
        assert pages.has_next is False
        by_tag = Sandbox.list_snapshots(name="app:v2", **opts).next_items()
        assert [s.snapshot_id for s in by_tag] == ["tenant-a/app:v2"]
        with pytest.raises(SandboxException, match="must match your team 'tenant-a'"):
            source.create_snapshot(name="tenant-b/app")
        with pytest.raises(SandboxException, match=r"^400: Invalid name: invalid template ID"):
            source.create_snapshot(name="no good!")

        assert Sandbox.delete_snapshot("tenant-a/app", **opts) is True
        assert Sandbox.delete_snapshot("app:v2", **opts) is False
        assert Sandbox.delete_snapshot(unnamed.snapshot_id, **opts) is True
        assert Sandbox.list_snapshots(sandbox_id=source.sandbox_id, **opts).next_items() == []
        with pytest.raises(SandboxException, match=r"^404: template .* not found$"):
            Sandbox.create("app:v2", **opts)
    finally:
        source.kill()


def _read_from(template: str, path: str, opts: dict[str, Any]) -> str:
    """``path`` as a sandbox created from ``template`` has it (the sandbox killed)."""
    sandbox = Sandbox.create(template, **opts)
    try:
        return sandbox.files.read(path)
    finally:
        sandbox.kill()


def test_another_tenants_name_is_unknown(e2b_serve: E2bServe) -> None:
    """Tenant B's create, delete and listing by A's name answer as for a name nobody
    took; B's own name of the same spelling is B's."""
    opts, other = e2b_serve.opts(), e2b_serve.opts(KEY_B)
    source = Sandbox.create(**opts)
    try:
        source.files.write("secret.txt", "tenant a's")
        source.create_snapshot(name="shared")
        with pytest.raises(SandboxException, match=r"^404") as seen:
            Sandbox.create("tenant-a/shared", **other)
        with pytest.raises(SandboxException, match=r"^404") as missing:
            Sandbox.create("tenant-a/nobodys", **other)
        assert str(seen.value).replace("shared", "X") == str(missing.value).replace("nobodys", "X")
        with pytest.raises(SandboxException, match=r"^404"):
            Sandbox.create("shared", **other)
        assert Sandbox.delete_snapshot("tenant-a/shared", **other) is False
        assert Sandbox.delete_snapshot("shared", **other) is False
        assert Sandbox.list_snapshots(name="shared", **other).next_items() == []
        mine = Sandbox.list_snapshots(sandbox_id=source.sandbox_id, **opts).next_items()
        assert [s.snapshot_id for s in mine] == ["tenant-a/shared:default"]
        assert Sandbox.delete_snapshot("tenant-a/shared:default", **opts) is True
    finally:
        source.kill()


def test_a_paused_sandbox_is_not_snapshotted(e2b_serve: E2bServe) -> None:
    """E2B snapshots only a sandbox live on a node: a paused one is its 404, the SDK's
    ``SandboxNotFoundException``; fork likewise."""
    opts = e2b_serve.opts()
    source = Sandbox.create(**opts)
    try:
        source.pause()
        with pytest.raises(SandboxNotFoundException):
            Sandbox.create_snapshot(source.sandbox_id, **opts)
        with pytest.raises(SandboxNotFoundException):
            Sandbox.fork(source.sandbox_id, **opts)
        assert Sandbox.list_snapshots(sandbox_id=source.sandbox_id, **opts).next_items() == []
    finally:
        source.kill()


def test_a_sandbox_reports_the_snapshot_it_was_made_from(e2b_serve: E2bServe) -> None:
    """As E2B: a sandbox made from a snapshot has the snapshot's template id (and, named,
    its name as ``SandboxInfo.name``), which the listing's ``template`` filter finds it
    by; a served template is its own name; a fork reports its source's template."""
    opts = e2b_serve.opts()
    source = Sandbox.create(**opts)
    made: list[Sandbox] = []
    try:
        assert (source.get_info().template_id, source.get_info().name) == ("base", "base")
        unnamed = source.create_snapshot()
        named = source.create_snapshot(name="tmpl-app")
        plain = Sandbox.create(unnamed.snapshot_id, **opts)
        made.append(plain)
        assert plain.get_info().template_id == unnamed.snapshot_id.removesuffix(":default")
        assert plain.get_info().name is None
        app = Sandbox.create("tmpl-app", **opts)
        made.append(app)
        app_info = app.get_info()
        assert app_info.name == "tmpl-app"
        assert app_info.template_id not in ("base", "tmpl-app")

        def listed(template: str) -> set[str]:
            query = SandboxQuery(template=template)
            return {s.sandbox_id for s in Sandbox.list(query=query, **opts).next_items()}

        assert listed("tmpl-app") == {app.sandbox_id}
        assert listed(f"{named.names[0]}") == {app.sandbox_id}
        assert listed(app_info.template_id) == {app.sandbox_id}
        assert listed(plain.get_info().template_id) == {plain.sandbox_id}
        assert source.sandbox_id in listed("base")
        assert not {plain.sandbox_id, app.sandbox_id} & listed("base")
        with pytest.raises(SandboxException, match="tags are not supported"):
            listed("tmpl-app:default")

        plain.kill()  # the tenant's third running sandbox is the fork
        results = app.fork(count=1, timeout=120)
        forks = [f for f in results if isinstance(f, Sandbox)]
        made.extend(forks)
        assert len(forks) == 1, results
        fork_info = forks[0].get_info()
        assert (fork_info.template_id, fork_info.name) == (app_info.template_id, "tmpl-app")
        Sandbox.delete_snapshot(unnamed.snapshot_id, **opts)
        Sandbox.delete_snapshot(named.snapshot_id, **opts)
    finally:
        for sandbox in made:
            sandbox.kill()
        source.kill()
