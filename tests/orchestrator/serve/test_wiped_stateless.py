"""A keyed *stateless* run survives a Redis that forgot everything (issue 20).

A stateless run (``/v1/exec`` or LibreChat's ``/exec`` without a session hint) has no
checkpoint to find itself applied in: before this, a wiped Redis (persistence off)
lost its answer and the retry ran the job again. The answer is now saved in the
snapshot store by its stored key (``answers/<key>``) before the run answers, and a
retry the registry has no claim for reads it there first.

Each job prints a fresh uuid4, so a second run shows as another uuid; the worker's
``sandcell_executions_total`` counts the jobs that ran. Real redis-server (a private
one: the wipe is a FLUSHALL), real runners, the directory store and moto's S3.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from sandcell_orchestrator.bootstrap import Services, open_services
from sandcell_orchestrator.config import OrchestratorSettings
from sandcell_orchestrator.serve.app import create_app
from sandcell_orchestrator.sessions.stateless_answers import STATELESS_ANSWERS_PREFIX
from sandcell_orchestrator.snapshots import SnapshotStore, SnapshotUnavailableError
from sandcell_orchestrator.testing import clean_environ
from tests.orchestrator.apps.http_server import serve_asgi
from tests.orchestrator.serve.test_wiped_registry import (
    AUTH,
    AUTH_B,
    KEY,
    env,
    private_redis,
    result_of,
    stdout_of,
    wipe,
)

__all__ = ["env", "private_redis"]

RANDOM = "import uuid; print(uuid.uuid4())"
LC = {"X-API-Key": KEY}


@asynccontextmanager
async def worker(env: dict[str, str]) -> AsyncIterator[tuple[httpx.AsyncClient, Services]]:
    settings = OrchestratorSettings.from_env(clean_environ(**env))
    async with (
        open_services(settings) as services,
        serve_asgi(create_app(settings, services=services), lifespan="on") as url,
        httpx.AsyncClient(base_url=url, timeout=120) as client,
    ):
        yield client, services


def ran(services: Services) -> float:
    """How many jobs this worker ran (each stateless run is one)."""
    return services.metrics.value("sandcell_executions_total", status="ok")


async def saved(services: Services) -> list[str]:
    return [e.key for e in await services.store.list(STATELESS_ANSWERS_PREFIX)]


def stateless(code: str = RANDOM) -> bytes:
    return json.dumps({"language": "python", "user_id": "u", "code": code}).encode()


async def keyed(
    client: httpx.AsyncClient, key: str, *, auth: dict[str, str] = AUTH, body: bytes | None = None
) -> httpx.Response:
    headers = auth | {"Idempotency-Key": key}
    return await client.post("/v1/exec", content=body or stateless(), headers=headers)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_stateless_retry_after_a_wipe_gets_the_first_runs_output(
    env: dict[str, str], stream: bool
) -> None:
    """Answered, then Redis wiped: the retry (JSON or NDJSON) gets the first run's
    uuid, the job ran once, and a third try replays it from the registry again."""
    key = uuid.uuid4().hex
    async with worker(env) as (client, services):
        first = await keyed(client, key)
        printed = stdout_of(first)
        assert ran(services) == 1
        await wipe(env["SANDCELL_REGISTRY_URL"])
        more = {"Accept": "application/x-ndjson"} if stream else {}
        again = await client.post(
            "/v1/exec", content=stateless(), headers=AUTH | more | {"Idempotency-Key": key}
        )
        assert again.headers.get("idempotent-replayed") == "true", again.text
        assert result_of(again, stream=stream).stdout == printed
        if not stream:
            assert again.content == first.content
        third = await keyed(client, key)
        assert third.headers.get("idempotent-replayed") == "true"
        assert third.content == first.content
        assert ran(services) == 1


async def test_a_stateless_answer_stays_with_its_tenant(env: dict[str, str]) -> None:
    """After a wipe, tenant b with tenant a's key and body runs its own job; tenant a's
    retry still gets its own answer."""
    key = uuid.uuid4().hex
    async with worker(env) as (client, services):
        printed = stdout_of(await keyed(client, key))
        await wipe(env["SANDCELL_REGISTRY_URL"])
        other = await keyed(client, key, auth=AUTH_B)
        assert other.headers.get("idempotent-replayed") is None
        assert stdout_of(other) != printed
        assert ran(services) == 2
        again = await keyed(client, key)
        assert stdout_of(again) == printed
        assert ran(services) == 2


async def test_after_a_wipe_the_same_key_with_another_body_is_still_refused(
    env: dict[str, str],
) -> None:
    """The saved answer carries its request's fingerprint: 422, and nothing runs."""
    key = uuid.uuid4().hex
    async with worker(env) as (client, services):
        assert (await keyed(client, key)).status_code == 200
        await wipe(env["SANDCELL_REGISTRY_URL"])
        other = await keyed(client, key, body=stateless(RANDOM + "; print('other')"))
        assert other.status_code == 422, other.text
        assert other.json()["error"]["code"] == "idempotency_key_reused"
        assert ran(services) == 1


async def test_only_a_keyed_stateless_run_saves_its_answer(env: dict[str, str]) -> None:
    """One object under ``answers/``, named by the stored (hashed) key, for a keyed run;
    none for an un-keyed one."""
    key = f"client-key-{uuid.uuid4().hex}"
    async with worker(env) as (client, services):
        before = await saved(services)
        plain = await client.post("/v1/exec", content=stateless(), headers=AUTH)
        assert plain.status_code == 200, plain.text
        assert await saved(services) == before
        assert (await keyed(client, key)).status_code == 200
        (made,) = set(await saved(services)) - set(before)
        assert key not in made


async def test_a_librechat_stateless_retry_after_a_wipe_answers_the_first_runs_files(
    env: dict[str, str],
) -> None:
    """LibreChat's ``/exec`` without a hint: the retry after a wipe answers the first
    run's bytes (stdout and file ids), the file still downloads, the job ran once."""
    code = "import uuid\nu = str(uuid.uuid4())\nopen('/mnt/data/out.txt', 'w').write(u)\nprint(u)\n"
    body = json.dumps({"lang": "py", "code": code, "user_id": "u"}).encode()
    headers = LC | {"Idempotency-Key": uuid.uuid4().hex}
    async with worker(env) as (client, services):
        first = await client.post("/librechat/v1/exec", content=body, headers=headers)
        assert first.status_code == 200, first.text
        await wipe(env["SANDCELL_REGISTRY_URL"])
        again = await client.post("/librechat/v1/exec", content=body, headers=headers)
        assert again.status_code == 200, again.text
        assert again.headers.get("idempotent-replayed") == "true"
        assert again.content == first.content
        assert ran(services) == 1
        answer = again.json()
        (out,) = [f for f in answer["files"] if f["name"] == "out.txt"]
        got = await client.get(
            f"/librechat/v1/download/{out['storage_session_id']}/{out['id']}", headers=LC
        )
        assert (got.status_code, got.text) == (200, answer["stdout"].strip())


async def test_saved_stateless_answers_are_collected_after_the_grace_period(
    env: dict[str, str],
) -> None:
    """The sweeper keeps a saved answer within ``SANDCELL_CHECKPOINT_GRACE_S`` and deletes
    it past that; a retry after a wipe then runs again (what a wipe loses)."""
    key = uuid.uuid4().hex
    async with worker(env) as (client, services):
        printed = stdout_of(await keyed(client, key))
        (made,) = await saved(services)
        await services.execution.sweep_idle(idle_s=3600)
        assert await saved(services) == [made]
        services.manager.stateless_answers.grace_s = 0
        await services.execution.sweep_idle(idle_s=3600)
        assert await saved(services) == []
        await wipe(env["SANDCELL_REGISTRY_URL"])
        assert stdout_of(await keyed(client, key)) != printed
        assert ran(services) == 2


class _AnswersUnreadable:
    """The snapshot store, its saved stateless answers unreadable (an S3 outage)."""

    def __init__(self, inner: SnapshotStore) -> None:
        self._inner = inner
        self.down = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def get(self, key: str, *, max_bytes: int) -> Any:
        if key.startswith(STATELESS_ANSWERS_PREFIX) and self.down:
            raise SnapshotUnavailableError("injected: S3 is down")
        return self._inner.get(key, max_bytes=max_bytes)


async def test_a_store_that_cannot_say_fails_the_keyed_call_retryably(
    env: dict[str, str],
) -> None:
    """A first keyed stateless call whose store read fails is a retryable 503 and runs
    nothing (it might be a retry whose answer only the store has); its key is free, and
    once the store answers the call runs."""
    key = uuid.uuid4().hex
    async with worker(env) as (client, services):
        answers = services.manager.stateless_answers
        blinking = _AnswersUnreadable(answers.store)
        answers.store = blinking  # type: ignore[assignment]
        refused = await keyed(client, key)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["retryable"] is True
        assert ran(services) == 0
        blinking.down = False
        assert (await keyed(client, key)).status_code == 200
        assert ran(services) == 1
