"""Code contexts on ``sandcell serve``: /v1/run and /v1/sessions/{id}/contexts, over real
uvicorn and real runners."""

from __future__ import annotations

import json

from sandcell_protocol import ErrorCode, decode, runtime_session_id
from sandcell_protocol import contexts as cx
from tests.orchestrator.serve.test_serve import (
    KEY_A,
    KEY_B,
    Service,
    error_of,
    service,
    start_service,
)

__all__ = ["service", "start_service"]


async def run(service: Service, code: str, key: str = KEY_A, **body: object) -> cx.ContextRunResult:
    payload = {"language": "python", "user_id": "alice", "code": code, **body}
    response = await service.client.post("/v1/run", json=payload, headers=service.auth(key))
    assert response.status_code == 200, response.text
    return decode(response.content, cx.ContextRunResult)


async def test_run_keeps_variables_and_streams_when_asked(service: Service) -> None:
    first = await run(service, "x = 41", runtime_session_hint="nb")
    assert first.status is cx.ContextStatus.OK
    second = await run(service, "x + 1", runtime_session_hint="nb")
    assert [r.data for r in second.results] == [{"text/plain": "42"}]
    payload = {
        "language": "python",
        "user_id": "alice",
        "code": "print('hi')\nx * 2",
        "runtime_session_hint": "nb",
    }
    async with service.client.stream(
        "POST",
        "/v1/run",
        json=payload,
        headers={**service.auth(), "Accept": "application/x-ndjson"},
    ) as response:
        assert response.status_code == 200
        lines = [json.loads(line) async for line in response.aiter_lines() if line]
    assert [line["type"] for line in lines] == ["stdout", "result", "end"]
    assert lines[1]["data"] == {"text/plain": "82"}
    # The context is listed under the session; another tenant sees no such session.
    session_id = runtime_session_id("tenant-a", "alice", "nb")
    route = f"/v1/sessions/{session_id}/contexts"
    listed = await service.client.get(route, headers=service.auth())
    assert [c["context_id"] for c in listed.json()["contexts"]] == ["default-python"]
    foreign = await service.client.get(route, headers=service.auth(KEY_B))
    unknown = await service.client.get(
        f"/v1/sessions/rt_{'0' * 64}/contexts", headers=service.auth()
    )
    assert foreign.status_code == unknown.status_code == 404
    assert foreign.json() == unknown.json()


async def test_context_routes_create_restart_delete(service: Service) -> None:
    await run(service, "y = 1", runtime_session_hint="routes", context_id="work")
    session_id = runtime_session_id("tenant-a", "alice", "routes")
    base = f"/v1/sessions/{session_id}/contexts"
    created = await service.client.post(
        base, json={"language": "python", "context_id": "second"}, headers=service.auth()
    )
    assert created.status_code == 201, created.text
    assert created.json()["context_id"] == "second"
    restarted = await service.client.post(f"{base}/work/restart", headers=service.auth())
    assert restarted.status_code == 200, restarted.text
    again = await run(service, "y", runtime_session_hint="routes", context_id="work")
    assert again.error is not None
    assert again.error.name == "NameError"
    gone = await service.client.delete(f"{base}/second", headers=service.auth())
    assert gone.status_code == 204
    missing = await service.client.delete(f"{base}/second", headers=service.auth())
    assert (missing.status_code, error_of(missing).error.code) == (404, ErrorCode.NOT_FOUND)


async def test_dot_context_ids_are_refused_at_the_door(service: Service) -> None:
    """``.`` and ``..`` (and any id not starting with a letter or digit) are 400 on every
    route that takes a context id, before a runner is asked."""
    await run(service, "1", runtime_session_hint="dots")
    session_id = runtime_session_id("tenant-a", "alice", "dots")
    base = f"/v1/sessions/{session_id}/contexts"
    client = service.client
    for dots in (".", "..", "-x"):
        ran = await client.post(
            "/v1/run",
            json={
                "user_id": "alice",
                "code": "1",
                "runtime_session_hint": "dots",
                "context_id": dots,
            },
            headers=service.auth(),
        )
        created = await client.post(
            base, json={"language": "python", "context_id": dots}, headers=service.auth()
        )
        answers = [ran, created]
        # Percent-encoded, or the client would normalize them away; the server decodes them.
        segment = dots.replace(".", "%2E")
        for method, suffix in (("DELETE", ""), ("POST", "/restart"), ("POST", "/interrupt")):
            path = f"{base}/{segment}{suffix}"
            answers.append(await client.request(method, path, headers=service.auth()))
        for answer in answers:
            assert (answer.status_code, error_of(answer).error.code) == (
                400,
                ErrorCode.BAD_REQUEST,
            ), (dots, answer.request.url, answer.text)


async def test_a_lost_context_answers_context_lost(service: Service) -> None:
    crashed = await run(service, "import os\nos._exit(3)", runtime_session_hint="lost")
    assert crashed.status is cx.ContextStatus.CONTEXT_LOST
    assert crashed.context_lost is True
    payload = {
        "language": "python",
        "user_id": "alice",
        "code": "1",
        "runtime_session_hint": "lost",
    }
    response = await service.client.post("/v1/run", json=payload, headers=service.auth())
    assert (response.status_code, error_of(response).error.code) == (409, ErrorCode.CONTEXT_LOST)


async def test_run_needs_a_session_and_refuses_program_fields(service: Service) -> None:
    payload = {"language": "python", "user_id": "alice", "code": "1"}
    response = await service.client.post("/v1/run", json=payload, headers=service.auth())
    assert (response.status_code, error_of(response).error.code) == (
        400,
        ErrorCode.SESSION_REQUIRED,
    )
    with_args = {**payload, "runtime_session_hint": "a", "args": ["x"]}
    response = await service.client.post("/v1/run", json=with_args, headers=service.auth())
    assert (response.status_code, error_of(response).error.code) == (400, ErrorCode.BAD_REQUEST)
