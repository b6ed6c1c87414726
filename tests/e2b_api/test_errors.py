"""The E2B surface's error table is total: every orchestrator error becomes an E2B answer
(an HTTP status with ``{code, message, error_code}``, or a Connect code) without leaking
what an unexpected exception says."""

from __future__ import annotations

import json

import pytest
from connectrpc.code import Code

from sandcell_orchestrator import errors as oe
from sandcell_orchestrator.e2b.errors import E2bError, connect_error, e2b_error_response

SECRET = "token-SECRET-value"

SAMPLES: list[BaseException] = [
    E2bError(404, "not_found", "sandbox x not found"),
    E2bError(429, "busy", "too many"),
    oe.RunnerRequestError("nope", code="not_found"),
    oe.RunnerRequestError("bad path", code="invalid_path"),
    oe.RunnerRequestError("odd", code="internal"),
    oe.SandboxUnavailableError("down"),
    oe.SandboxTimeoutError("slow"),
    oe.SandboxNotFoundError("gone"),
    oe.SessionBusyError("busy"),
    oe.CheckpointError("lost"),
    oe.ConfigError("config"),
    RuntimeError(SECRET),
]


@pytest.mark.parametrize("exc", SAMPLES, ids=lambda e: type(e).__name__)
def test_every_error_has_an_e2b_answer(exc: BaseException) -> None:
    response = e2b_error_response(exc)
    body = json.loads(bytes(response.body))
    assert set(body) == {"code", "message", "error_code"}
    assert body["code"] == response.status_code
    assert 400 <= response.status_code < 600
    assert SECRET not in response.body.decode()

    mapped = connect_error(exc)
    assert isinstance(mapped.code, Code)
    assert SECRET not in mapped.message


def test_caller_mistakes_are_4xx_and_faults_5xx() -> None:
    assert e2b_error_response(E2bError(400, "bad_request", "x")).status_code == 400
    assert e2b_error_response(RuntimeError("boom")).status_code == 500
    assert connect_error(oe.RunnerRequestError("x", code="not_found")).code is Code.NOT_FOUND
    assert connect_error(oe.SandboxUnavailableError("x")).code is Code.UNAVAILABLE


@pytest.mark.parametrize(
    "exc",
    [
        oe.RunnerRequestError(
            "GET /v1/session/files/x: HTTP 400 invalid_path: bad", code="invalid_path"
        ),
        oe.RunnerRequestError("GET /v1/session/files/x: HTTP 404 not_found", code="not_found"),
        oe.SandboxUnavailableError("GET /v1/session/files/x: ConnectError: 127.0.0.1:4123"),
        oe.SessionBusyError("session rt_x is held by another worker at 127.0.0.1:4123"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_no_answer_names_the_runner_route_or_address(exc: BaseException) -> None:
    """Both the control plane's body and envd's Connect error say what failed, not where."""
    for text in (e2b_error_response(exc).body.decode(), connect_error(exc).message):
        assert "/v1/session" not in text
        assert "127.0.0.1" not in text
