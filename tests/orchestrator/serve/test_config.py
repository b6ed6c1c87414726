"""``sandcell serve``'s start-up rules and its error mapping (no server needed)."""

from __future__ import annotations

import inspect

import pytest

from sandcell_orchestrator import errors
from sandcell_orchestrator.config import OrchestratorSettings
from sandcell_orchestrator.errors import ConfigError, RunnerRequestError, SandcellError
from sandcell_orchestrator.serve.app import create_app, map_error
from sandcell_protocol import ERROR_SEMANTICS, ErrorCode, ProtocolError


def settings(**env: str) -> OrchestratorSettings:
    return OrchestratorSettings.from_env({"SANDCELL_HOME": "/nonexistent/sandcell", **env})


def test_refuses_to_start_without_api_keys() -> None:
    with pytest.raises(ConfigError, match="SANDCELL_API_KEYS"):
        create_app(settings())


def test_insecure_mode_is_explicit_and_never_in_production() -> None:
    create_app(settings(SANDCELL_SERVE_INSECURE_NO_AUTH="1"))
    with pytest.raises(ConfigError, match="production"):
        create_app(settings(SANDCELL_SERVE_INSECURE_NO_AUTH="1", SANDCELL_ENV="production"))


def all_sandcell_errors() -> list[type[SandcellError]]:
    return [
        cls
        for _, cls in inspect.getmembers(errors, inspect.isclass)
        if issubclass(cls, SandcellError)
    ]


def instance(cls: type[SandcellError]) -> SandcellError:
    if cls is RunnerRequestError:
        return cls("refused", code="bad_request")
    if cls is errors.SandboxCommandError:
        return cls("failed", exit_code=1, stdout="", stderr="")
    return cls("it failed")


@pytest.mark.parametrize("cls", all_sandcell_errors(), ids=lambda cls: cls.__name__)
def test_every_orchestrator_error_maps_to_an_error_body(cls: type[SandcellError]) -> None:
    """The map is total: each error gets a status, a protocol code, and honest retryability."""
    status, body = map_error(instance(cls))
    assert 400 <= status < 600
    assert isinstance(body.error.code, ErrorCode)
    if cls.retryable:
        assert body.error.retryable, cls


INTERNAL = "POST /v1/execute: ConnectError: runner at http://127.0.0.1:41234 refused"


def internal(cls: type[SandcellError]) -> SandcellError:
    """``cls`` with a message as a runner boundary writes it: route and address."""
    if cls is RunnerRequestError:
        return cls(INTERNAL, code="invalid_path", public_detail="'../x' escapes")
    if cls is errors.SandboxCommandError:
        return cls(INTERNAL, exit_code=1, stdout="", stderr="")
    return cls(INTERNAL)


@pytest.mark.parametrize("cls", all_sandcell_errors(), ids=lambda cls: cls.__name__)
def test_no_answer_names_a_runner_route_or_address(cls: type[SandcellError]) -> None:
    """An error's own message is for the log: the answer says what failed, in words of its
    own, and keeps only a public detail (a refused request's), never the route or address."""
    _, body = map_error(internal(cls))
    assert "/v1/execute" not in body.error.message
    assert "127.0.0.1" not in body.error.message
    assert body.error.message
    if cls is RunnerRequestError:
        assert body.error.message.endswith("'../x' escapes"), body.error.message


def test_a_missing_inputs_public_detail_names_it() -> None:
    missing = errors.InputMissingError("PUT /v1/inputs: gone", public_detail="input f1 not found")
    assert map_error(missing)[1].error.message.endswith(": input f1 not found")


@pytest.mark.parametrize(
    ("exc", "status", "code", "retryable"),
    [
        (errors.SessionRequiredError("x"), 400, ErrorCode.SESSION_REQUIRED, False),
        (errors.SessionBusyError("x"), 409, ErrorCode.SESSION_BUSY, True),
        (errors.SandboxUnavailableError("x"), 503, ErrorCode.BUSY, True),
        (errors.AnswerTooLargeError("x", cap=1), 503, ErrorCode.BUSY, True),
        (errors.AnswerCeilingError("x", cap=1), 413, ErrorCode.PAYLOAD_TOO_LARGE, False),
        (errors.LockLostError("x"), 503, ErrorCode.BUSY, True),
        (errors.RegistryError("x"), 503, ErrorCode.BUSY, True),
        (errors.InputMissingError("x"), 400, ErrorCode.INPUT_MISSING, False),
        (errors.ProtocolMismatchError("x"), 502, ErrorCode.PROTOCOL_MISMATCH, False),
        (RunnerRequestError("x", code="invalid_path"), 400, ErrorCode.INVALID_PATH, False),
        (RunnerRequestError("x", code="unauthorized"), 500, ErrorCode.INTERNAL, False),
        (RunnerRequestError("x", code="not-a-code"), 500, ErrorCode.INTERNAL, False),
        (ProtocolError("ExecCall: bad"), 400, ErrorCode.BAD_REQUEST, False),
        (errors.CheckpointError("x"), 500, ErrorCode.INTERNAL, False),
    ],
)
def test_error_mapping(exc: Exception, status: int, code: ErrorCode, retryable: bool) -> None:
    got_status, body = map_error(exc)
    assert (got_status, body.error.code, body.error.retryable) == (status, code, retryable)


def test_unexpected_errors_say_nothing() -> None:
    """An unknown exception's text may hold anything: the answer is a bare 500."""
    status, body = map_error(RuntimeError("password=hunter2 at redis://x"))
    assert (status, body.error.code, body.error.message) == (
        500,
        ErrorCode.INTERNAL,
        "internal error",
    )
    assert ERROR_SEMANTICS[ErrorCode.INTERNAL].http_status == status
