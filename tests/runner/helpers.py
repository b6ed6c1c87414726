"""Small helpers shared by runner tests."""

from __future__ import annotations

import base64
import json
from typing import Any

import httpx

from tests.fixtures.runner_process import RunnerProcess


def execute(runner: RunnerProcess, *, timeout_s: float = 60, **request: Any) -> dict[str, Any]:
    """POST /v1/execute and return the decoded ExecuteResult (asserting 200)."""
    response = httpx.post(
        runner.url + "/v1/execute", json=request, headers=runner.headers(), timeout=timeout_s
    )
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def execute_raw(runner: RunnerProcess, body: Any, **headers: str) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        runner.url + "/v1/execute",
        content=content,
        headers={**runner.headers(), "Content-Type": "application/json", **headers},
        timeout=60,
    )


def b64(data: bytes | str) -> str:
    raw = data.encode() if isinstance(data, str) else data
    return base64.b64encode(raw).decode()


def unb64(data: str) -> bytes:
    return base64.b64decode(data)


def error_code(response: httpx.Response) -> str:
    code: str = response.json()["error"]["code"]
    return code
