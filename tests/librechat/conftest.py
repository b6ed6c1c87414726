"""LibreChat's own client against a real ``sandcell serve`` (issue 17).

One ``sandcell serve`` subprocess per module (local provider, real runners), one
node driver process per module that invokes ``@librechat/agents``' tools as
LibreChat's ToolNode does (``driver.cjs``; both pinned versions from
``package-lock.json``, installed by ``scripts/test`` with ``npm ci``). The file
routes LibreChat's server calls are driven with httpx, shaped as its
``crud.js`` sends them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from joserfc.jwk import OKPKey, RSAKey

from sandcell_orchestrator.testing import clean_environ
from tests.fixtures.paths import traversable_dir
from tests.fixtures.runner_process import free_port
from tests.orchestrator.cli.conftest import stop_leftovers

HERE = Path(__file__).resolve().parent
KEY_A = "lc-key-a-0123456789abcdef"
KEY_B = "lc-key-b-0123456789abcdef"
ED_KEY = OKPKey.generate_key("Ed25519")
"""LibreChat's token signing keys, as the test's LibreChat would hold them."""
RSA_KEY = RSAKey.generate_key(2048)


@dataclass
class Serve:
    """A running ``sandcell serve``; ``base`` is what LIBRECHAT_CODE_BASEURL names."""

    url: str
    home: Path
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def base(self) -> str:
        return f"{self.url}/librechat/v1"

    def client(self, key: str | None = KEY_A, **headers: str) -> httpx.Client:
        auth = {"X-API-Key": key} if key else {}
        return httpx.Client(base_url=self.base, headers={**auth, **headers}, timeout=120)

    def upload(
        self,
        files: list[tuple[str, bytes]],
        *,
        key: str = KEY_A,
        user: str = "user-1",
        kind: str | None = "user",
        resource_id: str | None = None,
        read_only: bool = False,
        batch: bool = False,
    ) -> httpx.Response:
        """As LibreChat's server uploads: multipart ``file`` part(s), ``kind``/``id``, User-Id."""
        data: dict[str, str] = {}
        if kind is not None:
            data["kind"] = kind
            data["id"] = resource_id or user
        if read_only:
            data["read_only"] = "true"
        with self.client(key, **{"User-Id": user}) as client:
            return client.post(
                "/upload/batch" if batch else "/upload",
                data=data,
                files=[("file", (name, body)) for name, body in files],
            )


def start_serve(base: Path, env: Mapping[str, str]) -> Serve:
    home = base / "home"
    port = free_port()
    log = base / "serve.log"
    full = clean_environ(
        SANDCELL_HOME=str(home),
        SANDCELL_LOCAL_RUNTIME_DIR=str(base / "sandboxes"),
        SANDCELL_API_KEYS=f"{KEY_A}=tenant-a,{KEY_B}=tenant-b",
        SANDCELL_SERVE_PORT=str(port),
        **env,
    )
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "sandcell_orchestrator", "serve"],
            env=full,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/librechat/v1/health", timeout=2).status_code == 200:
                break
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"sandcell serve did not start:\n{log.read_text()}")
        time.sleep(0.1)
    return Serve(url=url, home=home, process=process, log=log)


def stop_serve(serve: Serve, sandboxes: Path, *, distributed: bool) -> None:
    if serve.process.poll() is None:
        serve.process.send_signal(signal.SIGINT)
        try:
            serve.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(serve.process.pid, signal.SIGKILL)
            serve.process.wait()
    leftovers = stop_leftovers(sandboxes)
    # With a Redis registry sandboxes outlive their process by design (another
    # worker may take the session over); embedded, the process destroys its own.
    assert distributed or not leftovers, f"runner processes left behind: {leftovers}"


@contextlib.contextmanager
def running_serve(prefix: str, **env: str) -> Iterator[Serve]:
    with traversable_dir(prefix) as base:
        serve = start_serve(base, env)
        try:
            yield serve
        finally:
            stop_serve(serve, base / "sandboxes", distributed="SANDCELL_REGISTRY_URL" in env)


@dataclass
class Driver:
    """``driver.cjs``: invokes the client's tools; one request line, one answer line."""

    process: subprocess.Popen[str]
    _next: int = field(default=0)

    def invoke(
        self,
        *,
        version: str = "current",
        tool: str = "code",
        params: Mapping[str, Any] | None = None,
        args: Mapping[str, Any],
        **call: Any,
    ) -> dict[str, Any]:
        self._next += 1
        request = {
            "id": self._next,
            "version": version,
            "tool": tool,
            "params": dict(params or {}),
            "call": {"args": dict(args), **call},
        }
        assert self.process.stdin is not None
        assert self.process.stdout is not None
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        assert line, "the node driver exited"
        answer: dict[str, Any] = json.loads(line)
        assert answer["id"] == self._next
        return answer


@contextlib.contextmanager
def node_driver(serve: Serve) -> Iterator[Driver]:
    if not (HERE / "node_modules" / "agents-current").is_dir():
        raise AssertionError("tests/librechat/node_modules is missing: scripts/test runs npm ci")
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(serve.home.parent),
        # The legacy client reads its base URL (and key) from here when it loads.
        "LIBRECHAT_CODE_BASEURL": serve.base,
        "NODE_NO_WARNINGS": "1",
    }
    process = subprocess.Popen(
        ["node", str(HERE / "driver.cjs")],
        cwd=HERE,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        ready = process.stdout.readline()
        assert json.loads(ready) == {"ready": True}, ready
        yield Driver(process)
    finally:
        if process.stdin is not None:
            process.stdin.close()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()


@pytest.fixture(scope="session")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    """The one serve of this folder's tests (but the two-worker one): API keys for
    tenants a and b, LibreChat tokens from ``ED_KEY``/``RSA_KEY`` for tenant a, and one
    run at a time per tenant (so the rate limit is reachable; the tests run one by one),
    and 8 MiB of one run's outputs kept (so the cap is reachable)."""
    keys = tmp_path_factory.mktemp("jwt-keys")
    ed, rsa = keys / "ed25519.pem", keys / "rsa.jwk.json"
    ed.write_bytes(ED_KEY.as_pem(private=False))
    rsa.write_text(json.dumps(RSA_KEY.as_dict(private=False)))
    with running_serve(
        "lc-",
        SANDCELL_LIBRECHAT_JWT_PUBLIC_KEYS=f"{ed},{rsa}",
        SANDCELL_LIBRECHAT_JWT_NAMESPACE="tenant-a",
        SANDCELL_LIBRECHAT_MAX_CONCURRENT="1",
        SANDCELL_LIBRECHAT_MAX_OUTPUT_BYTES=str(8 << 20),
    ) as running:
        yield running


@pytest.fixture(scope="session")
def driver(serve: Serve) -> Iterator[Driver]:
    with node_driver(serve) as running:
        yield running
