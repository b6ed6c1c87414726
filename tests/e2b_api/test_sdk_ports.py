"""A server in a sandbox, reached at the SDK's ``get_host(port)``: HTTP and WebSocket.

``<port>-<sandboxID>.<domain>`` is routed by ``Host`` onto ``/e2b/sandbox`` (the test
service runs with ``SANDCELL_E2B_DOMAIN``); the server is the stdlib HTTP + WebSocket
echo server the preview tests run, started with ``commands.run(background=True)``.
"""

from __future__ import annotations

import time

import httpx
import pytest
import websockets
from e2b import Sandbox
from websockets.asyncio.client import connect

from tests.e2b_api.conftest import E2bServe
from tests.orchestrator.apps.test_websocket import WS_APP

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
