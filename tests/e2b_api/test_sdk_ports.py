"""A server in a sandbox, reached at the SDK's ``get_host(port)``: HTTP and WebSocket.

``<port>-<sandboxID>.<domain>`` is routed by ``Host`` onto ``/e2b/sandbox`` (the test
service runs with ``SANDCELL_E2B_DOMAIN``); the server is the stdlib HTTP + WebSocket
echo server the preview tests run, started with ``commands.run(background=True)``.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import websockets
from e2b import Sandbox
from e2b.exceptions import NotFoundException
from websockets.asyncio.client import ClientConnection, connect

from tests.e2b_api.conftest import E2bServe, start_serve, stop_serve
from tests.fixtures.paths import traversable_dir
from tests.orchestrator.apps.test_websocket import WS_APP
from tests.orchestrator.cli.conftest import stop_leftovers
from tests.runner.apps.test_preview_caps import HOLD_SERVER

PORT = 8000
TOKEN_HEADER = "e2b-traffic-access-token"


def _start_server(sandbox: Sandbox) -> None:
    sandbox.files.write("app.py", WS_APP)
    sandbox.commands.run(f"PORT={PORT} python3 app.py", background=True)


def _get(
    serve: E2bServe, host: str, path: str = "/", *, token: str | None = None
) -> httpx.Response:
    headers = {"Host": host}
    if token is not None:
        headers[TOKEN_HEADER] = token
    return httpx.get(f"{serve.url}{path}", headers=headers, timeout=30)


def _until_served(serve: E2bServe, host: str, token: str | None) -> httpx.Response:
    deadline = time.monotonic() + 30
    while True:
        answer = _get(serve, host, token=token)
        if answer.status_code == 200 or time.monotonic() > deadline:
            return answer
        time.sleep(0.2)  # the server is still starting: the runner's 502


def test_a_server_in_the_sandbox_answers_at_its_host_with_the_traffic_token(
    e2b_serve: E2bServe,
) -> None:
    sandbox = Sandbox.create(**e2b_serve.opts())
    other = Sandbox.create(**e2b_serve.opts())
    try:
        _start_server(sandbox)
        host = sandbox.get_host(PORT)
        assert host.startswith(f"{PORT}-{sandbox.sandbox_id}.")
        answer = _until_served(e2b_serve, host, sandbox.traffic_access_token)
        assert (answer.status_code, answer.text) == (200, "plain http")
        # Without the token, with a wrong one, with another sandbox's: as for no sandbox.
        refused = [
            _get(e2b_serve, host),
            _get(e2b_serve, host, token="x" * 40),
            _get(e2b_serve, host, token=other.traffic_access_token),
            _get(e2b_serve, f"{PORT}-{'z' * 20}.{host.split('.', 1)[1]}", token="x"),
        ]
        assert [r.status_code for r in refused] == [502, 502, 502, 502]
        assert len({r.json()["message"].replace(sandbox.sandbox_id, "ID") for r in refused}) <= 2
        # A port nothing listens on is the runner's answer for a silent app.
        silent = _get(e2b_serve, sandbox.get_host(PORT + 1), token=sandbox.traffic_access_token)
        assert silent.status_code == 502
        assert silent.json()["error"]["code"] == "app_not_responding"
        # A dot segment could climb out of the runner's ports route: refused here.
        climbing = _get(
            e2b_serve, host, "/%2e%2e/%2e%2e/v1/execute", token=sandbox.traffic_access_token
        )
        assert climbing.status_code == 400
    finally:
        sandbox.kill()
        other.kill()


def test_a_public_sandbox_needs_no_token(e2b_serve: E2bServe) -> None:
    sandbox = Sandbox.create(network={"allow_public_traffic": True}, **e2b_serve.opts())
    try:
        _start_server(sandbox)
        answer = _until_served(e2b_serve, sandbox.get_host(PORT), None)
        assert (answer.status_code, answer.text) == (200, "plain http")
    finally:
        sandbox.kill()


async def test_a_websocket_reaches_the_server_in_the_sandbox(e2b_serve: E2bServe) -> None:
    sandbox = Sandbox.create(**e2b_serve.opts())
    try:
        _start_server(sandbox)
        host = sandbox.get_host(PORT)
        assert _until_served(e2b_serve, host, sandbox.traffic_access_token).status_code == 200
        # The URL's host is the Host header; the connection goes to the service.
        url, to_service = f"ws://{host}/hmr", {"host": "127.0.0.1", "port": e2b_serve.port}
        token = {TOKEN_HEADER: sandbox.traffic_access_token or ""}
        async with connect(url, additional_headers=token, open_timeout=10, **to_service) as ws:
            await ws.send("ping")
            assert await ws.recv() == "echo:ping"
        with pytest.raises(websockets.exceptions.InvalidStatus):
            async with connect(url, open_timeout=10, **to_service):
                pass
    finally:
        sandbox.kill()


CAP = 3


@pytest.fixture(scope="module")
def capped_serve() -> Iterator[E2bServe]:
    """A service whose sandboxes' runners relay at most CAP WebSockets and CAP requests."""
    caps = {
        "SANDCELL_RUNNER_MAX_RELAYED_WEBSOCKETS": str(CAP),
        "SANDCELL_RUNNER_MAX_RELAYED_REQUESTS": str(CAP),
    }
    with traversable_dir("e2b-caps-") as base:
        service = start_serve(base, env=caps)
        try:
            yield service
        finally:
            stop_serve(service)
            assert not stop_leftovers(service.runtime_dir)


def _busy(status: int, body: bytes, setting: str) -> None:
    assert status == 503, body
    error = json.loads(body)["error"]
    assert error["code"] == "busy", error
    assert f"{setting}={CAP}" in error["message"], error


async def test_past_the_sandboxs_cap_a_websocket_is_refused_503_busy(
    capped_serve: E2bServe,
) -> None:
    """The runner's refusal reaches the caller as it came (not a 403 or a 5xx of the
    service's own), and a closed WebSocket gives its place back."""
    sandbox = Sandbox.create(**capped_serve.opts())
    try:
        _start_server(sandbox)
        host = sandbox.get_host(PORT)
        assert _until_served(capped_serve, host, sandbox.traffic_access_token).status_code == 200
        url, to_service = f"ws://{host}/hmr", {"host": "127.0.0.1", "port": capped_serve.port}
        token = {TOKEN_HEADER: sandbox.traffic_access_token or ""}

        async def opened() -> ClientConnection:
            return await connect(url, additional_headers=token, open_timeout=10, **to_service)

        async with contextlib.AsyncExitStack() as stack:
            held = [await stack.enter_async_context(await opened()) for _ in range(CAP)]
            with pytest.raises(websockets.exceptions.InvalidStatus) as refused:
                await opened()
            answer = refused.value.response
            _busy(answer.status_code, answer.body, "SANDCELL_RUNNER_MAX_RELAYED_WEBSOCKETS")
            assert answer.headers["retry-after"] == "1"
            await held[0].send("still")
            assert await held[0].recv() == "echo:still"
            # Plain requests have a cap of their own.
            assert _get(capped_serve, host, token=sandbox.traffic_access_token).status_code == 200
            await held[0].close()
            deadline = time.monotonic() + 20
            again: ClientConnection | None = None
            while again is None:
                status = 101
                try:
                    again = await stack.enter_async_context(await opened())
                except websockets.exceptions.InvalidStatus as exc:
                    status = exc.response.status_code
                assert status in (101, 503), status
                assert time.monotonic() < deadline, "no place came free"
            await again.send("again")
            assert await again.recv() == "echo:again"
    finally:
        sandbox.kill()


def _arrivals(sandbox: Sandbox) -> int:
    """How many held requests the hold server has seen (read through envd, not a port)."""
    try:
        return sandbox.files.read("arrivals").count("arrived")
    except NotFoundException:
        return 0


def test_past_the_sandboxs_cap_a_request_is_refused_503_busy(capped_serve: E2bServe) -> None:
    sandbox = Sandbox.create(**capped_serve.opts())
    try:
        sandbox.files.write("hold.py", HOLD_SERVER)
        sandbox.commands.run(f"python3 hold.py {PORT}", background=True)
        host = sandbox.get_host(PORT)
        token = sandbox.traffic_access_token
        assert _until_served(capped_serve, host, token).status_code == 200
        with ThreadPoolExecutor(CAP) as pool:
            waiting = [pool.submit(_get, capped_serve, host, "/hold", token=token)]
            waiting += [pool.submit(_get, capped_serve, host, "/hold", token=token)]
            waiting += [pool.submit(_get, capped_serve, host, "/hold", token=token)]
            deadline = time.monotonic() + 30
            while _arrivals(sandbox) < CAP:
                assert time.monotonic() < deadline, "the held requests never arrived"
                time.sleep(0.05)
            refused = _get(capped_serve, host, token=token)
            _busy(refused.status_code, refused.content, "SANDCELL_RUNNER_MAX_RELAYED_REQUESTS")
            sandbox.files.write("go", "")
            assert [f.result().text for f in waiting] == ["done"] * CAP
        assert _until_served(capped_serve, host, token).text == "done"
    finally:
        sandbox.kill()
