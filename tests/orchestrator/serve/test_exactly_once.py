"""Exactly-once keyed turns (issue 20): the fenced record write that commits a turn also
stores its idempotent answer, so a worker that dies right after that write (before it
stored the answer on its own) leaves a committed turn whose retry gets the answer and
never runs the job again.

The worker's death after the commit is a registry view whose ``finish_idempotency``
fails, as a dead worker's never comes: the serve app's claims go through it, while the
sessions underneath (their record writes) use the real registry (SQLite, or the real
redis-server), with real runners.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from sandcell_orchestrator.bootstrap import Services, open_services
from sandcell_orchestrator.config import OrchestratorSettings
from sandcell_orchestrator.errors import RegistryError
from sandcell_orchestrator.registry import SessionRegistry
from sandcell_orchestrator.serve.app import create_app
from sandcell_orchestrator.testing import clean_environ
from sandcell_protocol import ExecuteResult, decode, runtime_session_id
from tests.orchestrator.apps.http_server import serve_asgi
from tests.orchestrator.conftest import redis_url

__all__ = ["redis_url"]

KEY = "once-key-0123456789abcdef"
# Each run appends a line and prints how many there are: a second run shows as a 2.
COUNT = "open('runs', 'a').write('x\\n'); print(len(open('runs').read().splitlines()))"


class _DiesBeforeAnswering:
    """The registry as the serve app sees it, on a worker that dies right after a turn's
    committing write: every answer it would store afterwards is lost."""

    def __init__(self, inner: SessionRegistry, services: Services) -> None:
        self._inner = inner
        self.services = services
        """The worker's own services (a test cleans up through them)."""
        self.lost = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def finish_idempotency(self, key: str, **_: object) -> bool:
        self.lost += 1
        raise RegistryError("injected: the worker died before storing the answer")


Worker = Callable[[], AbstractAsyncContextManager[tuple[httpx.AsyncClient, _DiesBeforeAnswering]]]


@pytest.fixture(params=["sqlite", "redis"])
def worker(request: pytest.FixtureRequest, tmp_path: Path, runtime_dir: Path) -> Worker:
    env = {
        "SANDCELL_HOME": str(tmp_path / "home"),
        "SANDCELL_LOCAL_RUNTIME_DIR": str(runtime_dir),
        "SANDCELL_API_KEYS": f"{KEY}=tenant-a",
    }
    if request.param == "redis":
        url = request.getfixturevalue("redis_url")
        env["SANDCELL_REGISTRY_URL"] = url

    @asynccontextmanager
    async def start() -> AsyncIterator[tuple[httpx.AsyncClient, _DiesBeforeAnswering]]:
        settings = OrchestratorSettings.from_env(clean_environ(**env))
        async with open_services(settings) as services:
            dying = _DiesBeforeAnswering(services.registry, services)
            seen = dataclasses.replace(services, registry=dying)
            async with (
                serve_asgi(create_app(settings, services=seen), lifespan="on") as url,
                httpx.AsyncClient(base_url=url, timeout=120) as client,
            ):
                yield client, dying

    return start


def call(hint: str) -> bytes:
    body = {"language": "python", "user_id": "u", "runtime_session_hint": hint, "code": COUNT}
    return json.dumps(body).encode()


def stdout_of(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return decode(response.content, ExecuteResult).stdout


@pytest.mark.parametrize("stream", [False, True])
async def test_a_committed_turn_has_its_answer_even_if_its_worker_died_before_storing_it(
    worker: Worker, stream: bool
) -> None:
    """The first keyed run commits (checkpoint + record) and its worker 'dies' before it
    stores the answer itself; the retry replays the committed answer (durable), and the
    job ran once: the next unkeyed turn counts 2."""
    hint, key = f"h-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    auth = {"Authorization": f"Bearer {KEY}"}
    more = {"Accept": "application/x-ndjson"} if stream else {}
    async with worker() as (client, dying):
        first = await client.post(
            "/v1/exec", content=call(hint), headers=auth | more | {"Idempotency-Key": key}
        )
        assert first.status_code == 200, first.text
        assert dying.lost == 1
        again = await client.post(
            "/v1/exec", content=call(hint), headers=auth | {"Idempotency-Key": key}
        )
        assert again.headers.get("idempotent-replayed") == "true", again.text
        replayed = decode(again.content, ExecuteResult)
        assert (replayed.stdout, replayed.durable) == ("1\n", True)
        if not stream:
            assert again.content == first.content
        assert stdout_of(await client.post("/v1/exec", content=call(hint), headers=auth)) == "2\n"
        # With Redis the sandbox outlives the worker's services (another worker may take
        # the session over): deleted here, as a client would.
        session_id = runtime_session_id("tenant-a", "u", hint)
        deleted = await client.delete(f"/v1/sessions/{session_id}", headers=auth)
        assert deleted.status_code == 204, deleted.text


LIBRECHAT_COUNT = (
    "open('runs', 'a').write('x\\n'); n = len(open('runs').read().splitlines());"
    " open('out.txt', 'w').write(f'run {n}'); print(n)"
)


def librechat_call(hint: str) -> bytes:
    body = {"lang": "py", "code": LIBRECHAT_COUNT, "user_id": "u", "runtime_session_hint": hint}
    return json.dumps(body).encode()


async def test_a_committed_librechat_run_has_its_answer_even_if_its_worker_died(
    worker: Worker,
) -> None:
    """LibreChat's ``/exec`` in a runtime session, keyed: its commit stores the answer,
    output files included (they are kept before the commit), so the retry after a worker
    'died' before storing the answer replays it, its file downloads, and the job ran once."""
    hint, key = f"h-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    auth = {"X-API-Key": KEY, "Content-Type": "application/json"}
    async with worker() as (client, dying):
        first = await client.post(
            "/librechat/v1/exec",
            content=librechat_call(hint),
            headers=auth | {"Idempotency-Key": key},
        )
        assert first.status_code == 200, first.text
        assert dying.lost == 1
        again = await client.post(
            "/librechat/v1/exec",
            content=librechat_call(hint),
            headers=auth | {"Idempotency-Key": key},
        )
        assert again.headers.get("idempotent-replayed") == "true", again.text
        assert again.content == first.content
        answer = again.json()
        assert answer["stdout"] == "1\n"
        (out,) = [f for f in answer["files"] if f["name"] == "out.txt"]
        download = await client.get(
            f"/librechat/v1/download/{out['storage_session_id']}/{out['id']}", headers=auth
        )
        assert (download.status_code, download.content) == (200, b"run 1")
        unkeyed = await client.post(
            "/librechat/v1/exec", content=librechat_call(hint), headers=auth
        )
        assert unkeyed.json()["stdout"] == "2\n", unkeyed.text
        # LibreChat's sessions are not in /v1's index: destroyed as the sweeper would.
        session_id = runtime_session_id("tenant-a", "u", hint)
        assert await dying.services.execution.destroy_session(session_id)
