"""A fake runner (its ports and runtime-error routes) behind a real preview proxy.

For tests of the orchestrator's side alone: ``fake_preview()`` serves the fake
runner and a ``PreviewProxy`` under uvicorn, with one registered ``Instance``.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

from sandcell_orchestrator.apps.client import AppRunnerClient
from sandcell_orchestrator.apps.instance import Instance
from sandcell_orchestrator.apps.instances import AppInstances
from sandcell_orchestrator.apps.preview import PreviewProxy
from sandcell_orchestrator.apps.settings import AppSettings
from sandcell_orchestrator.apps.templates import TemplateRegistry, parse_manifest
from sandcell_orchestrator.handle import SandboxHandle
from sandcell_orchestrator.providers.local import LocalProvider, LocalSettings
from sandcell_orchestrator.registry import InProcessRegistry
from sandcell_orchestrator.runner.client import RunnerClient
from sandcell_orchestrator.sessions.manager import SandboxManager
from sandcell_orchestrator.snapshots import DirectorySnapshotStore
from sandcell_protocol import PROTOCOL_VERSION, Health, encode

from .http_server import serve_asgi

RUNNER_TOKEN = "runner-SECRET-token-0123456789"
PREVIEW_TOKEN = "preview-SECRET-token-abcdefghijklmnop"
SESSION = "rt_" + "a" * 64
INSTANCE = "app_0123456789abcdef01234567"
CALLER_KEY = "caller-api-key-0123456789"
MANIFEST = parse_manifest(b'preview_port = 8000\n[start]\ncommand = "true"\n')


@dataclass
class FakeRunner:
    """The runner's ports routes: records what arrived, echoes it back."""

    seen: list[dict[str, Any]] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)

    def app(self) -> Starlette:
        async def port(request: Request) -> Response:
            raw = request.scope["raw_path"].decode()
            record = {
                "method": request.method,
                "raw_path": raw,
                "query": request.scope["query_string"].decode(),
                "headers": dict(request.headers),
                "body": (await request.body()).decode(),
            }
            self.seen.append(record)
            if raw.endswith("/missing"):
                return Response(b"nope", status_code=404, headers={"set-cookie": "app=1; Path=/"})
            return Response(json.dumps(record), media_type="application/json")

        async def socket(websocket: WebSocket) -> None:
            self.seen.append({"ws_headers": dict(websocket.headers)})
            if websocket.headers.get("authorization") != f"Bearer {RUNNER_TOKEN}":
                await websocket.close(code=1008)
                return
            await websocket.accept()
            async for text in websocket.iter_text():
                await websocket.send_text(f"echo:{text}")

        async def health(_request: Request) -> Response:
            # The client checks the protocol on first contact, as with a real runner.
            found = Health(status="ok", protocol=PROTOCOL_VERSION, runner_version="fake")
            return Response(encode(found), media_type="application/json")

        async def runtime_errors(_request: Request) -> Response:
            return Response(json.dumps({"errors": self.errors}), media_type="application/json")

        path = "/v1/session/ports/{port}/{path:path}"
        return Starlette(
            routes=[
                Route(path, port, methods=["GET", "POST"]),
                WebSocketRoute(path, socket),
                Route("/v1/session/runtime-errors", runtime_errors, methods=["GET"]),
                Route("/health", health, methods=["GET"]),
            ]
        )


@dataclass
class Preview:
    url: str
    runner: FakeRunner
    instances: AppInstances
    instance: Instance
    reports: list[int]
    now: list[float]


@contextlib.asynccontextmanager
async def _empty_manager() -> AsyncIterator[SandboxManager]:
    """A real manager that has no sandbox: the fake instance's sandbox is not its."""
    with tempfile.TemporaryDirectory(prefix="fake-preview-") as root:
        provider = LocalProvider(LocalSettings(runtime_dir=Path(root) / "rt"))
        async with DirectorySnapshotStore(Path(root) / "snapshots") as store:
            yield SandboxManager(provider, InProcessRegistry(), store)
        await provider.close()


@contextlib.asynccontextmanager
async def fake_preview() -> AsyncIterator[Preview]:
    runner = FakeRunner()
    now = [1000.0]
    async with (
        serve_asgi(runner.app()) as runner_url,
        _empty_manager() as manager,
    ):
        instances = AppInstances(
            manager,
            templates=TemplateRegistry({}),
            settings=AppSettings(),
            clock=lambda: now[0],
        )
        handle = SandboxHandle(
            sandbox_id="fake",
            provider="fake",
            runner=RunnerClient(runner_url, token=RUNNER_TOKEN),
            session_id=SESSION,
        )
        instance = Instance(
            instance_id=INSTANCE,
            owner="tenant",
            template="t",
            manifest=MANIFEST,
            project_name="p",
            sandbox_uuid="u",
            handle=handle,
            runner=AppRunnerClient.for_handle(handle),
            last_active=0.0,
            preview_token=PREVIEW_TOKEN,
            env={},
        )
        instances._instances[INSTANCE] = instance
        reports: list[int] = []
        proxy = PreviewProxy(lambda: instances, on_browser_report=lambda: reports.append(1))
        async with serve_asgi(Starlette(routes=proxy.routes())) as url:
            yield Preview(url, runner, instances, instance, reports, now)
        await instance.runner.close()
        await handle.close()
