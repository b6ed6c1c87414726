"""App routes take the handle's ``RunnerClient`` path: its transport, its injected auth.

The runner here is reachable only the way a Lambda MicroVM's is: through a gate
(an httpx transport, or a loopback server for WebSockets) that refuses any
request without the proxy header ``MicrovmProxyAuth`` adds. App calls that
built their own httpx client, as ``AppRunnerClient`` once did, never get there.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field

import anyio
import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket
from websockets.asyncio.client import connect

from sandcell_orchestrator.apps.client import AppRunnerClient
from sandcell_orchestrator.errors import RunnerRequestError, SandboxUnavailableError
from sandcell_orchestrator.handle import SandboxHandle
from sandcell_orchestrator.providers.lambda_auth import MicrovmProxyAuth, ProxyTokenCache
from sandcell_orchestrator.runner.client import RunnerClient
from sandcell_protocol import PROTOCOL_VERSION, Health, ProcessStart, encode
from tests.fixtures.paths import traversable_dir
from tests.fixtures.runner_process import RunnerProcess, running_runner

from .http_server import serve_asgi

GATE_URL = "http://microvm.invalid:8080"
PROXY_HEADER = "X-aws-proxy-auth"
PROXY_PORT = 9000
APP_PORT = 8311
SESSION = "rt_" + "c" * 64


@pytest.fixture(scope="module")
def runner() -> Iterator[RunnerProcess]:
    """A session runner for the module (it binds to SESSION on first use)."""
    with (
        traversable_dir() as root,
        running_runner(root, env={"SANDCELL_RUNNER_SESSIONS": "1"}) as process,
    ):
        yield process


@dataclass
class Minted:
    """The proxy tokens handed out, like ``CreateMicrovmAuthToken``'s."""

    tokens: list[str] = field(default_factory=list)

    async def __call__(self) -> Mapping[str, str]:
        await anyio.sleep(0)  # minting awaits, as the real one does
        self.tokens.append("proxy-SECRET-" + secrets.token_hex(8))
        return {PROXY_HEADER: self.tokens[-1]}

    def auth(self) -> MicrovmProxyAuth:
        return MicrovmProxyAuth(ProxyTokenCache(self, lifetime_s=900), port=PROXY_PORT)


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    raw_headers: list[tuple[str, str]]

    def values(self, name: str) -> list[str]:
        return [v for k, v in self.raw_headers if k.lower() == name.lower()]


class GateTransport(httpx.AsyncBaseTransport):
    """The only way to the runner: forwards a request carrying a minted proxy token."""

    def __init__(self, runner: RunnerProcess, minted: Minted) -> None:
        self._runner = runner
        self._minted = minted
        self._inner = httpx.AsyncHTTPTransport()
        self.seen: list[Seen] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        raw = [(k.decode(), v.decode()) for k, v in request.headers.raw]
        self.seen.append(Seen(request.method, request.url.path, raw))
        if request.headers.get(PROXY_HEADER) not in self._minted.tokens:
            return httpx.Response(403, content=b"<html>no proxy token</html>")
        request.url = request.url.copy_with(host="127.0.0.1", port=self._runner.port)
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self._inner.aclose()


@pytest.fixture
async def gated(
    runner: RunnerProcess,
) -> AsyncIterator[tuple[SandboxHandle, GateTransport, Minted]]:
    """A handle of the runner as the MicroVM provider builds one: gate transport, proxy auth."""
    minted = Minted()
    gate = GateTransport(runner, minted)
    client = RunnerClient(GATE_URL, token=runner.token, transport=gate, auth=minted.auth())
    handle = SandboxHandle(sandbox_id="gated", provider="gate", runner=client, session_id=SESSION)
    try:
        yield handle, gate, minted
    finally:
        await handle.close()


async def _served(app: AppRunnerClient, port: int) -> httpx.Response:
    """The first answer of the app on ``port`` once it listens (the runner says 502/503 before)."""
    with anyio.fail_after(30):
        while True:
            response = await app.port_request(
                "GET",
                port,
                "index.html",
                query="v=1",
                request_headers={"Accept": "text/html", "authorization": "Bearer forged"},
            )
            await response.aread()
            await response.aclose()
            if response.status_code not in (502, 503):
                return response
            await anyio.sleep(0.05)


async def test_app_routes_go_through_the_handles_transport_and_auth(
    gated: tuple[SandboxHandle, GateTransport, Minted], runner: RunnerProcess
) -> None:
    """Processes, logs, diagnostics and the port proxy reach a gated runner, each request
    carrying the injected auth's header, the runner token exactly once and the session."""
    handle, gate, minted = gated
    app = AppRunnerClient.for_handle(handle)
    await handle.files.write("index.html", "<p>through the gate</p>")
    started = await app.start_process(
        ProcessStart(tag="web", command=f"exec python3 -m http.server {APP_PORT} --bind 127.0.0.1")
    )
    assert started.state == "running"

    served = await _served(app, APP_PORT)
    assert served.status_code == 200
    assert b"through the gate" in served.content
    web = await app.process("web")
    assert web is not None
    assert web.state == "running"
    assert isinstance((await app.logs("web", lines=20)).lines, list)
    assert (await app.runtime_errors()).errors == []
    await app.clear_runtime_errors()
    await app.analysis()
    await app.stop_process("web")

    app_calls = [s for s in gate.seen if s.path.startswith("/v1/session/")]
    assert {s.path for s in app_calls} >= {
        "/v1/session/processes",
        "/v1/session/processes/web",
        "/v1/session/processes/web/logs",
        "/v1/session/runtime-errors",
        "/v1/session/analysis",
        f"/v1/session/ports/{APP_PORT}/index.html",
    }
    for seen in app_calls:
        (proxy_token,) = seen.values(PROXY_HEADER)
        assert proxy_token in minted.tokens
        assert seen.values("x-aws-proxy-port") == [str(PROXY_PORT)]
        # A forwarded Authorization does not ride along beside, or replace, ours.
        assert seen.values("authorization") == [f"Bearer {runner.token}"], seen.path
        assert seen.values("x-runtime-session-id") == [SESSION]
    await app.close()


def _gate_app(seen: list[dict[str, str]], minted: Minted, runner_token: str) -> Starlette:
    """A WebSocket-only stand-in for the MicroVM proxy in front of a runner's ports route."""

    async def socket(websocket: WebSocket) -> None:
        seen.append({**websocket.headers, "path": websocket.url.path, "query": websocket.url.query})
        authorized = websocket.headers.get("authorization") == f"Bearer {runner_token}"
        if websocket.headers.get(PROXY_HEADER) not in minted.tokens or not authorized:
            await websocket.close(code=1008)
            return
        await websocket.accept()
        async for text in websocket.iter_text():
            await websocket.send_text(f"echo:{text}")

    async def health(_request: Request) -> Response:
        # The client checks the runner's protocol on first contact, through the gate.
        found = Health(status="ok", protocol=PROTOCOL_VERSION, runner_version="gate")
        return Response(encode(found), media_type="application/json")

    return Starlette(
        routes=[
            WebSocketRoute("/v1/session/ports/{port}/{path:path}", socket),
            Route("/health", health, methods=["GET"]),
        ]
    )


async def test_a_websocket_upgrade_carries_what_the_injected_auth_adds() -> None:
    """``websocket_upgrade`` runs the (async) proxy auth: the gate lets the upgrade through."""
    minted = Minted()
    token = "runner-SECRET-" + secrets.token_hex(8)
    seen: list[dict[str, str]] = []
    async with (
        serve_asgi(_gate_app(seen, minted, token)) as url,
        RunnerClient(url, token=token, auth=minted.auth()) as client,
    ):
        app = AppRunnerClient.over(client, session_id=SESSION)
        upgrade = await app.websocket_upgrade(
            8000, "hmr", query="t=1", extra_headers={"X-Forwarded-Prefix": "/preview/x/"}
        )
        assert upgrade.url.startswith("ws://127.0.0.1:")
        assert token not in repr(upgrade)
        async with connect(upgrade.url, additional_headers=upgrade.headers) as socket:
            await socket.send("ping")
            assert await socket.recv() == "echo:ping"
    (headers,) = seen
    assert headers["path"] == "/v1/session/ports/8000/hmr"
    assert headers["query"] == "t=1"
    assert headers[PROXY_HEADER.lower()] in minted.tokens
    assert headers["x-aws-proxy-port"] == str(PROXY_PORT)
    assert headers["x-runtime-session-id"] == SESSION
    assert headers["x-forwarded-prefix"] == "/preview/x/"


async def test_an_injected_transport_refuses_websocket_upgrades(runner: RunnerProcess) -> None:
    """A WebSocket cannot travel through an httpx transport: refused, never sent around it."""
    minted = Minted()
    async with RunnerClient(
        GATE_URL, token=runner.token, transport=GateTransport(runner, minted), auth=minted.auth()
    ) as client:
        app = AppRunnerClient.over(client, session_id=SESSION)
        with pytest.raises(RunnerRequestError, match="transport"):
            await app.websocket_upgrade(8000, "", query="")


async def test_without_injections_the_plain_headers_are_the_runners_own(
    runner: RunnerProcess,
) -> None:
    async with RunnerClient(runner.url, token=runner.token) as client:
        app = AppRunnerClient.over(client, session_id=SESSION)
        upgrade = await app.websocket_upgrade(8000, "a%2Fb", query="x=1")
    headers = upgrade.headers
    assert headers["authorization"] == f"Bearer {runner.token}"
    assert headers["x-runtime-session-id"] == SESSION
    assert {"host", "connection", "user-agent"}.isdisjoint(headers)
    assert upgrade.url == f"ws://127.0.0.1:{runner.port}/v1/session/ports/8000/a%2Fb?x=1"


async def test_closing_an_app_client_leaves_the_handles_client_open(runner: RunnerProcess) -> None:
    """The handle owns its RunnerClient: retiring the app client (a recovery does) does not
    close it; once either is closed, app calls fail as unavailable, not with httpx's error."""
    handle = SandboxHandle(
        sandbox_id="plain",
        provider="local",
        runner=RunnerClient(runner.url, token=runner.token),
        session_id=SESSION,
    )
    app = AppRunnerClient.for_handle(handle)
    await app.close()
    await app.close()
    assert app.is_closed
    assert not handle.runner.is_closed
    assert (await handle.runner.health()).status == "ok"
    with pytest.raises(SandboxUnavailableError, match="closed"):
        await app.processes()

    fresh = AppRunnerClient.for_handle(handle)
    await handle.close()
    assert fresh.is_closed
    with pytest.raises(SandboxUnavailableError, match="closed"):
        await fresh.runtime_errors()


async def test_an_app_client_built_from_a_url_owns_and_closes_its_runner_client(
    runner: RunnerProcess,
) -> None:
    app = AppRunnerClient(runner.url, token=runner.token, session_id=SESSION)
    assert isinstance((await app.processes()), list)
    await app.close()
    assert app.is_closed
    with pytest.raises(SandboxUnavailableError, match="closed"):
        await app.processes()
