"""A real failure answered by LibreChat's API: a runner SIGKILLed mid-run is a 503 whose
body says what failed and names no runner route, address or path, both as LibreChat's
own client reports it (``@librechat/agents``) and as the body its server would read."""

from __future__ import annotations

import threading
import uuid
from typing import Any

from tests.fixtures.killed_runner import (
    assert_no_internal_detail,
    job,
    kill_when_running,
    new_marker,
)

from .conftest import KEY_A, Driver, Serve


def _killed_mid_run(serve: Serve, run: Any) -> Any:
    """``run(marker)`` in a thread while this one kills the job's runner; its answer."""
    marker = new_marker()
    answer: list[Any] = []
    thread = threading.Thread(target=lambda: answer.append(run(marker)))
    thread.start()
    try:
        kill_when_running(marker, serve.home.parent / "sandboxes", spare=serve.process.pid)
    finally:
        thread.join(timeout=300)
    assert answer, "the run never answered"
    return answer[0]


def test_the_client_reports_a_killed_runner_without_internal_detail(
    serve: Serve, driver: Driver
) -> None:
    """``execute_code`` on a runner killed mid-run fails as "temporarily unavailable" (a
    5xx the client words itself; the body it would otherwise show is the next test's)."""
    params = {"baseUrl": serve.base, "authHeaders": {"X-API-Key": KEY_A}}
    answer = _killed_mid_run(
        serve,
        lambda marker: driver.invoke(
            params=params, args={"lang": "py", "code": job(marker), "timeout": 600_000}
        ),
    )
    assert not answer["ok"], answer
    assert "temporarily unavailable" in answer["error"], answer
    assert_no_internal_detail(str(answer["error"]), runtime_dir=serve.home.parent)


def test_the_exec_body_says_what_failed_not_where(serve: Serve) -> None:
    """``POST /exec`` in a runtime session: 503 ``busy``, the sandbox named as what failed."""
    hint = f"h-{uuid.uuid4().hex[:8]}"

    def run(marker: str) -> Any:
        with serve.client() as client:
            body = {
                "lang": "py",
                "code": job(marker),
                "timeout": 600_000,
                "runtime_session_hint": hint,
            }
            return client.post("/exec", json=body, timeout=300)

    response = _killed_mid_run(serve, run)
    assert response.status_code == 503, response.text
    assert response.json()["error"] == "busy"
    assert "sandbox" in response.json()["message"]
    assert_no_internal_detail(response.text, runtime_dir=serve.home.parent)
