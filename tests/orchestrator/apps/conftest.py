"""Fixtures for the app-instance API: the real serve app, real local runners, a browser.

``start_api(**env)`` starts ``sandcell serve``'s Starlette app (with the app
routes installed) under uvicorn on a free port, over ``open_services`` with the
local provider, so every instance is a real runner with a real jail. A webhook
receiver and headless Chromium (Debian's, driven by Playwright) are at hand.
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from sandcell_orchestrator.apps import AppService, install_app_routes
from sandcell_orchestrator.apps.settings import SHIPPED_TEMPLATES_DIR
from sandcell_orchestrator.bootstrap import open_services
from sandcell_orchestrator.config import OrchestratorSettings
from sandcell_orchestrator.serve.app import create_app
from sandcell_orchestrator.testing import clean_environ, sandbox_processes
from tests.fixtures.paths import traversable_dir
from tests.fixtures.runner_process import free_port

from .fake_runner import Preview, fake_preview
from .http_server import serve_asgi
from .receiver import Receiver

KEY_A = "apps-key-a-0123456789abcdef"
KEY_B = "apps-key-b-0123456789abcdef"
WEBHOOK_SECRET = "apps-webhook-SECRET-0123456789"
GIT_AUTHOR = "App Builder <builder@example.com>"
CHROMIUM = os.environ.get("SANDCELL_TEST_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture
def runtime_dir() -> Iterator[Path]:
    """Runner roots; whatever a failed test left running there is killed (only ours)."""
    with traversable_dir("apps-") as base:
        path = base / "sandboxes"
        yield path
        leftovers = sandbox_processes(path)
        for process in leftovers:
            with contextlib.suppress(psutil.Error):
                process.send_signal(signal.SIGKILL)
        psutil.wait_procs(leftovers, timeout=10)
        assert not leftovers, f"sandbox processes left behind: {leftovers}"


@dataclass
class AppApi:
    """A running service: an authenticated client, the app service, a webhook receiver."""

    url: str
    client: httpx.AsyncClient
    apps: AppService
    receiver: Receiver
    receiver_url: str
    runtime_dir: Path

    def auth(self, key: str = KEY_A) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"}

    async def create(self, template: str = "python-web", **body: Any) -> dict[str, Any]:
        payload = {"template": template, "project_name": "demo", **body}
        response = await self.client.post("/v1/instances", json=payload, headers=self.auth())
        assert response.status_code == 201, response.text
        created: dict[str, Any] = response.json()
        return created

    async def write(
        self, instance_id: str, files: dict[str, str], *, message: str | None = None
    ) -> httpx.Response:
        body: dict[str, Any] = {
            "files": [{"path": path, "content": content} for path, content in files.items()]
        }
        if message is not None:
            body["commit_message"] = message
        return await self.client.post(
            f"/v1/instances/{instance_id}/files", json=body, headers=self.auth()
        )

    async def run(self, instance_id: str, *commands: str, **extra: Any) -> httpx.Response:
        return await self.client.post(
            f"/v1/instances/{instance_id}/commands",
            json={"commands": list(commands), **extra},
            headers=self.auth(),
        )

    async def get(self, path: str, **params: Any) -> httpx.Response:
        return await self.client.get(path, params=params, headers=self.auth())


StartApi = Callable[..., Awaitable[AppApi]]


@pytest.fixture
async def start_api(tmp_path: Path, runtime_dir: Path) -> AsyncIterator[StartApi]:
    """Start the service; ``env`` overrides (e.g. shortened intervals) apply to its settings."""
    async with contextlib.AsyncExitStack() as stack:

        async def start(*, templates: dict[str, str] | None = None, **env: str) -> AppApi:
            """``templates``: sources configured beside the shipped two."""
            # The webhook receiver listens on loopback, which is refused unless allowed.
            env.setdefault("SANDCELL_APP_WEBHOOK_ALLOW_NETS", "127.0.0.1/32")
            receiver = Receiver()
            receiver_url = await stack.enter_async_context(serve_asgi(receiver.app()))
            port = free_port()
            sources = {
                name: str(SHIPPED_TEMPLATES_DIR / name) for name in ("python-web", "static-site")
            }
            sources.update(templates or {})
            configured = ",".join(f"{name}={source}" for name, source in sources.items())
            settings = OrchestratorSettings.from_env(
                clean_environ(
                    SANDCELL_HOME=str(tmp_path / "home"),
                    SANDCELL_LOCAL_RUNTIME_DIR=str(runtime_dir),
                    SANDCELL_API_KEYS=f"{KEY_A}=tenant-a,{KEY_B}=tenant-b",
                    SANDCELL_PUBLIC_URL=f"http://127.0.0.1:{port}",
                    SANDCELL_TEMPLATES=configured,
                    SANDCELL_APP_WEBHOOK_SECRET=WEBHOOK_SECRET,
                    SANDCELL_APP_GIT_AUTHOR=GIT_AUTHOR,
                    SANDCELL_APP_ERROR_POLL_S="0.5",
                    **env,
                )
            )
            services = await stack.enter_async_context(open_services(settings))
            app = create_app(settings, services=services)
            if not hasattr(app.state, "apps"):
                # Until create_app installs the app routes itself.
                from sandcell_orchestrator.serve.auth import load_api_keys

                install_app_routes(
                    app,
                    settings,
                    services=lambda: services,
                    namespace_of=load_api_keys(settings).namespace,
                )
            url = await stack.enter_async_context(serve_asgi(app, lifespan="on", port=port))
            client = await stack.enter_async_context(
                httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(180, connect=5))
            )
            return AppApi(url, client, app.state.apps, receiver, receiver_url, runtime_dir)

        yield start


@pytest.fixture
async def browser() -> AsyncIterator[Any]:
    """A headless Chromium context (Debian's binary, a fresh profile)."""
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: scripts/test installs it (ensure_browser)")
    from playwright.async_api import async_playwright

    with tempfile.TemporaryDirectory(prefix="sandcell-chromium-") as profile:
        async with async_playwright() as playwright:
            context = await playwright.chromium.launch_persistent_context(
                profile, executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS
            )
            try:
                yield context
            finally:
                await context.close()


@pytest.fixture
async def preview() -> AsyncIterator[Preview]:
    """A fake runner behind a real preview proxy, with one instance registered."""
    async with fake_preview() as running:
        yield running
