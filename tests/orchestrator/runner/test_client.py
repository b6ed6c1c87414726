"""RunnerClient against real runner processes (and a fake where a real one cannot misbehave)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import re
import time

import httpx
import pytest

from sandcell_orchestrator.errors import (
    ConfigError,
    ProtocolMismatchError,
    RunnerRequestError,
    SandboxTimeoutError,
    SandboxUnavailableError,
)
from sandcell_orchestrator.runner.client import InputPayload, RunnerClient
from sandcell_protocol import (
    PROTOCOL_VERSION,
    ExecuteRequest,
    InputUploadResult,
    ResultEvent,
    RunStatus,
    StderrEvent,
    StdoutEvent,
    headers,
    input_cache_key,
    routes,
    runtime_session_id,
)
from tests.fixtures.runner_process import RunnerProcess, free_port

from .conftest import TOKEN, FakeRunner, StartRunner, json_response, result

SESSION = runtime_session_id("ns", "user", "hint")


async def test_health_reports_the_runner(client: RunnerClient) -> None:
    """GET /health decodes into Health with our protocol."""
    health = await client.health()
    assert health.status == "ok"
    assert health.protocol == PROTOCOL_VERSION
    assert "bash" in health.languages


async def test_execute_returns_the_result(client: RunnerClient) -> None:
    """A stateless execute round-trips an ExecuteRequest into an ExecuteResult."""
    result = await client.execute(ExecuteRequest(language="python", code="print(6 * 7)"))
    assert result.status is RunStatus.OK
    assert result.exit_code == 0
    assert result.stdout == "42\n"


async def test_execute_stream_yields_output_then_exactly_one_result(client: RunnerClient) -> None:
    """NDJSON events arrive in order and the stream ends with a single ResultEvent."""
    request = ExecuteRequest(language="bash", code="echo out; echo err >&2; echo more")
    async with contextlib.aclosing(client.execute_stream(request)) as events:
        seen = [event async for event in events]
    assert isinstance(seen[-1], ResultEvent)
    assert not any(isinstance(event, ResultEvent) for event in seen[:-1])
    stdout = "".join(e.data for e in seen if isinstance(e, StdoutEvent))
    stderr = "".join(e.data for e in seen if isinstance(e, StderrEvent))
    assert stdout == "out\nmore\n"
    assert stderr == "err\n"
    assert seen[-1].result.stdout == stdout


async def test_leaving_a_stream_early_closes_it(client: RunnerClient) -> None:
    """Breaking out of a stream releases its connection; the client keeps working."""
    request = ExecuteRequest(language="bash", code="for i in 1 2 3; do echo $i; sleep 0.1; done")
    async with contextlib.aclosing(client.execute_stream(request)) as events:
        async for _event in events:
            break
    result = await client.execute(ExecuteRequest(language="bash", code="echo again"))
    assert result.stdout == "again\n"


async def test_wrong_token_is_a_refusal(runner: RunnerProcess) -> None:
    """401 unauthorized becomes RunnerRequestError(code='unauthorized')."""
    async with RunnerClient(runner.url, token="not-the-token") as client:
        with pytest.raises(RunnerRequestError) as caught:
            await client.execute(ExecuteRequest(language="bash", code="true"))
    assert caught.value.code == "unauthorized"
    assert "HTTP 401" in str(caught.value)


async def test_unknown_language_is_a_refusal(client: RunnerClient) -> None:
    """The runner's 400 unsupported_language keeps its code."""
    with pytest.raises(RunnerRequestError) as caught:
        await client.execute(ExecuteRequest(language="cobol", code="x"))
    assert caught.value.code == "unsupported_language"
    assert not caught.value.retryable


async def test_session_header_on_a_stateless_runner_is_refused(client: RunnerClient) -> None:
    """Without SANDCELL_RUNNER_SESSIONS the runner refuses a session id; we surface it typed."""
    with pytest.raises(RunnerRequestError):
        await client.execute(ExecuteRequest(language="bash", code="true"), session_id=SESSION)


async def test_connection_refused_is_unavailable() -> None:
    """Nothing listening: SandboxUnavailableError (retryable), not an httpx error."""
    async with RunnerClient(f"http://127.0.0.1:{free_port()}", token=TOKEN) as client:
        with pytest.raises(SandboxUnavailableError) as caught:
            await client.health()
    assert caught.value.retryable
    assert caught.value.__cause__ is None
    assert caught.value.__suppress_context__


async def test_read_timeout_is_a_timeout(client: RunnerClient) -> None:
    """The runner accepted the job and went quiet past our read timeout."""
    request = ExecuteRequest(language="bash", code="sleep 2", timeout_ms=10_000)
    with pytest.raises(SandboxTimeoutError):
        await client.execute(request, timeout_s=0.3)


async def test_wait_ready_polls_until_the_runner_answers(runner_factory: StartRunner) -> None:
    """A runner still starting is waited for, not reported unavailable."""
    process = runner_factory(wait=False)
    async with RunnerClient(process.url, token=process.token) as client:
        health = await client.wait_ready(timeout_s=30)
    assert health.status == "ok"


async def test_wait_ready_gives_up_at_the_deadline() -> None:
    """No runner ever: SandboxUnavailableError after about timeout_s."""
    async with RunnerClient(f"http://127.0.0.1:{free_port()}", token=TOKEN) as client:
        started = time.monotonic()
        with pytest.raises(SandboxUnavailableError, match="not ready in"):
            await client.wait_ready(timeout_s=0.5, interval_s=0.05)
    assert time.monotonic() - started < 5


async def test_protocol_mismatch_is_refused_on_first_contact() -> None:
    """A runner speaking 2.0 is refused before any other call; the message names both."""
    fake = FakeRunner(protocol="2.0")
    async with fake.client() as client:
        with pytest.raises(ProtocolMismatchError) as caught:
            await client.execute(ExecuteRequest(language="bash", code="true"))
    assert "2.0" in str(caught.value)
    assert PROTOCOL_VERSION in str(caught.value)
    assert fake.paths() == [routes.HEALTH]


async def test_protocol_mismatch_on_a_real_uvicorn_server() -> None:
    """The same refusal over real HTTP, from a tiny Starlette app on loopback."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def health(request: object) -> JSONResponse:
        return JSONResponse({"status": "ok", "protocol": "2.0", "runner_version": "9"})

    app = Starlette(routes=[Route("/health", health)])
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        async with RunnerClient(f"http://127.0.0.1:{port}", token=TOKEN) as client:
            ours = re.escape(PROTOCOL_VERSION)
            with pytest.raises(ProtocolMismatchError, match=rf"'2\.0'.*'{ours}'"):
                await client.wait_ready(timeout_s=5)
    finally:
        server.should_exit = True
        await task


async def test_compatible_minor_is_accepted_and_checked_once() -> None:
    """1.7 shares our major: accepted, and /health is asked once for many calls."""
    fake = FakeRunner(protocol="1.7")
    async with fake.client() as client:
        for _ in range(3):
            await client.execute(ExecuteRequest(language="bash", code="true"))
    assert fake.paths() == [routes.HEALTH, routes.EXECUTE, routes.EXECUTE, routes.EXECUTE]


async def test_every_call_carries_the_contract_headers() -> None:
    """Bearer token (on /health too: without it a runner answers only a load balancer's
    summary), protocol, a fresh request id, and the session id."""
    fake = FakeRunner()
    async with fake.client() as client:
        await client.execute(ExecuteRequest(language="bash", code="true"))
        await client.execute(ExecuteRequest(language="bash", code="true"), session_id=SESSION)
    health, stateless, bound = fake.requests
    for request in (health, stateless, bound):
        assert request.headers[headers.AUTHORIZATION] == f"Bearer {TOKEN}"
    for request in fake.requests:
        assert request.headers[headers.PROTOCOL] == PROTOCOL_VERSION
    assert len({r.headers[headers.REQUEST_ID] for r in fake.requests}) == 3
    assert headers.RUNTIME_SESSION_ID not in stateless.headers
    assert bound.headers[headers.RUNTIME_SESSION_ID] == SESSION


@pytest.mark.parametrize(
    ("path", "wire_path"),
    [
        ("a b/c#d?.txt", "/v1/session/files/a%20b/c%23d%3F.txt"),
        ("dir//./x%y", "/v1/session/files/dir/x%25y"),
        ("ünï/ß", "/v1/session/files/%C3%BCn%C3%AF/%C3%9F"),
    ],
)
async def test_file_paths_are_normalized_and_quoted_per_segment(path: str, wire_path: str) -> None:
    """Each segment is URL-quoted after validate_workspace_path normalized the path."""
    fake = FakeRunner(handler=lambda request: httpx.Response(200, content=b"x"))
    async with fake.client() as client:
        assert await client.read_file(path, session_id=SESSION) == b"x"
    sent = fake.requests[-1]
    assert sent.url.raw_path.decode() == wire_path


@pytest.mark.parametrize(
    "path", ["../etc/passwd", "/etc/passwd", "a/../../b", "a\\b", "", "a\x00b"]
)
async def test_invalid_paths_are_refused_before_sending(path: str) -> None:
    """A path failing validate_workspace_path never reaches the wire."""
    fake = FakeRunner()
    async with fake.client() as client:
        with pytest.raises(RunnerRequestError) as caught:
            await client.read_file(path, session_id=SESSION)
    assert caught.value.code == "invalid_path"
    assert fake.requests == []


async def test_malformed_session_id_is_refused_before_sending() -> None:
    """Only runtime_session_id()-shaped ids go into the header."""
    fake = FakeRunner()
    async with fake.client() as client:
        with pytest.raises(RunnerRequestError) as caught:
            await client.execute(ExecuteRequest(language="bash", code="true"), session_id="s\nx")
    assert caught.value.code == "bad_request"
    assert fake.requests == []


async def test_a_malformed_success_answer_is_unavailability() -> None:
    """A 200 whose body is not the promised message means the peer is not a sane runner."""
    fake = FakeRunner(handler=lambda request: json_response({"surprise": True}))
    async with fake.client() as client:
        with pytest.raises(SandboxUnavailableError, match="malformed answer"):
            await client.execute(ExecuteRequest(language="bash", code="true"))


async def test_a_stream_that_ends_without_a_result_is_unavailability() -> None:
    """A cut stream (runner died mid-job) is not mistaken for a finished job."""
    body = b'{"type":"stdout","data":"partial"}\n'
    fake = FakeRunner(
        handler=lambda request: httpx.Response(
            200, content=body, headers={"Content-Type": routes.NDJSON}
        )
    )
    async with fake.client() as client:
        events = client.execute_stream(ExecuteRequest(language="bash", code="true"))
        async with contextlib.aclosing(events):
            with pytest.raises(SandboxUnavailableError, match="before result"):
                async for _event in events:
                    pass


def test_bad_configuration_is_refused_without_echoing_the_token() -> None:
    """A token that is not a bearer token, or a base URL that is not http(s), is a ConfigError."""
    with pytest.raises(ConfigError) as caught:
        RunnerClient("http://127.0.0.1:1", token="secret value\n")
    assert "secret value" not in str(caught.value)
    with pytest.raises(ConfigError):
        RunnerClient("ftp://127.0.0.1:1", token=TOKEN)


async def test_repr_shows_the_base_url_only_and_close_is_idempotent() -> None:
    """repr never carries the token or URL user info; closing twice is quiet."""
    client = RunnerClient("http://user:pw@127.0.0.1:9/", token=TOKEN)
    assert repr(client) == "RunnerClient(base_url='http://127.0.0.1:9/')"
    await client.close()
    await client.close()


async def test_wait_ready_gives_up_at_once_on_a_quarantined_runner() -> None:
    """Quarantine never heals: no point polling until the deadline."""
    fake = FakeRunner(status="quarantined")
    async with fake.client() as client:
        with pytest.raises(SandboxUnavailableError, match="quarantined"):
            await client.wait_ready(timeout_s=30)
    assert len(fake.requests) == 1


async def test_wait_ready_keeps_polling_a_starting_runner() -> None:
    """'starting' is not ready: polled until the deadline, then unavailable."""
    fake = FakeRunner(status="starting")
    async with fake.client() as client:
        with pytest.raises(SandboxUnavailableError, match="status starting"):
            await client.wait_ready(timeout_s=0.3, interval_s=0.05)
    assert len(fake.requests) > 1


async def test_a_stream_request_answered_with_plain_json_still_yields_one_result() -> None:
    """A peer that ignored Accept: application/x-ndjson answered one ExecuteResult."""
    fake = FakeRunner(handler=lambda request: json_response(result(stdout="plain")))
    async with fake.client() as client:
        events = client.execute_stream(ExecuteRequest(language="bash", code="true"))
        async with contextlib.aclosing(events):
            seen = [event async for event in events]
    assert len(seen) == 1
    assert isinstance(seen[0], ResultEvent)
    assert seen[0].result.stdout == "plain"
    assert fake.requests[-1].headers["Accept"] == routes.NDJSON


async def test_a_checkpoint_of_unknown_type_is_refused() -> None:
    """Only gzip or zstd archives are checkpoints; anything else is not stored."""
    fake = FakeRunner(handler=lambda request: httpx.Response(200, content=b"<html>"))
    async with fake.client() as client:
        with pytest.raises(SandboxUnavailableError, match="not a checkpoint"):
            async with client.checkpoint(session_id=SESSION):
                pass
    assert fake.requests[-1].headers["Accept-Encoding"] == "zstd"


async def test_push_inputs_sends_the_manifest_first_and_files_named_by_cache_key() -> None:
    """The multipart body follows the runner's wire shape; duplicates are sent once."""
    key = input_cache_key("s", "o")
    fake = FakeRunner(handler=lambda request: json_response(InputUploadResult(stored=[key])))
    payload = InputPayload(storage_session="s", object_id="o", data=b"bytes", read_only=True)
    async with fake.client() as client:
        assert await client.push_inputs([payload, payload]) == [key]
    body = fake.requests[-1].content
    manifest_at = body.index(b'name="manifest"')
    file_at = body.index(f'filename="{key}"'.encode())
    assert manifest_at < file_at
    assert body.count(b"filename=") == 1
    digest = hashlib.sha256(b"bytes").hexdigest()
    expected = {"objects": {key: {"size": 5, "sha256": digest, "read_only": True}}}
    manifest_json = body[manifest_at:].split(b"\r\n\r\n", 1)[1].split(b"\r\n--", 1)[0]
    assert json.loads(manifest_json) == expected
