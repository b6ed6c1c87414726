"""A real ``sandcell serve`` for the E2B SDK tests: one subprocess shared by the modules.

The SDKs (PyPI ``e2b``, ``e2b-code-interpreter``, pinned in the dev group) talk to
it exactly as a user would point them at sandcell: ``api_url=…/e2b``,
``sandbox_url=…/e2b/sandbox``, an API key of ``SANDCELL_API_KEYS``. The sync SDK
blocks, so the service runs in its own process, not in the test's event loop.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2b_code_interpreter import Sandbox as CodeSandbox

from sandcell_orchestrator.testing import clean_environ
from tests.fixtures.paths import traversable_dir
from tests.fixtures.runner_process import free_port
from tests.orchestrator.cli.conftest import stop_leftovers

KEY_A = "e2b-key-a-0123456789abcdef"
KEY_B = "e2b-key-b-0123456789abcdef"
MAX_SANDBOXES = 3
"""``SANDCELL_E2B_MAX_SANDBOXES`` of the test service: running sandboxes per tenant."""
DOMAIN = "sandcell.test"
"""``SANDCELL_E2B_DOMAIN`` of the test service: its Host-routed form is served too."""


@dataclass
class E2bServe:
    """A running ``sandcell serve`` and the SDK options that point at it."""

    process: subprocess.Popen[bytes]
    port: int
    home: Path
    runtime_dir: Path
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def opts(self, key: str = KEY_A) -> dict[str, Any]:
        """``ApiParams`` for ``Sandbox.create`` / ``connect`` / ``list``."""
        return {
            "api_key": key,
            "api_url": f"{self.url}/e2b",
            "sandbox_url": f"{self.url}/e2b/sandbox",
        }

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_serve(
    base: Path, *, env: Mapping[str, str] | None = None, runtime_dir: Path | None = None
) -> E2bServe:
    """``python -m sandcell_orchestrator serve`` on a free port; waits for ``/healthz``.

    ``runtime_dir`` (default: under ``base``) is where its local sandboxes live; workers
    of one fleet on one host share it, so each reaches the others' sandboxes."""
    base.mkdir(parents=True, exist_ok=True)
    port = free_port()
    home, log_path = base / "home", base / "serve.log"
    runtime_dir = base / "sandboxes" if runtime_dir is None else runtime_dir
    environ = clean_environ(
        SANDCELL_HOME=str(home),
        SANDCELL_LOCAL_RUNTIME_DIR=str(runtime_dir),
        SANDCELL_API_KEYS=f"{KEY_A}=tenant-a,{KEY_B}=tenant-b",
        SANDCELL_E2B_DOMAIN=DOMAIN,
        SANDCELL_E2B_MAX_SANDBOXES=str(MAX_SANDBOXES),
        **dict(env or {}),
    )
    for name in list(environ):
        if name.startswith("E2B_"):
            del environ[name]
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "sandcell_orchestrator", "serve", "--port", str(port)],
            env=environ,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    served = E2bServe(process, port, home, runtime_dir, log_path)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"sandcell serve exited early:\n{served.log()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{served.url}/healthz", timeout=1).status_code == 200:
                return served
        time.sleep(0.1)
    stop_serve(served)
    raise AssertionError(f"sandcell serve did not start:\n{served.log()[-3000:]}")


def stop_serve(served: E2bServe) -> None:
    """SIGTERM the service's process group (only what we started), then SIGKILL."""
    if served.process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(served.process.pid, signal.SIGTERM)
        try:
            served.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(served.process.pid, signal.SIGKILL)
            served.process.wait(timeout=10)


@pytest.fixture(scope="package")
def e2b_serve() -> Iterator[E2bServe]:
    """One local-provider service for the package's modules (each module's sandboxes
    are gone when the module ends); nothing it launched may outlive it."""
    with traversable_dir("e2b-") as base:
        served = start_serve(base)
        try:
            yield served
        finally:
            stop_serve(served)
            leftovers = stop_leftovers(served.runtime_dir)
            assert not leftovers, f"sandbox processes left behind: {leftovers}"


@pytest.fixture(scope="module")
def sbx(e2b_serve: E2bServe) -> Iterator[CodeSandbox]:
    """One code-interpreter sandbox per test module, killed after it (a module that
    needs another kind, or other options, defines its own ``sbx``)."""
    sandbox = CodeSandbox.create(**e2b_serve.opts())
    try:
        yield sandbox
    finally:
        sandbox.kill()
