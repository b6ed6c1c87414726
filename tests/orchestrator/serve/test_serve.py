"""``sandcell serve``: the HTTP API under a real uvicorn, real runners underneath."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from sandcell_orchestrator.config import OrchestratorSettings
from sandcell_orchestrator.serve.app import create_app
from sandcell_orchestrator.testing import clean_environ
from sandcell_orchestrator.testing import sandbox_processes as runner_processes
from sandcell_protocol import (
    ErrorBody,
    ErrorCode,
    ExecuteResult,
    RunStatus,
    decode,
    runtime_session_id,
)
from tests.fixtures.serving import serving

KEY_A = "key-a-0123456789abcdef"
KEY_B = "key-b-0123456789abcdef"
WRONG_KEY = "wrong-SECRET-0123456789"


@dataclass
class Service:
    settings: OrchestratorSettings
    client: httpx.AsyncClient
    runtime_dir: Path

    def auth(self, key: str = KEY_A) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"}

    async def exec(self, key: str = KEY_A, **body: object) -> httpx.Response:
        payload = {"language": "python", "user_id": "alice", **body}
        return await self.client.post("/v1/exec", json=payload, headers=self.auth(key))

    def checkpoint_files(self, session_id: str) -> list[Path]:
        """The session's checkpoint objects in the snapshot directory (one per generation)."""
        return sorted((self.settings.home / "snapshots" / "checkpoints" / session_id).glob("*"))


StartService = Callable[..., Awaitable[Service]]


def error_of(response: httpx.Response) -> ErrorBody:
    assert response.headers["content-type"].startswith("application/json")
    return decode(response.content, ErrorBody)


@pytest.fixture
async def start_service(tmp_path: Path, runtime_dir: Path) -> AsyncIterator[StartService]:
    """Start the app under uvicorn on a free loopback port (strict mode unless overridden)."""
    async with contextlib.AsyncExitStack() as stack:

        async def start(**env: str) -> Service:
            home = tmp_path / f"home{len(homes)}"
            homes.append(home)
            settings = OrchestratorSettings.from_env(
                clean_environ(
                    **{
                        "SANDCELL_HOME": str(home),
                        "SANDCELL_LOCAL_RUNTIME_DIR": str(runtime_dir),
                        "SANDCELL_API_KEYS": f"{KEY_A}=tenant-a,{KEY_B}=tenant-b",
                        "SANDCELL_RUNTIME_SESSION_MODE": "strict",
                        **env,
                    }
                )
            )
            url = await stack.enter_async_context(serving(create_app(settings), lifespan="on"))
            client = await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=120))
            return Service(settings=settings, client=client, runtime_dir=runtime_dir)

        homes: list[Path] = []
        yield start


@pytest.fixture
async def service(start_service: StartService) -> Service:
    return await start_service()


async def test_exec_keeps_session_state_across_calls(service: Service) -> None:
    """Two POST /v1/exec with one hint share the workspace; the result is an ExecuteResult."""
    first = await service.exec(code="open('n.txt', 'w').write('41')", runtime_session_hint="s1")
    assert first.status_code == 200, first.text
    result = decode(first.content, ExecuteResult)
    assert result.status == RunStatus.OK
    assert result.session_id == runtime_session_id("tenant-a", "alice", "s1")
    assert [f.name for f in result.files] == ["n.txt"]

    second = await service.exec(
        code="print(int(open('n.txt').read()) + 1)", runtime_session_hint="s1"
    )
    assert decode(second.content, ExecuteResult).stdout == "42\n"

    other_tenant = await service.exec(
        key=KEY_B, code="import os; print(os.listdir('.'))", runtime_session_hint="s1"
    )
    assert decode(other_tenant.content, ExecuteResult).stdout == "[]\n"


async def test_strict_mode_without_hint_is_session_required(service: Service) -> None:
    response = await service.exec(code="print(1)")
    assert response.status_code == 400
    assert error_of(response).error.code == ErrorCode.SESSION_REQUIRED


async def test_affinity_mode_without_hint_runs_statelessly(start_service: StartService) -> None:
    service = await start_service(SANDCELL_RUNTIME_SESSION_MODE="affinity")
    response = await service.exec(code="print(6*7)")
    assert decode(response.content, ExecuteResult).stdout == "42\n"


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b'{"language": "python", "code": 1, "user_id": "u"}',
        b'{"language": "python", "code": "1", "user_id": "u", "surprise": true}',
        b'{"language": "python", "code": "1"}',
        b'{"language": "python", "code": "1", "user_id": "u", "runtime_session_hint": "a b"}',
        b'{"language": "python", "code": "1", "user_id": "a\\u0000", "runtime_session_hint": "h"}',
    ],
)
async def test_bad_body_is_bad_request(service: Service, content: bytes) -> None:
    response = await service.client.post("/v1/exec", content=content, headers=service.auth())
    assert response.status_code == 400
    body = error_of(response)
    assert (body.error.code, body.error.retryable) == (ErrorCode.BAD_REQUEST, False)


async def test_user_id_follows_the_protocols_one_rule(service: Service) -> None:
    """``user_id`` is 1 to 128 characters without control characters (as a hint is at most
    128): a longer one, or a control character, is 400 ``bad_request`` naming the field on
    /v1/exec and /v1/run, with or without a session; 128 characters run."""
    bad_users = ["u" * 129, "u" * 100_000, "a\nb", "a\x7fb", "a\x85b", ""]
    for user in bad_users:
        for route, extra in (
            ("/v1/exec", {}),
            ("/v1/exec", {"runtime_session_hint": "long-user"}),
            ("/v1/run", {"runtime_session_hint": "long-user"}),
        ):
            payload = {"language": "python", "code": "print(1)", "user_id": user, **extra}
            response = await service.client.post(route, json=payload, headers=service.auth())
            assert response.status_code == 400, (route, user[:10], response.text)
            error = error_of(response).error
            assert (error.code, error.retryable) == (ErrorCode.BAD_REQUEST, False)
            assert "user_id" in error.message
            assert len(response.content) < 1000  # the rule, not the value, is echoed
    ok = await service.exec(code="print(6*7)", user_id="é" * 128, runtime_session_hint="u128")
    result = decode(ok.content, ExecuteResult)
    assert result.stdout == "42\n"
    assert result.session_id == runtime_session_id("tenant-a", "é" * 128, "u128")


async def test_unsupported_language_is_the_runners_code(service: Service) -> None:
    response = await service.exec(language="cobol", code="x", runtime_session_hint="lang")
    assert response.status_code == 400
    assert error_of(response).error.code == ErrorCode.UNSUPPORTED_LANGUAGE


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": f"Bearer {WRONG_KEY}"}, {"Authorization": f"Basic {KEY_A}"}],
)
async def test_missing_or_wrong_key_is_401(
    service: Service, headers: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    """401 with WWW-Authenticate; the offered key appears in no answer and no log line."""
    caplog.set_level(logging.DEBUG)
    for method, path in (("POST", "/v1/exec"), ("GET", "/v1/sessions")):
        response = await service.client.request(method, path, headers=headers, json={})
        assert response.status_code == 401
        assert response.headers["www-authenticate"] == "Bearer"
        assert error_of(response).error.code == ErrorCode.UNAUTHORIZED
        assert WRONG_KEY not in response.text
        assert KEY_A not in response.text
    assert WRONG_KEY not in caplog.text
    assert KEY_A not in caplog.text


async def test_healthz_and_metrics_need_no_key(service: Service) -> None:
    assert (await service.client.get("/healthz")).json() == {"status": "ok"}
    await service.exec(code="print(1)", runtime_session_hint="m")
    metrics = await service.client.get("/metrics")
    assert metrics.status_code == 200
    assert metrics.headers["content-type"].startswith("text/plain")
    assert 'sandcell_executions_total{status="ok"} 1' in metrics.text
    assert "# HELP sandcell_executions_total" in metrics.text
    assert 'sandcell_launches_total{outcome="ok"} 1' in metrics.text


async def test_unknown_route_and_method(service: Service) -> None:
    """An unknown route is 404 ``not_found``; a known one with another method is 405
    ``method_not_allowed`` whose ``Allow`` names every method of the path (egress has a
    route for each of two)."""
    missing = await service.client.get("/v1/nothing", headers=service.auth())
    assert (missing.status_code, error_of(missing).error.code) == (404, ErrorCode.NOT_FOUND)
    wrong = await service.client.get("/v1/exec", headers=service.auth())
    assert (wrong.status_code, error_of(wrong).error.code) == (405, ErrorCode.METHOD_NOT_ALLOWED)
    assert wrong.headers["allow"] == "POST"
    assert error_of(wrong).error.retryable is False
    egress = f"/v1/sessions/{runtime_session_id('tenant-a', 'alice', 'a')}/egress"
    wrong = await service.client.post(egress, headers=service.auth())
    assert (wrong.status_code, error_of(wrong).error.code) == (405, ErrorCode.METHOD_NOT_ALLOWED)
    assert wrong.headers["allow"] == "GET, HEAD, PUT"


async def test_sessions_list_and_delete_per_namespace(service: Service) -> None:
    """A tenant lists and deletes its own sessions only; delete removes the checkpoint."""
    assert (
        await service.exec(code="open('f','w').write('1')", runtime_session_hint="a")
    ).is_success
    session_id = runtime_session_id("tenant-a", "alice", "a")
    assert service.checkpoint_files(session_id)

    listed = (await service.client.get("/v1/sessions", headers=service.auth())).json()
    assert listed == {
        "sessions": [
            {
                "session_id": session_id,
                "user_id": "alice",
                "hint": "a",
                "state": "active",
                "has_checkpoint": True,
                "updated_at_s": listed["sessions"][0]["updated_at_s"],
            }
        ]
    }
    theirs = await service.client.get("/v1/sessions", headers=service.auth(KEY_B))
    assert theirs.json() == {"sessions": []}

    path = f"/v1/sessions/{session_id}"
    foreign = await service.client.delete(path, headers=service.auth(KEY_B))
    assert (foreign.status_code, error_of(foreign).error.code) == (404, ErrorCode.NOT_FOUND)
    bad = await service.client.delete("/v1/sessions/rt_nope", headers=service.auth())
    assert (bad.status_code, error_of(bad).error.code) == (400, ErrorCode.BAD_REQUEST)

    deleted = await service.client.delete(path, headers=service.auth())
    assert deleted.status_code == 204
    assert not service.checkpoint_files(session_id)
    assert runner_processes(service.runtime_dir) == []
    assert (await service.client.get("/v1/sessions", headers=service.auth())).json() == {
        "sessions": []
    }
    again = await service.client.delete(path, headers=service.auth())
    assert again.status_code == 404


async def test_sessions_list_comes_a_page_at_a_time(service: Service) -> None:
    """``limit`` and ``after`` page through a tenant's sessions in id order, each page
    naming where the next begins; bad values are 400; another tenant paging with the
    same cursor sees none of them."""
    for hint in ("p1", "p2", "p3"):
        assert (await service.exec(code="print(1)", runtime_session_hint=hint)).is_success
    ids = sorted(runtime_session_id("tenant-a", "alice", hint) for hint in ("p1", "p2", "p3"))
    auth = service.auth()
    first = (await service.client.get("/v1/sessions?limit=2", headers=auth)).json()
    assert [item["session_id"] for item in first["sessions"]] == ids[:2]
    assert first["next_after"] == ids[1]
    rest = await service.client.get(f"/v1/sessions?limit=2&after={ids[1]}", headers=auth)
    assert [item["session_id"] for item in rest.json()["sessions"]] == ids[2:]
    assert "next_after" not in rest.json()
    whole = (await service.client.get("/v1/sessions", headers=auth)).json()
    assert [item["session_id"] for item in whole["sessions"]] == ids
    theirs = await service.client.get(f"/v1/sessions?after={ids[0]}", headers=service.auth(KEY_B))
    assert theirs.json() == {"sessions": []}
    malformed = (
        "limit=0",
        "limit=1001",
        "limit=two",
        "limit=-1",
        "limit=%D9%A3",  # an Arabic-Indic 3: str.isdecimal() takes it
        "limit=" + "1" * 5000,  # past int()'s 4300 digits: a ValueError, not a 400
        "after=rt_nope",
        "after=",
    )
    for query in malformed:
        bad = await service.client.get(f"/v1/sessions?{query}", headers=auth)
        answer = (bad.status_code, error_of(bad).error.code)
        assert answer == (400, ErrorCode.BAD_REQUEST), query[:40]


async def test_idle_sweeper_suspends_and_next_call_restores(start_service: StartService) -> None:
    """The lifespan's sweeper suspends an idle session; the next exec restores its files."""
    service = await start_service(SANDCELL_IDLE_TIMEOUT_S="0.5", SANDCELL_SWEEP_INTERVAL_S="0.2")
    await service.exec(code="open('keep','w').write('yes')", runtime_session_hint="idle")
    for _ in range(100):
        sessions = (await service.client.get("/v1/sessions", headers=service.auth())).json()
        if sessions["sessions"][0]["state"] == "suspended":
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError(f"never suspended: {sessions}")
    assert runner_processes(service.runtime_dir) == []
    response = await service.exec(code="print(open('keep').read())", runtime_session_hint="idle")
    assert decode(response.content, ExecuteResult).stdout == "yes\n"
    metrics = (await service.client.get("/metrics")).text
    assert "sandcell_idle_suspends_total 1" in metrics
    assert 'sandcell_restores_total{outcome="ok"} 1' in metrics


async def test_shutdown_destroys_sandboxes(start_service: StartService, tmp_path: Path) -> None:
    """With the in-process registry, stopping the service leaves no runner behind."""
    service = await start_service()
    await service.exec(code="print(1)", runtime_session_hint="bye")
    assert runner_processes(service.runtime_dir) != []
    # The fixture stops the service; the runtime_dir fixture then asserts nothing is left.
