"""Credentials never reach an agent's diagnostics from the runner (issue 14, item 9).

A real session-enabled runner: a browser report whose stack names a tokened URL,
and a process that prints a tokened URL and a bearer header. What the runner
answers (runtime errors, logs) carries ``[redacted]`` in their place.
"""

from __future__ import annotations

from tests.runner.apps.helpers import AppClient

SECRET = "s3cr3t-ABCdef0123456789"


def test_a_reported_error_is_kept_redacted(app: AppClient) -> None:
    report = {
        "type": "ReferenceError",
        "message": f"boom while calling /api?access_token={SECRET}",
        "stack": (
            "ReferenceError: boom\n"
            f"    at http://127.0.0.1:8000/preview/app_x/?token={SECRET}:12:5\n"
        ),
    }
    response = app.http.post("/v1/session/runtime-errors", json=report)
    assert response.status_code == 204, response.text
    answer = app.http.get("/v1/session/runtime-errors")
    assert SECRET not in answer.text
    (record,) = [e for e in answer.json()["errors"] if e["type"] == "ReferenceError"]
    assert record["top_frame"].endswith("?token=[redacted]:12:5")
    assert record["message"] == "boom while calling /api?access_token=[redacted]"


def test_log_lines_are_answered_redacted(app: AppClient) -> None:
    command = f"echo 'GET /page?token={SECRET} 200'; echo 'Authorization: Bearer {SECRET}'"
    app.start("talker", command)
    app.wait_exited("talker")
    logs = app.logs("talker", lines=10)
    assert "GET /page?token=[redacted] 200" in logs["lines"]
    assert "Authorization: Bearer [redacted]" in logs["lines"]
    assert not any(SECRET in line for line in logs["lines"])
