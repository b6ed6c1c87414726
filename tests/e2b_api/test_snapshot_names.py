"""E2B snapshot names at their length limit, against a real ``sandcell serve``: a new
snapshot's name and tag are each at most 128 characters, refused with E2B's 400 before
any copy (a 70 KB name was a 500 after the whole workspace copy, its meta past the
64 KiB cap); a longer name stored before the limit still lists, creates and deletes."""

from __future__ import annotations

import anyio
import httpx
import msgspec
from e2b import Sandbox

from sandcell_orchestrator.e2b.saved import SnapshotMeta
from sandcell_orchestrator.snapshots.directory import DirectorySnapshotStore
from sandcell_orchestrator.snapshots.whole import put_whole, read_whole
from sandcell_orchestrator.tenants import tenant_digest
from tests.e2b_api.conftest import KEY_A, E2bServe


def _api(served: E2bServe) -> httpx.Client:
    return httpx.Client(base_url=f"{served.url}/e2b", headers={"X-API-KEY": KEY_A}, timeout=120)


def _stored_data(served: E2bServe) -> list[str]:
    root = served.home / "snapshots" / "e2b-snapshot-data"
    return sorted(p.name for p in root.rglob("*") if p.is_file()) if root.exists() else []


def test_a_name_or_tag_past_128_characters_is_a_400_before_the_copy(e2b_serve: E2bServe) -> None:
    """A 70 KB name, a 129-character name and a 129-character tag are E2B's 400
    ``bad_request`` naming the limit, even for a sandbox that does not exist (the name
    is checked first), and nothing is copied; 128 characters of each are taken."""
    sandbox = Sandbox.create(**e2b_serve.opts())
    try:
        sandbox.files.write("weight.bin", b"w" * (1 << 20))
        with _api(e2b_serve) as api:
            before = _stored_data(e2b_serve)
            for name, what in (
                ("n" * 70_000, "name"),
                ("n" * 129, "name"),
                ("app:" + "t" * 129, "tag"),
                ("tenant-a/" + "n" * 129 + ":v1", "name"),
            ):
                for sandbox_id in (sandbox.sandbox_id, "z" * 20):
                    answer = api.post(f"/sandboxes/{sandbox_id}/snapshots", json={"name": name})
                    assert answer.status_code == 400, (len(name), answer.text)
                    body = answer.json()
                    assert (body["code"], body["error_code"]) == (400, "bad_request"), body
                    assert body["message"].startswith(f"Invalid name: the {what} is "), body
                    assert "at most 128" in body["message"], body
                    assert len(answer.content) < 400, body
            assert _stored_data(e2b_serve) == before
            longest = "n" * 128 + ":" + "t" * 128
            taken = api.post(f"/sandboxes/{sandbox.sandbox_id}/snapshots", json={"name": longest})
            assert taken.status_code == 201, taken.text
            assert taken.json()["snapshotID"] == f"tenant-a/{longest}"
            listed = api.get("/snapshots", params={"name": longest}).json()
            assert [s["snapshotID"] for s in listed] == [f"tenant-a/{longest}"]
            assert api.delete(f"/templates/{'n' * 128}").status_code == 204
            assert api.get("/snapshots").json() == []
    finally:
        sandbox.kill()
    assert "Traceback" not in e2b_serve.log()


def test_a_longer_name_stored_before_the_limit_still_lists_and_deletes(
    e2b_serve: E2bServe,
) -> None:
    """A snapshot whose meta holds a 300-character name (as one taken before the
    limit): it is listed under it, found by it, made a sandbox from, and deleted by it."""
    opts = e2b_serve.opts()
    source = Sandbox.create(**opts)
    try:
        source.files.write("old.txt", "kept from before")
        plain = source.create_snapshot().snapshot_id.removesuffix(":default")
    finally:
        source.kill()
    long_name, old_id = "o" * 300, "y" * 20
    store = DirectorySnapshotStore(e2b_serve.home / "snapshots")
    digest = tenant_digest("tenant-a")

    async def write_old() -> None:
        meta_key = f"e2b-snapshots/{digest}/"
        raw = await read_whole(store, meta_key + plain, max_bytes=1 << 16)
        meta = msgspec.structs.replace(
            msgspec.json.decode(raw, type=SnapshotMeta), snapshot_id=old_id, name=long_name
        )
        data_key = f"e2b-snapshot-data/{digest}/"
        workspace = await read_whole(store, data_key + plain, max_bytes=16 << 20)
        await put_whole(store, data_key + old_id, workspace, max_bytes=16 << 20)
        await put_whole(store, meta_key + old_id, msgspec.json.encode(meta), max_bytes=1 << 16)

    anyio.run(write_old)
    wire = f"tenant-a/{long_name}:default"
    with _api(e2b_serve) as api:
        listed = {s["snapshotID"] for s in api.get("/snapshots").json()}
        assert listed == {f"{plain}:default", wire}
        by_name = api.get("/snapshots", params={"name": long_name}).json()
        assert [s["snapshotID"] for s in by_name] == [wire]
        made = Sandbox.create(long_name, **opts)
        try:
            assert made.files.read("old.txt") == "kept from before"
        finally:
            made.kill()
        assert api.delete(f"/templates/{long_name}").status_code == 204
        assert {s["snapshotID"] for s in api.get("/snapshots").json()} == {f"{plain}:default"}
        assert api.delete(f"/templates/{plain}").status_code == 204
