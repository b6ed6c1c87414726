"""The MicroVM hook listener starts a real runner with the token from the run payload."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from sandcell_runner.microvm_hook import (
    HookState,
    launch_runner,
    make_handler,
    parse_payload,
    runner_environment,
)
from tests.fixtures.paths import traversable_dir
from tests.fixtures.runner_process import free_port


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"not json", "not JSON"),
        (b'{"sandcell": 2, "runner_token": "' + b"a" * 64 + b'"}', "not a sandcell payload"),
        (b'{"sandcell": 1, "runner_token": "short"}', "64 lowercase hex"),
        (b'{"sandcell": 1}', "64 lowercase hex"),
        (b"[1, 2]", "not a sandcell payload"),
    ],
)
def test_bad_payloads_rejected(body: bytes, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        parse_payload(body)


def test_wrapped_payload_accepted() -> None:
    token = secrets.token_hex(32)
    inner = json.dumps({"sandcell": 1, "runner_token": token})
    assert parse_payload(json.dumps({"runHookPayload": inner}).encode()) == token


@pytest.fixture
def hook() -> Iterator[tuple[str, HookState, int]]:
    with traversable_dir("hook-") as root:
        runner_port = free_port()
        env = {
            "PATH": "/usr/bin:/bin",
            "SANDCELL_RUNNER_PORT": str(runner_port),
            "SANDCELL_WORKSPACE_ROOT": str(root / "workspaces"),
            "SANDCELL_INPUT_CACHE_DIR": str(root / "input-cache"),
            "SANDCELL_RUNNER_SESSIONS": "1",
        }
        state = HookState(lambda token: launch_runner(token, env=env))
        server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(state))
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}", state, runner_port
        finally:
            server.shutdown()
            server.server_close()
            if state.runner is not None:
                state.runner.terminate()
                try:
                    state.runner.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    state.runner.kill()
                    state.runner.wait()


def test_run_hook_starts_runner_with_token(hook: tuple[str, HookState, int]) -> None:
    url, state, runner_port = hook
    assert httpx.get(url + "/ready").status_code == 200
    assert httpx.post(url + "/run", content=b"{}").status_code == 400
    assert state.runner is None
    token = secrets.token_hex(32)
    payload = json.dumps({"sandcell": 1, "runner_token": token}).encode()
    response = httpx.post(url + "/aws/lambda-microvms/runtime/v1/run", content=payload)
    assert response.status_code == 200
    assert token not in response.text
    again = httpx.post(url + "/run", content=payload)
    assert again.json()["message"] == "runner already running"
    assert state.runner is not None
    base = f"http://127.0.0.1:{runner_port}"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/health").status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    ok = httpx.post(
        base + "/v1/execute",
        json={"language": "bash", "code": "echo hooked"},
        headers={"Authorization": f"Bearer {token}"},
    )
    assert ok.json()["stdout"] == "hooked\n"
    # Alone in its VM, the runner's jobs get every vCPU, not the one-core default.
    environ = dict(
        entry.split("=", 1)
        for entry in Path(f"/proc/{state.runner.pid}/environ").read_text().split("\0")
        if "=" in entry
    )
    assert environ["SANDCELL_RUNNER_CPU_MILLICORES"] == str(len(os.sched_getaffinity(0)) * 1000)
    assert token not in "".join(environ.values())
    wrong = httpx.post(
        base + "/v1/execute",
        json={"language": "bash", "code": "echo no"},
        headers={"Authorization": f"Bearer {secrets.token_hex(32)}"},
    )
    assert wrong.status_code == 401
    assert httpx.post(url + "/suspend").status_code == 200


def test_the_images_own_cpu_quota_and_no_token_reach_the_runner() -> None:
    base = {
        "PATH": "/usr/bin:/bin",
        "SANDCELL_RUNNER_CPU_MILLICORES": "1500",
        "SANDCELL_RUNNER_TOKEN": "a" * 64,
        "SANDCELL_RUNNER_TOKEN_FILE": "/run/token",
    }
    env = runner_environment(base)
    assert env == {"PATH": "/usr/bin:/bin", "SANDCELL_RUNNER_CPU_MILLICORES": "1500"}
    assert runner_environment({"PATH": "/bin"})["SANDCELL_RUNNER_CPU_MILLICORES"] == str(
        len(os.sched_getaffinity(0)) * 1000
    )
