"""Errors as LibreChat's client reads them: the status decides, the body explains.

The client maps 401/403 to "not authorized", 400/422 to "rejected", 429 with
``{"error": "rate_limited", "retry_after_seconds"}`` to a rate limit, and any
other status to "temporarily unavailable"; so 5xx is kept for real faults. The
status comes from the service's one mapping (``serve.errors.map_error``), with
this API's own cases first; the body is ``{"error": <code>, "message": ...}``.
"""

from __future__ import annotations

import msgspec
from starlette.responses import Response

from sandcell_protocol import ErrorCode

from ..errors import (
    JSON_MEDIA_TYPE,
    MAX_BODY_BYTES,
    Endpoint,
    PayloadTooLargeError,
    answered,
    map_error,
)
from .limits import RateLimitedError

__all__ = [
    "ExecutionTimeoutError",
    "FileNotVisibleError",
    "librechat_guarded",
    "librechat_json",
]


class ExecutionTimeoutError(Exception):
    """The run passed its time limit: answered 504 ``execution_timeout``."""


class FileNotVisibleError(Exception):
    """Answered 404 ``not_found``: absent, another tenant's, or another user's, alike."""


def librechat_json(status: int, body: dict[str, object]) -> Response:
    return Response(msgspec.json.encode(body), status_code=status, media_type=JSON_MEDIA_TYPE)


def _answer(exc: BaseException) -> Response:
    if isinstance(exc, RateLimitedError):
        return librechat_json(
            429,
            {
                "error": "rate_limited",
                "message": str(exc),
                "retry_after_seconds": exc.retry_after_s,
            },
        )
    if isinstance(exc, ExecutionTimeoutError):
        return librechat_json(504, {"error": "execution_timeout", "message": str(exc)})
    if isinstance(exc, FileNotVisibleError):
        return librechat_json(404, {"error": "not_found", "message": "file not found"})
    if isinstance(exc, PayloadTooLargeError):
        # Never an empty message: the caller's log is where its operator finds the cause.
        message = str(exc) or f"the request body is larger than {MAX_BODY_BYTES} bytes"
        return librechat_json(413, {"error": "payload_too_large", "message": message})
    status, body = map_error(exc)
    code = body.error.code
    if status == 504:
        return librechat_json(504, {"error": "execution_timeout", "message": body.error.message})
    if code == ErrorCode.UNSUPPORTED_LANGUAGE:
        return librechat_json(400, {"error": code, "message": "Unsupported language"})
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    response = librechat_json(status, {"error": str(code), "message": body.error.message})
    if headers:
        response.headers.update(headers)
    return response


def librechat_guarded(endpoint: Endpoint) -> Endpoint:
    """Answer every exception ``endpoint`` raises through ``_answer``."""
    return answered(endpoint, _answer)
