"""No token, proxy credential or request body reaches a log line, an exception or a repr."""

from __future__ import annotations

import logging
import traceback
from collections.abc import Generator

import httpx
import pytest

from sandcell_orchestrator.errors import ConfigError, SandcellError
from sandcell_orchestrator.runner.client import RunnerClient
from sandcell_protocol import ErrorCode, ExecuteRequest, headers, runtime_session_id
from tests.fixtures.runner_process import RunnerProcess, free_port

from .conftest import TOKEN, FakeRunner, error_response

PROXY_SECRET = "proxy-credential-5f2b9e0c"
BODY_SECRET = "body-secret-a81d77"
SESSION = runtime_session_id("ns", "user", "secrets")


class ProxyAuth(httpx.Auth):
    """What a cloud provider's proxy needs: one more secret header on every request."""

    def __init__(self, value: str = PROXY_SECRET) -> None:
        self.value = value

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        request.headers[headers.AWS_PROXY_AUTH] = self.value
        yield request


def _texts(exc: BaseException) -> list[str]:
    return [str(exc), repr(exc), "".join(traceback.format_exception(exc))]


def _assert_clean(texts: list[str], *secrets: str) -> None:
    for text in texts:
        for secret in secrets:
            assert secret not in text


@pytest.fixture
def all_logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG)
    for name in ("httpx", "httpcore", "sandcell_orchestrator"):
        caplog.set_level(logging.DEBUG, logger=name)
    return caplog


async def test_real_runner_calls_leak_no_secret(
    runner: RunnerProcess, all_logs: pytest.LogCaptureFixture
) -> None:
    """Success, refusals, a wrong token, a read timeout and a dead port, all logged at DEBUG."""
    caught: list[BaseException] = []
    secret_env = {"SECRET_VALUE": BODY_SECRET}
    async with RunnerClient(runner.url, token=runner.token, auth=ProxyAuth()) as client:
        await client.health()
        await client.execute(ExecuteRequest(language="bash", code="true", env=secret_env))
        for bad in (
            ExecuteRequest(language="cobol", code=BODY_SECRET, env=secret_env),
            ExecuteRequest(language="bash", code=f"sleep 2 # {BODY_SECRET}", env=secret_env),
        ):
            try:
                await client.execute(bad, timeout_s=0.3)
            except SandcellError as exc:
                caught.append(exc)
        client_repr = repr(client)
    async with RunnerClient(runner.url, token="wrong-" + runner.token, auth=ProxyAuth()) as client:
        try:
            await client.execute(ExecuteRequest(language="bash", code=BODY_SECRET))
        except SandcellError as exc:
            caught.append(exc)
    dead = f"http://127.0.0.1:{free_port()}"
    async with RunnerClient(dead, token=runner.token, auth=ProxyAuth()) as client:
        try:
            await client.execute(ExecuteRequest(language="bash", code=BODY_SECRET))
        except SandcellError as exc:
            caught.append(exc)
    assert len(caught) == 4
    assert any(record.name.startswith("httpx") for record in all_logs.records)
    texts = [all_logs.text, client_repr] + [t for exc in caught for t in _texts(exc)]
    _assert_clean(texts, runner.token, PROXY_SECRET, BODY_SECRET)


async def test_an_error_body_echoing_a_secret_is_redacted(
    all_logs: pytest.LogCaptureFixture,
) -> None:
    """Even a runner (or proxy) that echoes our headers cannot put them into an error."""
    fake = FakeRunner(
        handler=lambda request: error_response(
            ErrorCode.BAD_REQUEST,
            f"you sent {request.headers[headers.AUTHORIZATION]} and "
            f"{request.headers[headers.AWS_PROXY_AUTH]}",
        )
    )
    async with fake.client(auth=ProxyAuth()) as client:
        with pytest.raises(SandcellError) as caught:
            await client.execute(ExecuteRequest(language="bash", code="true"))
    assert "[redacted]" in str(caught.value)
    _assert_clean([*_texts(caught.value), all_logs.text], TOKEN, PROXY_SECRET)


async def test_a_header_h11_refuses_does_not_surface_its_value(
    runner: RunnerProcess, all_logs: pytest.LogCaptureFixture
) -> None:
    """h11 quotes an illegal header value in its error, and httpcore logs that error at
    DEBUG: the client refuses such a value itself, naming only the header."""
    bad_value = f"{PROXY_SECRET}\r\nInjected: 1"
    async with RunnerClient(runner.url, token=runner.token, auth=ProxyAuth(bad_value)) as client:
        with pytest.raises(ConfigError, match="X-aws-proxy-auth") as caught:
            await client.health()
    _assert_clean([*_texts(caught.value), all_logs.text], PROXY_SECRET, runner.token)


async def test_session_ids_and_paths_are_fine_to_log_but_bodies_are_not(
    all_logs: pytest.LogCaptureFixture,
) -> None:
    """A file's bytes and an upload never appear in logs or errors, whatever the answer."""
    fake = FakeRunner(handler=lambda request: error_response(ErrorCode.INTERNAL, "boom", 500))
    async with fake.client() as client:
        with pytest.raises(SandcellError) as caught:
            await client.write_file("f.txt", BODY_SECRET.encode(), session_id=SESSION)
    _assert_clean([*_texts(caught.value), all_logs.text], BODY_SECRET, TOKEN)
    assert "/v1/session/files/f.txt" in str(caught.value)
