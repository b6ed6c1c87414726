"""``GET /v1/sessions`` after Redis forgot everything (persistence off, wiped).

The registry's session index went with the wipe; the sessions' checkpoints did not, and
each session comes back on its next turn. Until that turn the listing used to show
nothing of them, and ``DELETE`` answered 404: a user could neither see nor remove a
session whose state the store still held (E2B lists a paused sandbox, whose state lives
only in storage, until it is killed). Now each session's owner is also kept in the store
under its tenant's own prefix, and the listing and ownership checks read it.

Real redis-server (a private one: the wipe is a FLUSHALL), real runners, the directory
store and moto's S3.
"""

from __future__ import annotations

import argparse
import io
import uuid
from collections.abc import AsyncIterable
from typing import Any

import httpx

from sandcell_orchestrator.cli.sessions import run_destroy
from sandcell_orchestrator.config import OrchestratorSettings
from sandcell_orchestrator.sessions.owners import OWNERS_PREFIX, owners_prefix
from sandcell_orchestrator.snapshots import SnapshotInfo, SnapshotStore, SnapshotUnavailableError
from sandcell_orchestrator.testing import clean_environ
from sandcell_protocol import runtime_session_id
from tests.orchestrator.serve.test_wiped_registry import (
    AUTH,
    AUTH_B,
    call,
    env,
    private_redis,
    stdout_of,
    wipe,
)
from tests.orchestrator.serve.test_wiped_stateless import worker

__all__ = ["env", "private_redis"]


def sid(hint: str, tenant: str = "tenant-a") -> str:
    return runtime_session_id(tenant, "u", hint)


async def listing(
    client: httpx.AsyncClient, auth: dict[str, str] = AUTH, **query: Any
) -> dict[str, Any]:
    response = await client.get("/v1/sessions", params=query, headers=auth)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


async def every_page(client: httpx.AsyncClient, *, limit: int) -> list[str]:
    """Every session id the listing gives, page by page, in the order given."""
    seen: list[str] = []
    after: str | None = None
    while True:
        query: dict[str, Any] = {"limit": limit} | ({"after": after} if after else {})
        page = await listing(client, **query)
        assert len(page["sessions"]) <= limit
        seen += [s["session_id"] for s in page["sessions"]]
        after = page.get("next_after")
        if after is None:
            return seen


async def test_a_wiped_registry_still_lists_and_deletes_a_saved_session(
    env: dict[str, str],
) -> None:
    """A session with a checkpoint is listed after the wipe (``saved``, with its user and
    hint), for its own tenant only; the other tenant's delete is a 404, its own a 204,
    after which it is listed no more and its next turn starts from nothing."""
    hint = f"h-{uuid.uuid4().hex[:8]}"
    session_id = sid(hint)
    async with worker(env) as (client, _):
        assert stdout_of(await client.post("/v1/exec", content=call(hint), headers=AUTH)) == "1\n"
        await wipe(env["SANDCELL_REGISTRY_URL"])

        (info,) = [s for s in (await listing(client))["sessions"] if s["session_id"] == session_id]
        assert info == {
            "session_id": session_id,
            "user_id": "u",
            "hint": hint,
            "state": "saved",
            "has_checkpoint": True,
            "updated_at_s": None,
        }
        assert (await listing(client, AUTH_B))["sessions"] == []
        other = await client.delete(f"/v1/sessions/{session_id}", headers=AUTH_B)
        assert other.status_code == 404, other.text

        deleted = await client.delete(f"/v1/sessions/{session_id}", headers=AUTH)
        assert deleted.status_code == 204, deleted.text
        assert (await listing(client))["sessions"] == []
        gone = await client.delete(f"/v1/sessions/{session_id}", headers=AUTH)
        assert gone.status_code == 404, gone.text
        assert stdout_of(await client.post("/v1/exec", content=call(hint), headers=AUTH)) == "1\n"
        assert (await client.delete(f"/v1/sessions/{session_id}", headers=AUTH)).status_code == 204


async def test_pages_after_a_wipe_list_every_session_once_in_id_order(
    env: dict[str, str],
) -> None:
    """Five sessions, Redis wiped, then a turn on one of them and on a new sixth: the
    registry knows two, the store all six. Pages of two give each once, in id order;
    the other tenant's listing shows none of them."""
    hints = [f"h-{uuid.uuid4().hex[:8]}" for _ in range(6)]
    async with worker(env) as (client, services):
        for hint in hints[:5]:
            assert stdout_of(await client.post("/v1/exec", content=call(hint), headers=AUTH)) == (
                "1\n"
            )
        await wipe(env["SANDCELL_REGISTRY_URL"])
        assert stdout_of(await client.post("/v1/exec", content=call(hints[0]), headers=AUTH)) == (
            "2\n"
        )
        assert stdout_of(await client.post("/v1/exec", content=call(hints[5]), headers=AUTH)) == (
            "1\n"
        )
        indexed = await services.registry.sessions_of("tenant-a")
        assert sorted(o.session_id for o in indexed) == sorted([sid(hints[0]), sid(hints[5])])

        expected = sorted(sid(hint) for hint in hints)
        assert await every_page(client, limit=2) == expected
        assert await every_page(client, limit=5) == expected
        assert [s["session_id"] for s in (await listing(client))["sessions"]] == expected
        assert (await listing(client, AUTH_B))["sessions"] == []
        for session_id in expected:
            deleted = await client.delete(f"/v1/sessions/{session_id}", headers=AUTH)
            assert deleted.status_code == 204, deleted.text
        assert (await listing(client))["sessions"] == []
        assert await services.store.list(owners_prefix("tenant-a")) == []


class _CountingOwnerPuts:
    """The snapshot store, counting the puts of owner objects."""

    def __init__(self, inner: SnapshotStore) -> None:
        self._inner = inner
        self.owner_puts = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def put(self, key: str, stream: AsyncIterable[bytes], *, max_bytes: int) -> SnapshotInfo:
        if key.startswith(OWNERS_PREFIX):
            self.owner_puts += 1
        return await self._inner.put(key, stream, max_bytes=max_bytes)


async def test_the_owner_is_stored_when_indexed_anew_not_on_every_turn(
    env: dict[str, str],
) -> None:
    """A session's owner is written to the store when the registry does not have it (its
    first turn, its first after a wipe), not on every turn."""
    hint = f"h-{uuid.uuid4().hex[:8]}"
    async with worker(env) as (client, services):
        counting = _CountingOwnerPuts(services.owners.store)
        services.owners.store = counting  # type: ignore[assignment]
        for n in (1, 2, 3):
            assert stdout_of(await client.post("/v1/exec", content=call(hint), headers=AUTH)) == (
                f"{n}\n"
            )
        assert counting.owner_puts == 1
        await wipe(env["SANDCELL_REGISTRY_URL"])
        for n in (4, 5):
            assert stdout_of(await client.post("/v1/exec", content=call(hint), headers=AUTH)) == (
                f"{n}\n"
            )
        assert counting.owner_puts == 2
        (entry,) = await services.store.list(owners_prefix("tenant-a"))
        assert entry.key.endswith(sid(hint))
        assert (await client.delete(f"/v1/sessions/{sid(hint)}", headers=AUTH)).status_code == 204


class _UnreachableOwners:
    """The snapshot store, its owner lookups failing as an unreachable S3 would."""

    def __init__(self, inner: SnapshotStore) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def exists(self, key: str) -> bool:
        if key.startswith(OWNERS_PREFIX):
            raise SnapshotUnavailableError("store unreachable")
        return await self._inner.exists(key)


async def test_another_tenants_session_answers_as_a_missing_one_while_the_store_fails(
    env: dict[str, str],
) -> None:
    """Tenant B naming tenant A's session (indexed: the registry knows its owner) gets
    what it gets for an id nobody has, even when the store cannot answer: had the
    registry's "not yours" been answered without the store, A's would be a 404 where a
    missing one is the store's failure, and B would learn which ids exist."""
    hint = f"h-{uuid.uuid4().hex[:8]}"
    async with worker(env) as (client, services):
        assert stdout_of(await client.post("/v1/exec", content=call(hint), headers=AUTH)) == "1\n"
        services.owners.store = _UnreachableOwners(services.owners.store)  # type: ignore[assignment]
        answers = []
        for session_id in (sid(hint), sid(f"nobody-{hint}")):
            response = await client.delete(f"/v1/sessions/{session_id}", headers=AUTH_B)
            answers.append((response.status_code, response.json()["error"]["code"]))
        assert answers[0] == answers[1], answers
        assert answers[0] == (503, "busy")  # the store's failure: retryable, not ours
        mine = await client.delete(f"/v1/sessions/{sid(hint)}", headers=AUTH)
        assert mine.status_code == 204, mine.text


async def test_a_session_destroyed_by_the_cli_leaves_no_owner_object(
    env: dict[str, str],
) -> None:
    """``sandcell sessions destroy rt_…`` on a session a serving surface made removes its
    owner object too: else the listing would show it after a wipe, destroyed."""
    hint = f"h-{uuid.uuid4().hex[:8]}"
    async with worker(env) as (client, services):
        assert stdout_of(await client.post("/v1/exec", content=call(hint), headers=AUTH)) == "1\n"
        assert len(await services.store.list(owners_prefix("tenant-a"))) == 1
        settings = OrchestratorSettings.from_env(clean_environ(**env))
        out = io.StringIO()
        assert await run_destroy(argparse.Namespace(session=sid(hint)), settings, out) == 0
        assert out.getvalue() == f"destroyed {sid(hint)}\n"
        assert await services.store.list(owners_prefix("tenant-a")) == []
        await wipe(env["SANDCELL_REGISTRY_URL"])
        assert (await listing(client))["sessions"] == []
