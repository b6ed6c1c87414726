"""The runner's errors. Each carries the protocol ``ErrorCode`` it answers with.

RunnerError
├── BadRequestError          400 bad_request
├── InvalidPathError         400 invalid_path
├── UnsupportedLanguageError 400 unsupported_language
├── PayloadTooLargeError     413 payload_too_large
├── UnauthorizedError        401 unauthorized
├── NotFoundError            404 not_found
├── SessionConflictError     409 session_conflict
├── SessionBusyError         409 session_busy (retryable)
├── QuarantinedError         503 quarantined
├── InputMissingError        400 input_missing
├── ArchiveRejectedError     400 archive_rejected
├── ProtocolMismatchError    400 protocol_mismatch
├── BusyError                503 busy (retryable, Retry-After)
├── ContextLostError         409 context_lost: the context's interpreter is gone
├── JailError                500 internal: nsjail could not run the job
└── ConfigError              start-up: a setting is invalid (names the variable)
"""

from __future__ import annotations

from sandcell_protocol import ERROR_SEMANTICS, ErrorCode


class RunnerError(Exception):
    """Base of the runner's errors; ``code`` decides the HTTP answer."""

    code: ErrorCode = ErrorCode.INTERNAL

    @property
    def http_status(self) -> int:
        return ERROR_SEMANTICS[self.code].http_status

    @property
    def retryable(self) -> bool:
        return ERROR_SEMANTICS[self.code].retryable


class BadRequestError(RunnerError):
    code = ErrorCode.BAD_REQUEST


class InvalidPathError(RunnerError):
    code = ErrorCode.INVALID_PATH


class UnsupportedLanguageError(RunnerError):
    code = ErrorCode.UNSUPPORTED_LANGUAGE


class PayloadTooLargeError(RunnerError):
    code = ErrorCode.PAYLOAD_TOO_LARGE


class UnauthorizedError(RunnerError):
    code = ErrorCode.UNAUTHORIZED


class NotFoundError(RunnerError):
    code = ErrorCode.NOT_FOUND


class SessionConflictError(RunnerError):
    code = ErrorCode.SESSION_CONFLICT


class SessionBusyError(RunnerError):
    code = ErrorCode.SESSION_BUSY


class QuarantinedError(RunnerError):
    code = ErrorCode.QUARANTINED


class InputMissingError(RunnerError):
    code = ErrorCode.INPUT_MISSING


class ArchiveRejectedError(RunnerError):
    code = ErrorCode.ARCHIVE_REJECTED


class ProtocolMismatchError(RunnerError):
    code = ErrorCode.PROTOCOL_MISMATCH


class BusyError(RunnerError):
    code = ErrorCode.BUSY

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class AppNotRespondingError(RunnerError):
    """Nothing answered on an app's preview port: the app, not the sandbox, is down."""

    code = ErrorCode.APP_NOT_RESPONDING


class ContextLostError(RunnerError):
    code = ErrorCode.CONTEXT_LOST


class JailError(RunnerError):
    code = ErrorCode.INTERNAL


class ConfigError(RunnerError):
    """A setting is invalid at start-up; the message names the variable."""
