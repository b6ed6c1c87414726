"""The two translation tables are total, and each answer becomes the documented error."""

from __future__ import annotations

import httpx
import pytest

from sandcell_orchestrator import errors
from sandcell_orchestrator.runner.errors import (
    ERROR_CODE_MAP,
    TRANSPORT_ERROR_MAP,
    Redactor,
    error_from_response,
    transport_error_class,
)
from sandcell_protocol import ERROR_SEMANTICS, ErrorCode, encode, error_body

EXPECTED: dict[ErrorCode, type[errors.SandcellError]] = {
    ErrorCode.BAD_REQUEST: errors.RunnerRequestError,
    ErrorCode.UNAUTHORIZED: errors.RunnerRequestError,
    ErrorCode.NOT_FOUND: errors.RunnerRequestError,
    ErrorCode.METHOD_NOT_ALLOWED: errors.RunnerRequestError,
    ErrorCode.PAYLOAD_TOO_LARGE: errors.RunnerRequestError,
    ErrorCode.UNSUPPORTED_LANGUAGE: errors.RunnerRequestError,
    ErrorCode.INVALID_PATH: errors.RunnerRequestError,
    ErrorCode.SESSION_CONFLICT: errors.SessionConflictError,
    ErrorCode.SESSION_BUSY: errors.SessionBusyError,
    ErrorCode.SESSION_REQUIRED: errors.SessionRequiredError,
    ErrorCode.QUARANTINED: errors.SandboxUnavailableError,
    ErrorCode.INPUT_MISSING: errors.InputMissingError,
    ErrorCode.ARCHIVE_REJECTED: errors.ArchiveRejectedError,
    ErrorCode.PROTOCOL_MISMATCH: errors.ProtocolMismatchError,
    ErrorCode.BUSY: errors.SandboxUnavailableError,
    ErrorCode.CONTEXT_LOST: errors.ContextLostError,
    ErrorCode.APP_NOT_RESPONDING: errors.RunnerRequestError,
    ErrorCode.IDEMPOTENCY_KEY_REUSED: errors.RunnerRequestError,
    ErrorCode.IDEMPOTENCY_IN_FLIGHT: errors.RunnerRequestError,
    ErrorCode.INTERNAL: errors.RunnerRequestError,
}


def _all_subclasses(cls: type) -> set[type]:
    found = set()
    for sub in cls.__subclasses__():
        found |= {sub, *_all_subclasses(sub)}
    return found


def test_every_error_code_maps_to_exactly_one_orchestrator_error() -> None:
    """The ErrorCode map is total (no code missing, none extra) and matches the contract."""
    assert set(ERROR_CODE_MAP) == set(ErrorCode)
    assert dict(ERROR_CODE_MAP) == EXPECTED
    for error_cls in ERROR_CODE_MAP.values():
        assert issubclass(error_cls, errors.SandcellError)


@pytest.mark.parametrize("code", list(ErrorCode))
def test_each_code_becomes_its_error_with_route_status_and_message(code: ErrorCode) -> None:
    """The exception names the route, the status, the code and the runner's message only."""
    status = ERROR_SEMANTICS[code].http_status
    body = encode(error_body(code, "the runner's words"))
    exc = error_from_response(
        method="POST", route="/v1/execute", status=status, body=body, redact=Redactor()
    )
    assert type(exc) is EXPECTED[code]
    assert str(exc) == f"POST /v1/execute: HTTP {status} {code.value}: the runner's words"
    if isinstance(exc, errors.RunnerRequestError):
        assert exc.code == code.value
        assert exc.retryable is ERROR_SEMANTICS[code].retryable


def test_retryable_errors_stay_retryable() -> None:
    """Codes the wire marks retryable become errors callers know to retry."""
    for code, semantics in ERROR_SEMANTICS.items():
        body = encode(error_body(code, "x"))
        exc = error_from_response(
            method="GET", route="/r", status=semantics.http_status, body=body, redact=Redactor()
        )
        assert exc.retryable is semantics.retryable, code


@pytest.mark.parametrize(
    "body",
    [b"<html>502 Bad Gateway</html>", b"", b'{"detail": "nope"}', b"\xff\xfe"],
)
def test_a_body_that_is_not_an_error_body_means_unavailable(body: bytes) -> None:
    """Something other than a runner answered (a proxy page, a truncated answer)."""
    exc = error_from_response(method="GET", route="/v1/x", status=502, body=body, redact=Redactor())
    assert type(exc) is errors.SandboxUnavailableError
    assert "HTTP 502" in str(exc)


@pytest.mark.parametrize(
    ("status", "expected"),
    [(400, errors.RunnerRequestError), (503, errors.SandboxUnavailableError)],
)
def test_an_unknown_code_from_a_newer_minor_is_refusal_or_unavailability(
    status: int, expected: type[errors.SandcellError]
) -> None:
    """A code this side does not know still yields a typed error, chosen by status class."""
    body = b'{"error": {"code": "brand_new", "message": "m", "retryable": false}}'
    exc = error_from_response(method="GET", route="/r", status=status, body=body, redact=Redactor())
    assert type(exc) is expected
    assert "brand_new" in str(exc)


def test_transport_map_is_total_over_httpx_request_errors() -> None:
    """Every httpx RequestError class has an explicit entry or a mapped ancestor below
    RequestError itself, so no transport failure falls through untranslated."""
    for cls in _all_subclasses(httpx.RequestError):
        nearest = next(
            c for c in cls.__mro__ if c in TRANSPORT_ERROR_MAP or c is httpx.RequestError
        )
        assert nearest is not httpx.RequestError, cls
        assert issubclass(TRANSPORT_ERROR_MAP[nearest], errors.SandboxError)


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (httpx.ReadTimeout("t"), errors.SandboxTimeoutError),
        (httpx.ConnectTimeout("t"), errors.SandboxUnavailableError),
        (httpx.WriteTimeout("t"), errors.SandboxUnavailableError),
        (httpx.PoolTimeout("t"), errors.SandboxUnavailableError),
        (httpx.ConnectError("c"), errors.SandboxUnavailableError),
        (httpx.ReadError("r"), errors.SandboxUnavailableError),
        (httpx.RemoteProtocolError("p"), errors.SandboxUnavailableError),
        (httpx.LocalProtocolError("p"), errors.SandboxError),
        (httpx.DecodingError("d"), errors.SandboxUnavailableError),
    ],
)
def test_transport_failures_map_as_documented(
    exc: httpx.RequestError, expected: type[errors.SandboxError]
) -> None:
    """A read timeout is a timeout (the job may still run); the rest mean unreachable."""
    assert transport_error_class(exc) is expected


def test_redactor_scrubs_known_secrets_longest_first() -> None:
    """Both 'Scheme value' and the bare value are scrubbed; short values are ignored."""
    redact = Redactor(["Bearer s3cr3t-token"])
    redact.learn(httpx.Headers({"X-aws-proxy-auth": "proxy-value-42", "X-Other": "visible"}))
    text = "a Bearer s3cr3t-token b s3cr3t-token c proxy-value-42 d visible"
    assert redact(text) == "a [redacted] b [redacted] c [redacted] d visible"
    assert "s3cr3t" not in repr(redact)
    Redactor(["ab"])  # too short to be a credential: ignored, not an error
    assert Redactor(["ab"])("ab cd") == "ab cd"


def test_redactor_scrubs_a_secret_that_reaches_a_message_escaped() -> None:
    """repr() turns CR LF into four characters; each piece of the value is still scrubbed."""
    secret = "first-half-secret\r\nsecond-half-secret"
    assert "secret" not in Redactor([secret])(repr(secret.encode())).replace("[redacted]", "")
