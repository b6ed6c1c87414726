"""E2B snapshots at their limits, against a real ``sandcell serve``: the per-tenant cap
(``SANDCELL_E2B_MAX_SNAPSHOTS``) holds when a tenant snapshots several sandboxes at
once; a workspace past ``SANDCELL_CHECKPOINT_MAX_BYTES``, or of more entries than a
checkpoint holds, is a 413 for a snapshot, a fork and a pause (the sandbox runs on),
and an auto-pause at the timeout kills the sandbox instead (as E2B ends it at its
timeout); a create from a snapshot deleted while it was being made is the 404 of a
deleted snapshot. None of them is a 500."""

from __future__ import annotations

import collections
import concurrent.futures
import os
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from e2b import NotFoundException, Sandbox

from tests.e2b_api.conftest import KEY_A, MAX_SANDBOXES, E2bServe, start_serve, stop_serve
from tests.fixtures.paths import traversable_dir
from tests.orchestrator.cli.conftest import stop_leftovers

CAP = 2
CHECKPOINT_MAX_BYTES = 2 << 20
# The runner's cap, set on ``sandcell serve``: its local runners inherit it.
CHECKPOINT_MAX_MEMBERS = 2000


@pytest.fixture(scope="module")
def capped() -> Iterator[E2bServe]:
    with traversable_dir("e2b-snapcap-") as base:
        env = {
            "SANDCELL_E2B_MAX_SNAPSHOTS": str(CAP),
            "SANDCELL_CHECKPOINT_MAX_BYTES": str(CHECKPOINT_MAX_BYTES),
            "SANDCELL_CHECKPOINT_MAX_MEMBERS": str(CHECKPOINT_MAX_MEMBERS),
        }
        service = start_serve(base, env=env)
        try:
            yield service
        finally:
            stop_serve(service)
            assert not stop_leftovers(service.runtime_dir)


def _api(served: E2bServe) -> httpx.Client:
    return httpx.Client(
        base_url=f"{served.url}/e2b",
        headers={"X-API-KEY": KEY_A},
        timeout=120,
        limits=httpx.Limits(max_connections=32),
    )


def test_concurrent_snapshots_of_several_sandboxes_keep_to_the_cap(capped: E2bServe) -> None:
    """Two snapshots of each of the tenant's sandboxes at once: exactly ``CAP`` are taken,
    the others are 429 ``busy``, and the listing holds exactly those (each request used
    to check the count before its copy, so all of them saw room: 5 of 9 with a cap of 3).
    """
    sandboxes = [Sandbox.create(**capped.opts()) for _ in range(MAX_SANDBOXES)]
    try:
        for sandbox in sandboxes:
            # A copy that takes a while: every request checks the cap during the others'.
            sandbox.files.write("weight.bin", b"w" * (CHECKPOINT_MAX_BYTES - (64 << 10)))
        with _api(capped) as api, concurrent.futures.ThreadPoolExecutor(16) as pool:
            answers = list(
                pool.map(
                    lambda sandbox_id: api.post(f"/sandboxes/{sandbox_id}/snapshots", json={}),
                    [s.sandbox_id for s in sandboxes for _ in range(2)],
                )
            )
            seen = collections.Counter(a.status_code for a in answers)
            assert seen == {201: CAP, 429: 2 * MAX_SANDBOXES - CAP}, [a.text for a in answers]
            for refused in (a for a in answers if a.status_code == 429):
                assert refused.json()["error_code"] == "busy"
            taken = {a.json()["snapshotID"] for a in answers if a.status_code == 201}
            listed = api.get("/snapshots")
            assert {s["snapshotID"] for s in listed.json()} == taken
            for snapshot_id in taken:
                assert api.delete(f"/templates/{snapshot_id}").status_code == 204
            # The places are free again: one more is taken.
            again = api.post(f"/sandboxes/{sandboxes[0].sandbox_id}/snapshots")
            assert again.status_code == 201, again.text
            assert api.delete(f"/templates/{again.json()['snapshotID']}").status_code == 204
    finally:
        for sandbox in sandboxes:
            sandbox.kill()


def test_a_workspace_past_the_checkpoint_cap_is_a_413_and_runs_on(capped: E2bServe) -> None:
    """Incompressible files past ``SANDCELL_CHECKPOINT_MAX_BYTES``: a snapshot, a fork and
    a pause are each 413 ``payload_too_large`` naming the cap (they were 500 "the
    session's saved state could not be restored", with an ERROR line), nothing is
    stored, and the sandbox runs on."""
    sandbox = Sandbox.create(**capped.opts())
    try:
        sandbox.files.write("noise.bin", os.urandom(CHECKPOINT_MAX_BYTES + (1 << 20)))
        with _api(capped) as api:
            for route in ("snapshots", "fork", "pause"):
                answer = api.post(f"/sandboxes/{sandbox.sandbox_id}/{route}", json={})
                assert answer.status_code == 413, (route, answer.text)
                error = answer.json()
                assert error["error_code"] == "payload_too_large", error
                assert "SANDCELL_CHECKPOINT_MAX_BYTES" in error["message"], error
            assert api.get("/snapshots").json() == []
            detail = api.get(f"/sandboxes/{sandbox.sandbox_id}").json()
            assert detail["state"] == "running"
        assert sandbox.commands.run("echo alive").stdout == "alive\n"
    finally:
        sandbox.kill()
    assert "could not be restored" not in capped.log()


def test_a_workspace_past_the_checkpoint_entries_is_a_413_and_runs_on(capped: E2bServe) -> None:
    """Hard links past ``SANDCELL_CHECKPOINT_MAX_MEMBERS`` (no inode each: inside the
    workspace's inode and byte quotas; the default cap is 200,000) are more entries than
    a checkpoint holds: a snapshot, a fork and a pause are each 413 ``payload_too_large``
    saying so (they were 500 "the session's saved state could not be restored", with an
    ERROR line), and the sandbox runs on. The cap set on ``sandcell serve`` is the one
    its runners use (it once stayed behind: they used 200,000)."""
    sandbox = Sandbox.create(**capped.opts())
    try:
        _hard_links(sandbox)
        with _api(capped) as api:
            for route in ("snapshots", "fork", "pause"):
                answer = api.post(f"/sandboxes/{sandbox.sandbox_id}/{route}", json={})
                assert answer.status_code == 413, (route, answer.text)
                error = answer.json()
                assert error["error_code"] == "payload_too_large", error
                assert (
                    "cannot be saved (workspace has more than"
                    f" {CHECKPOINT_MAX_MEMBERS} entries (SANDCELL_CHECKPOINT_MAX_MEMBERS))"
                    in error["message"]
                ), error
                assert "/v1/" not in error["message"], error
            assert api.get("/snapshots").json() == []
            detail = api.get(f"/sandboxes/{sandbox.sandbox_id}").json()
            assert detail["state"] == "running"
        assert sandbox.commands.run("ls h | wc -l").stdout == f"{LINKS}\n"
    finally:
        sandbox.kill()
    assert "could not be restored" not in capped.log()


LINKS = 4 * CHECKPOINT_MAX_MEMBERS


def _hard_links(sandbox: Sandbox) -> None:
    """``LINKS`` hard links to four files, in ``h``."""
    sandbox.files.write(
        "links.py",
        "import os\nos.mkdir('h')\nfor j in range(4):\n"
        "    open(f'f{j}', 'w').write('x')\n"
        f"    for i in range({LINKS // 4}): os.link(f'f{{j}}', f'h/{{j}}.{{i}}')\n",
    )
    sandbox.commands.run("python3 links.py", timeout=300)


def _pause_kills(served: E2bServe) -> int:
    metrics = httpx.get(f"{served.url}/metrics").text
    line = 'sandcell_e2b_timeout_pause_kills_total{reason="too_large"} '
    return int(float(metrics.split(line, 1)[1].split()[0]))


def _until(check: Callable[[], bool], *, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached before the deadline")
        time.sleep(0.1)


def test_an_auto_pause_past_the_checkpoint_cap_kills_at_the_timeout(capped: E2bServe) -> None:
    """``on_timeout: pause`` with a workspace past the cap: the pause at the timeout can
    never succeed, so the sandbox is killed (E2B ends a sandbox at its timeout), logged
    and counted. It used to be retried every 30 s with a warning, running on forever
    and holding one of the tenant's running places."""
    kills = _pause_kills(capped)
    sandbox = Sandbox.create(timeout=300, lifecycle={"on_timeout": "pause"}, **capped.opts())
    try:
        sandbox.files.write("noise.bin", os.urandom(CHECKPOINT_MAX_BYTES + (1 << 20)))
        sandbox.set_timeout(1)

        def gone() -> bool:
            try:
                Sandbox.get_info(sandbox.sandbox_id, **capped.opts())
            except NotFoundException:
                return True
            return False

        _until(gone)
        listed = Sandbox.list(**capped.opts()).next_items()
        assert sandbox.sandbox_id not in {s.sandbox_id for s in listed}
        assert sandbox.is_running() is False
    finally:
        Sandbox.kill(sandbox.sandbox_id, **capped.opts())
    with _api(capped) as api:
        assert api.get("/snapshots").json() == []
    log = capped.log()
    assert f"e2b sandbox {sandbox.sandbox_id}: the auto-pause at its timeout cannot be done" in log
    line = next(
        line for line in log.splitlines() if f"{sandbox.sandbox_id}: the auto-pause" in line
    )
    assert "payload_too_large" in line, line
    assert "SANDCELL_CHECKPOINT_MAX_BYTES" in line, line
    assert _pause_kills(capped) == kills + 1


def test_an_auto_pause_past_the_checkpoint_entries_kills_and_logs_why(capped: E2bServe) -> None:
    """More entries than a checkpoint holds: the auto-pause at the timeout kills the
    sandbox too, and the log line gives the 413's own reason (it said "its workspace
    is past SANDCELL_CHECKPOINT_MAX_BYTES" for every 413)."""
    kills = _pause_kills(capped)
    sandbox = Sandbox.create(timeout=300, lifecycle={"on_timeout": "pause"}, **capped.opts())
    try:
        _hard_links(sandbox)
        sandbox.set_timeout(1)

        def gone() -> bool:
            try:
                Sandbox.get_info(sandbox.sandbox_id, **capped.opts())
            except NotFoundException:
                return True
            return False

        _until(gone)
    finally:
        Sandbox.kill(sandbox.sandbox_id, **capped.opts())
    line = next(
        line
        for line in capped.log().splitlines()
        if f"e2b sandbox {sandbox.sandbox_id}: the auto-pause at its timeout" in line
    )
    assert f"more than {CHECKPOINT_MAX_MEMBERS} entries" in line, line
    assert "payload_too_large" in line, line
    assert "SANDCELL_CHECKPOINT_MAX_BYTES" not in line, line
    assert _pause_kills(capped) == kills + 1


def test_a_create_from_a_snapshot_deleted_meanwhile_is_a_404(e2b_serve: E2bServe) -> None:
    """A delete takes the meta, then the workspace: a create that read the meta before
    the delete finds no workspace. That create answers as one after the delete (the
    same 404 as for an id nobody made), and logs no error; it used to be a 500
    "the session's saved state could not be restored". The moment is made here by
    removing the workspace object alone."""
    source = Sandbox.create(**e2b_serve.opts())
    try:
        source.files.write("gone.txt", "soon")
        snapshot_id = source.create_snapshot().snapshot_id
    finally:
        source.kill()
    bare = snapshot_id.split(":")[0]
    data = list((e2b_serve.home / "snapshots" / "e2b-snapshot-data").glob(f"*/{bare}*"))
    assert data, "the snapshot's workspace object is not where the test looks"
    for path in data:
        path.unlink()
    unknown = "q" * 20 + ":default"
    with _api(e2b_serve) as api:
        answer = api.post("/v2/sandboxes", json={"templateID": snapshot_id})
        missing = api.post("/v2/sandboxes", json={"templateID": unknown})
        assert answer.status_code == 404, answer.text
        assert answer.content.replace(snapshot_id.encode(), b"ID") == missing.content.replace(
            unknown.encode(), b"ID"
        )
        # Nothing half-made is left running.
        assert api.get("/v2/sandboxes").json() == []
        api.delete(f"/templates/{snapshot_id}")
    assert "could not be restored" not in e2b_serve.log()
