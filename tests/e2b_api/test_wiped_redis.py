"""A paused E2B sandbox after Redis forgot everything (persistence off, wiped).

A sandbox's row lives in the registry's E2B table; a paused one's workspace is a
checkpoint in S3. A wipe used to drop every paused sandbox: no longer listed, its
connect and kill a 404, while S3 still held its files. Now a paused row is also kept
in S3 under its tenant's own prefix (``e2b/<sha256 of the namespace>/<id>``), and a
lookup or listing the registry cannot answer reads it: the owner lists the sandbox
as paused (its template, metadata and end as before), resumes it with its files and
env, and kills it (the kept row and the checkpoints gone with it); another tenant
gets exactly the not-found answers of a missing sandbox.

The E2B SDK against a real ``sandcell serve`` on a redis-server of the module's own
(the wipe is a FLUSHALL) and moto's S3.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import boto3
import pytest
import redis
from e2b import NotFoundException, Sandbox, SandboxQuery, SandboxState

from tests.e2b_api.conftest import KEY_B, E2bServe, start_serve, stop_serve
from tests.fixtures.paths import traversable_dir
from tests.fixtures.private_redis import private_redis_server
from tests.orchestrator.cli.conftest import stop_leftovers
from tests.orchestrator.conftest import BUCKET, S3_ACCESS, S3_SECRET, S3Server, running_s3
from tests.orchestrator.serve.fleet import fleet_env


@dataclass
class Wiped:
    """The service, its Redis and its S3 bucket prefix."""

    serve: E2bServe
    redis_url: str
    s3: S3Server
    prefix: str

    def wipe(self) -> None:
        with redis.Redis.from_url(self.redis_url) as db:
            db.flushall()

    def keys(self, *, containing: str) -> list[str]:
        """The S3 keys under the service's prefix that contain ``containing``."""
        client = _s3(self.s3)
        pages = client.get_paginator("list_objects_v2").paginate(
            Bucket=BUCKET, Prefix=self.prefix + "/"
        )
        found = [o["Key"] for page in pages for o in page.get("Contents", [])]
        client.close()
        return [key for key in found if containing in key]

    def session_of(self, sandbox_id: str) -> str:
        """The manager session of a sandbox, from its registry row (before a wipe)."""
        with redis.Redis.from_url(self.redis_url) as db:
            (key,) = db.scan_iter(match=f"*e2b:{sandbox_id}")
            raw = db.hget(key, "row")
        assert isinstance(raw, bytes)
        session_id: str = json.loads(raw)["session_id"]
        return session_id

    def forget(self, sandbox_ids: list[str]) -> None:
        """Drop these sandboxes' rows from Redis again (what the wipe did to them; a
        listing since rebuilt them from their kept rows), and the tenants' merge marks
        (the wipe took them too)."""
        with redis.Redis.from_url(self.redis_url) as db:
            indexes = [
                *db.scan_iter(match="*e2b_all"),
                *db.scan_iter(match="*e2b_nsids:*"),
                *db.scan_iter(match="*e2b_nsstart:*"),
            ]
            for mark in db.scan_iter(match="*e2b_kept_merged:*"):
                db.delete(mark)
            for sandbox_id in sandbox_ids:
                for key in db.scan_iter(match=f"*e2b:{sandbox_id}"):
                    db.delete(key)
                for index in indexes:
                    db.zrem(index, sandbox_id)


def _s3(s3: S3Server) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=s3.endpoint,
        aws_access_key_id=S3_ACCESS,
        aws_secret_access_key=S3_SECRET,
        region_name="us-east-1",
    )


@pytest.fixture(scope="module")
def wiped() -> Iterator[Wiped]:
    with (
        running_s3() as s3,
        traversable_dir("e2b-wiped-") as base,
        private_redis_server(base) as server,
    ):
        env = fleet_env(server.url, s3, prefix="e2b-wiped")
        prefix = env["SANDCELL_SNAPSHOT_URL"].removeprefix(f"s3://{BUCKET}/")
        served = start_serve(base / "w", env=env)
        try:
            yield Wiped(served, server.url, s3, prefix)
        finally:
            stop_serve(served)
            # A shared registry keeps sandboxes past their worker: each test killed its
            # own, so none may be left.
            leftovers = stop_leftovers(served.runtime_dir)
            assert not leftovers, f"sandbox processes left behind: {leftovers}"


def _pages(serve: E2bServe, key: str | None = None, **query: Any) -> list[list[str]]:
    """The tenant's listing, page by page (the SDK follows ``nextToken``)."""
    pages = Sandbox.list(**query, **(serve.opts(key) if key else serve.opts()))
    seen: list[list[str]] = []
    while pages.has_next:
        seen.append([s.sandbox_id for s in pages.next_items()])
    return seen


def _ids(serve: E2bServe, key: str | None = None, **query: Any) -> list[str]:
    """Every sandbox id of the tenant's listing, page by page."""
    return [sandbox_id for page in _pages(serve, key, **query) for sandbox_id in page]


def test_a_paused_sandbox_is_listed_resumed_and_killed_after_a_wipe(wiped: Wiped) -> None:
    """Listed as paused with what it had, for its owner only; the other tenant's
    connect, info and kill are not-found; the owner's connect resumes it with its files
    and env; its kill removes the kept row and the checkpoints."""
    serve = wiped.serve
    made = Sandbox.create(metadata={"who": "wiped"}, envs={"KEPT_ENV": "kept"}, **serve.opts())
    sandbox_id = made.sandbox_id
    try:
        made.files.write("keep.txt", "kept across the wipe")
        assert made.pause() is True
        before = Sandbox.get_info(sandbox_id, **serve.opts())
        session_id = wiped.session_of(sandbox_id)
        assert wiped.keys(containing=session_id), "the pause wrote no checkpoint"

        wiped.wipe()

        (listed,) = [
            s for s in Sandbox.list(**serve.opts()).next_items() if s.sandbox_id == sandbox_id
        ]
        assert listed.state == SandboxState.PAUSED
        assert listed.metadata == {"who": "wiped"}
        assert listed.template_id == before.template_id
        assert listed.started_at == before.started_at
        assert listed.end_at == before.end_at
        paused_only = SandboxQuery(state=[SandboxState.PAUSED])
        assert sandbox_id in _ids(serve, query=paused_only)
        assert sandbox_id not in _ids(serve, query=SandboxQuery(state=[SandboxState.RUNNING]))

        assert sandbox_id not in _ids(serve, KEY_B)
        with pytest.raises(NotFoundException):
            Sandbox.connect(sandbox_id, **serve.opts(KEY_B))
        with pytest.raises(NotFoundException):
            Sandbox.get_info(sandbox_id, **serve.opts(KEY_B))
        assert Sandbox.kill(sandbox_id, **serve.opts(KEY_B)) is False

        resumed = Sandbox.connect(sandbox_id, **serve.opts())
        assert resumed.files.read("keep.txt") == "kept across the wipe"
        assert resumed.commands.run("echo $KEPT_ENV").stdout == "kept\n"
        info = Sandbox.get_info(sandbox_id, **serve.opts())
        assert info.state == SandboxState.RUNNING
        assert info.metadata == {"who": "wiped"}
        assert wiped.keys(containing="/e2b/") == []
    finally:
        Sandbox.kill(sandbox_id, **serve.opts())
    assert sandbox_id not in _ids(serve)
    with pytest.raises(NotFoundException):
        Sandbox.get_info(sandbox_id, **serve.opts())
    assert wiped.keys(containing=session_id) == []


def test_paused_sandboxes_are_paged_once_and_killed_while_paused_after_a_wipe(
    wiped: Wiped,
) -> None:
    """Three paused sandboxes, Redis wiped: pages of one give each once; a kill of each,
    still paused, removes its kept row and checkpoints, after which it is gone."""
    serve = wiped.serve
    made = [Sandbox.create(**serve.opts()) for _ in range(3)]
    sessions: list[str] = []
    try:
        for sandbox in made:
            sandbox.files.write("f.txt", sandbox.sandbox_id)
            assert sandbox.pause() is True
            sessions.append(wiped.session_of(sandbox.sandbox_id))

        wiped.wipe()

        paged = _ids(serve, limit=1)
        assert sorted(paged) == sorted(s.sandbox_id for s in made)
        assert _ids(serve, KEY_B) == []
    finally:
        for sandbox in made:
            assert Sandbox.kill(sandbox.sandbox_id, **serve.opts()) is True
    assert _ids(serve) == []
    for sandbox in made:
        with pytest.raises(NotFoundException):
            Sandbox.connect(sandbox.sandbox_id, **serve.opts())
    for session_id in sessions:
        assert wiped.keys(containing=session_id) == []
    assert wiped.keys(containing="/e2b/") == []


def test_pages_over_registry_rows_and_kept_rows_never_skip_or_repeat(wiped: Wiped) -> None:
    """Nine sandboxes: four paused before a wipe (kept rows only), two paused after it
    (Redis and kept rows), three running (Redis only), and another tenant's: pages of
    any size give each once, newest first (oldest first with ``order="asc"``), each
    full but the last; the state filter and a metadata query page the same; the other
    tenant lists only its own."""
    serve = wiped.serve

    def meta(n: int) -> dict[str, str]:
        return {"parity": "even" if n % 2 == 0 else "odd"}

    made: list[Sandbox] = []
    theirs: Sandbox | None = None
    try:
        for n in range(4):
            made.append(Sandbox.create(metadata=meta(n), **serve.opts()))
            assert made[-1].pause() is True
        wiped.wipe()
        forgotten = [sandbox.sandbox_id for sandbox in made]
        for n in range(4, 6):
            made.append(Sandbox.create(metadata=meta(n), **serve.opts()))
            assert made[-1].pause() is True
        made += [Sandbox.create(metadata=meta(n), **serve.opts()) for n in range(6, 9)]
        theirs = Sandbox.create(metadata=meta(0), **serve.opts(KEY_B))
        # Made one after another: newest first is the reverse of the making.
        ids = [sandbox.sandbox_id for sandbox in reversed(made)]
        paused = [sandbox.sandbox_id for sandbox in reversed(made[:6])]
        running = [sandbox.sandbox_id for sandbox in reversed(made[6:])]
        even = [sandbox.sandbox_id for n, sandbox in reversed(list(enumerate(made))) if n % 2 == 0]

        def listed(limit: int, **query: Any) -> list[str]:
            wiped.forget(forgotten)  # as right after the wipe, for every listing
            pages = _pages(serve, limit=limit, **query)
            assert all(len(page) == limit for page in pages[:-1]), (limit, query, pages)
            assert len(pages[-1]) <= limit, (limit, query, pages)
            return [sandbox_id for page in pages for sandbox_id in page]

        for limit in (1, 2, 4, 100):
            assert listed(limit) == ids, limit
            assert listed(limit, order="desc") == ids, limit
            assert listed(limit, order="asc") == ids[::-1], limit
        paused_only = SandboxQuery(state=[SandboxState.PAUSED])
        running_only = SandboxQuery(state=[SandboxState.RUNNING])
        for limit in (1, 4):
            assert listed(limit, query=paused_only) == paused, limit
            assert listed(limit, query=running_only) == running, limit
            assert listed(limit, query=SandboxQuery(metadata={"parity": "even"})) == even, limit
            oldest_paused = listed(limit, query=paused_only, order="asc")
            assert oldest_paused == paused[::-1], limit
        assert _ids(serve, KEY_B, limit=1) == [theirs.sandbox_id]
    finally:
        for sandbox in made:
            assert Sandbox.kill(sandbox.sandbox_id, **serve.opts()) is True
        if theirs is not None:
            assert Sandbox.kill(theirs.sandbox_id, **serve.opts(KEY_B)) is True
    assert _ids(serve) == []
    assert _ids(serve, KEY_B) == []
    assert wiped.keys(containing="/e2b/") == []
