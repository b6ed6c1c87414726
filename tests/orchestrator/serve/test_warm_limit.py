"""A tenant's warm sandboxes are bounded (``SANDCELL_MAX_WARM_SESSIONS``): past the
limit its least recently used warm session is suspended once the turn that went past
it is done, and another tenant's are not touched. Before, every session a tenant named
kept its sandbox (a runner, three processes) warm for the idle timeout, 30 minutes:
a tenant naming a new session per call took the host's memory from every tenant.
Real runners, the embedded registry and store."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx

from sandcell_orchestrator.bootstrap import open_services
from sandcell_orchestrator.config import OrchestratorSettings
from sandcell_orchestrator.serve.app import create_app
from sandcell_orchestrator.testing import clean_environ
from tests.orchestrator.apps.http_server import serve_asgi

KEY_A = "warm-key-a-0123456789abcdef"
KEY_B = "warm-key-b-0123456789abcdef"


@asynccontextmanager
async def worker(tmp_path: Path, runtime_dir: Path) -> AsyncIterator[httpx.AsyncClient]:
    settings = OrchestratorSettings.from_env(
        clean_environ(
            SANDCELL_HOME=str(tmp_path / "home"),
            SANDCELL_LOCAL_RUNTIME_DIR=str(runtime_dir),
            SANDCELL_API_KEYS=f"{KEY_A}=tenant-a,{KEY_B}=tenant-b",
            SANDCELL_MAX_WARM_SESSIONS="2",
        )
    )
    async with (
        open_services(settings) as services,
        serve_asgi(create_app(settings, services=services), lifespan="on") as url,
        httpx.AsyncClient(base_url=url, timeout=120) as client,
    ):
        yield client


async def turn(client: httpx.AsyncClient, key: str, hint: str, code: str) -> str:
    answer = await client.post(
        "/v1/exec",
        headers={"Authorization": f"Bearer {key}"},
        json={"language": "python", "user_id": "u", "runtime_session_hint": hint, "code": code},
    )
    assert answer.status_code == 200, answer.text
    return str(answer.json()["stdout"])


async def states(client: httpx.AsyncClient, key: str) -> dict[str, str]:
    listed = await client.get("/v1/sessions", headers={"Authorization": f"Bearer {key}"})
    return {s["hint"]: s["state"] for s in listed.json()["sessions"]}


async def test_a_tenants_least_recently_used_warm_session_is_suspended(
    tmp_path: Path, runtime_dir: Path
) -> None:
    """Tenant a's third session suspends its first (b's two stay warm); the first's next
    turn restores its files and suspends the second in turn."""
    async with worker(tmp_path, runtime_dir) as client:
        for hint in ("s1", "s2"):
            await turn(client, KEY_B, hint, "print(1)")
        for hint in ("s1", "s2", "s3"):
            await turn(client, KEY_A, hint, f"open('mine', 'w').write('{hint}')")
        assert await states(client, KEY_A) == {"s1": "suspended", "s2": "active", "s3": "active"}
        assert await states(client, KEY_B) == {"s1": "active", "s2": "active"}
        assert await turn(client, KEY_A, "s1", "print(open('mine').read())") == "s1\n"
        assert await states(client, KEY_A) == {"s1": "active", "s2": "suspended", "s3": "active"}
