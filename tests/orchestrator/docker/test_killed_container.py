"""A keyed turn whose container is killed mid-job fails at once, retryably, and lets go of
its Idempotency-Key: the retry runs (not ``409 idempotency_in_flight``) on a new
container restored from the last checkpoint, and the killed turn left nothing behind.

Through ``sandcell serve`` under uvicorn with the docker provider on the real engine.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import httpx
import pytest

from sandcell_orchestrator.config import OrchestratorSettings
from sandcell_orchestrator.serve.app import create_app
from sandcell_orchestrator.testing import clean_environ
from tests.fixtures.serving import serving

from .conftest import Engine

KEY = "key-docker-0123456789abcdef"
SCOPE_LABEL = "sandcell.scope"
SESSION_LABEL = "sandcell.session_id"
# The first run sleeps far past any wait below: only a connection that resets when the
# container dies ends it in time. The retry finds ``fast`` (written by a turn in
# between) and finishes at once.
SLOW_JOB = (
    "import os, time\n"
    "print('@started', flush=True)\n"
    "if not os.path.exists('fast'):\n"
    "    time.sleep(600)\n"
    "open('log', 'a').write('b\\n')\n"
    "print(open('log').read(), end='')\n"
)


@pytest.fixture
async def served(engine: Engine, tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, str]]:
    """A docker-provider service on a loopback port, and its containers' scope."""
    scope = f"test-{uuid.uuid4().hex[:12]}"
    settings = OrchestratorSettings.from_env(
        clean_environ(
            SANDCELL_HOME=str(tmp_path / "home"),
            SANDCELL_API_KEYS=f"{KEY}=tenant",
            SANDCELL_PROVIDER="docker",
            DOCKER_HOST=engine.docker_host,
            SANDCELL_DOCKER_IMAGE=engine.image,
            SANDCELL_DOCKER_SCOPE=scope,
            SANDCELL_DOCKER_MEMORY_MIB="1024",
            SANDCELL_EXECUTE_TIMEOUT_S="900",
        )
    )
    try:
        async with (
            serving(create_app(settings)) as url,
            httpx.AsyncClient(
                base_url=url,
                headers={"Authorization": f"Bearer {KEY}"},
                timeout=httpx.Timeout(900, connect=30),
            ) as client,
        ):
            yield client, scope
    finally:
        for container in await engine.containers(**{SCOPE_LABEL: scope}):
            async with engine.client() as raw:
                await raw.delete(f"/containers/{container['Id']}", params={"force": "true"})


def _call(hint: str, code: str, **extra: object) -> dict[str, object]:
    return {
        "language": "python",
        "user_id": "u",
        "runtime_session_hint": hint,
        "code": code,
    } | extra


async def test_a_keyed_turn_on_a_killed_container_fails_fast_and_frees_its_key(
    engine: Engine, served: tuple[httpx.AsyncClient, str]
) -> None:
    client, scope = served
    hint = f"killed-{uuid.uuid4().hex[:8]}"
    first = await client.post(
        "/v1/exec",
        json=_call(hint, "open('log', 'a').write('a\\n')"),
        headers={"Idempotency-Key": "k-a"},
    )
    assert first.status_code == 200, first.text
    session_id = first.json()["session_id"]

    slow = _call(hint, SLOW_JOB, timeout_ms=800_000)
    key = {"Idempotency-Key": f"k-slow-{uuid.uuid4().hex}"}
    killed: list[str] = []
    events: list[dict[str, object]] = []
    with anyio.fail_after(300):  # the job alone would run 600 s
        async with client.stream(
            "POST", "/v1/exec", json=slow, headers=key | {"Accept": "application/x-ndjson"}
        ) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                event = json.loads(line)
                events.append(event)
                if "@started" in str(event.get("data", "")) and not killed:
                    mine = await engine.containers(
                        **{SCOPE_LABEL: scope, SESSION_LABEL: session_id}
                    )
                    running = [c["Id"] for c in mine if c["State"] == "running"]
                    assert len(running) == 1
                    killed.append(running[0])
                    async with engine.client() as raw:
                        answer = await raw.post(
                            f"/containers/{running[0]}/kill", params={"signal": "KILL"}
                        )
                        assert answer.status_code == 204
    assert killed
    error = events[-1].get("error")
    assert isinstance(error, dict), events[-1]
    assert error["retryable"] is True
    # Recycled before the answer: the dead container is removed, not left to a sweep.
    assert await engine.inspect(killed[0]) is None

    # Another call on the session (another body, no key) marks the retry's run fast.
    marked = await client.post("/v1/exec", json=_call(hint, "open('fast', 'w').write('1')"))
    assert marked.status_code == 200, marked.text
    retried = await client.post("/v1/exec", json=slow, headers=key)
    assert retried.status_code == 200, retried.text  # the key was let go: it runs
    assert retried.json()["stdout"] == "@started\na\nb\n"  # restored; the killed run left nothing
    assert "Idempotent-Replayed" not in retried.headers
    replayed = await client.post("/v1/exec", json=slow, headers=key)
    assert replayed.headers.get("Idempotent-Replayed") == "true"
    assert replayed.json()["stdout"] == retried.json()["stdout"]
    deleted = await client.delete(f"/v1/sessions/{session_id}")
    assert deleted.status_code == 204
