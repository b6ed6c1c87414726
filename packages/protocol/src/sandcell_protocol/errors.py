"""Errors of the wire contract, and the machine-readable codes peers exchange.

SandcellProtocolError
├── ProtocolError           a value failed to encode/decode/validate
└── ProtocolMismatchError   peers speak incompatible protocol majors
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class SandcellProtocolError(Exception):
    """Base class of every error raised by ``sandcell_protocol``."""


class ProtocolError(SandcellProtocolError, ValueError):
    """A wire value is invalid; the message names the offending field."""


class ProtocolMismatchError(SandcellProtocolError):
    """The peer's protocol major differs from ours."""

    def __init__(self, *, ours: str, theirs: str) -> None:
        super().__init__(
            f"protocol mismatch: this side speaks {ours}, the peer speaks {theirs}"
            " (majors must match)"
        )
        self.ours = ours
        self.theirs = theirs


class ErrorCode(enum.StrEnum):
    """Machine-readable error codes carried in ``ErrorBody.error.code``."""

    BAD_REQUEST = "bad_request"
    UNAUTHORIZED = "unauthorized"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    """The route exists but not with this method; ``Allow`` lists those it takes."""
    PAYLOAD_TOO_LARGE = "payload_too_large"
    UNSUPPORTED_LANGUAGE = "unsupported_language"
    INVALID_PATH = "invalid_path"
    SESSION_CONFLICT = "session_conflict"
    SESSION_BUSY = "session_busy"
    SESSION_REQUIRED = "session_required"
    QUARANTINED = "quarantined"
    INPUT_MISSING = "input_missing"
    ARCHIVE_REJECTED = "archive_rejected"
    PROTOCOL_MISMATCH = "protocol_mismatch"
    BUSY = "busy"
    CONTEXT_LOST = "context_lost"
    """The context's interpreter is gone (killed, crashed, or not restored); restart it."""
    APP_NOT_RESPONDING = "app_not_responding"
    """An app preview's server did not answer (not started, crashed, or too slow)."""
    IDEMPOTENCY_KEY_REUSED = "idempotency_key_reused"
    """An ``Idempotency-Key`` already named a request with another body."""
    IDEMPOTENCY_IN_FLIGHT = "idempotency_in_flight"
    """The first request with this ``Idempotency-Key`` is still running; retry later."""
    INTERNAL = "internal"


@dataclass(frozen=True, slots=True)
class ErrorSemantics:
    """How a code travels: its HTTP status and whether retrying may succeed."""

    http_status: int
    retryable: bool


ERROR_SEMANTICS: dict[ErrorCode, ErrorSemantics] = {
    ErrorCode.BAD_REQUEST: ErrorSemantics(400, retryable=False),
    ErrorCode.UNAUTHORIZED: ErrorSemantics(401, retryable=False),
    ErrorCode.NOT_FOUND: ErrorSemantics(404, retryable=False),
    ErrorCode.METHOD_NOT_ALLOWED: ErrorSemantics(405, retryable=False),
    ErrorCode.PAYLOAD_TOO_LARGE: ErrorSemantics(413, retryable=False),
    ErrorCode.UNSUPPORTED_LANGUAGE: ErrorSemantics(400, retryable=False),
    ErrorCode.INVALID_PATH: ErrorSemantics(400, retryable=False),
    ErrorCode.SESSION_CONFLICT: ErrorSemantics(409, retryable=False),
    ErrorCode.SESSION_BUSY: ErrorSemantics(409, retryable=True),
    ErrorCode.SESSION_REQUIRED: ErrorSemantics(400, retryable=False),
    # The runner itself cannot recover; the caller retries on a recycled sandbox.
    ErrorCode.QUARANTINED: ErrorSemantics(503, retryable=True),
    ErrorCode.INPUT_MISSING: ErrorSemantics(400, retryable=False),
    ErrorCode.ARCHIVE_REJECTED: ErrorSemantics(400, retryable=False),
    ErrorCode.PROTOCOL_MISMATCH: ErrorSemantics(400, retryable=False),
    ErrorCode.BUSY: ErrorSemantics(503, retryable=True),
    ErrorCode.CONTEXT_LOST: ErrorSemantics(409, retryable=False),
    # The sandbox is fine; the app in it is not (yet) serving: fix or start it.
    ErrorCode.APP_NOT_RESPONDING: ErrorSemantics(502, retryable=True),
    ErrorCode.IDEMPOTENCY_KEY_REUSED: ErrorSemantics(422, retryable=False),
    ErrorCode.IDEMPOTENCY_IN_FLIGHT: ErrorSemantics(409, retryable=True),
    ErrorCode.INTERNAL: ErrorSemantics(500, retryable=False),
}
