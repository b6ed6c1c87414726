"""Errors of ``sandcell serve`` as HTTP: statuses and protocol ``ErrorBody`` answers.

``map_error`` turns any exception (orchestrator errors, protocol errors, an
unauthorized caller, a too-large body) into a status and an ``ErrorBody``;
``guarded`` wraps a route so nothing escapes unmapped (``answered``: the same with
another surface's error table), and ``http_error_response``
answers Starlette's own 404/405s the same way. Unexpected exceptions say
nothing about themselves: their text may hold secrets. Orchestrator errors say
what failed (a stable code and this module's words), never how: their own
message names runner routes and addresses, and goes to the log instead. ``read_body`` and its
limit ``MAX_BODY_BYTES`` live here because the 413 answer names the limit.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.datastructures import FormData
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match, Route

from sandcell_protocol import (
    ERROR_SEMANTICS,
    ErrorBody,
    ErrorCode,
    ProtocolError,
    encode,
    error_body,
)
from sandcell_protocol import ProtocolMismatchError as PeerProtocolMismatchError
from sandcell_protocol.digits import is_ascii_digits

from ..errors import (
    AnswerCeilingError,
    CheckpointError,
    ContextLostError,
    InputMissingError,
    LockLostError,
    ProtocolMismatchError,
    RegistryError,
    RunnerRequestError,
    SandboxError,
    SandboxTimeoutError,
    SandboxUnavailableError,
    SandcellError,
    SessionBusyError,
    SessionConflictError,
    SessionRequiredError,
)
from .auth import UnauthorizedError

__all__ = [
    "JSON_MEDIA_TYPE",
    "MAX_BODY_BYTES",
    "Endpoint",
    "PayloadTooLargeError",
    "allowed_methods",
    "answered",
    "error_response",
    "explained",
    "form_of",
    "guarded",
    "http_error_response",
    "map_error",
    "public_message",
    "read_body",
]

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 << 20
"""The largest accepted request body: inline files travel in it, base64-encoded."""
JSON_MEDIA_TYPE = "application/json"
SESSION_BUSY_RETRY_AFTER_S = 1
"""``Retry-After`` of a 409 ``session_busy``: when to try the session again."""
# Runner codes that describe the caller's request; any other code the runner
# refused us with is this service's own failure, not the caller's.
_CALLER_CODES = frozenset(
    {
        ErrorCode.BAD_REQUEST,
        ErrorCode.PAYLOAD_TOO_LARGE,
        ErrorCode.UNSUPPORTED_LANGUAGE,
        ErrorCode.INVALID_PATH,
        ErrorCode.QUARANTINED,
        ErrorCode.BUSY,
    }
)


class PayloadTooLargeError(Exception):
    """A request body past ``MAX_BODY_BYTES``: answered 413 ``payload_too_large``."""


# First match wins. An orchestrator error's own message is for the log (it may name a
# runner's route or address, or a registry's): the caller is told what failed, in the
# words of this table, plus the error's ``public_detail`` where the class has one to
# give (``None`` here: the caller's own body, which a ProtocolError describes).
_DIRECT: tuple[
    tuple[type[Exception] | tuple[type[Exception], ...], int, ErrorCode, str | None], ...
] = (
    (ProtocolError, 400, ErrorCode.BAD_REQUEST, None),
    (
        SessionRequiredError,
        400,
        ErrorCode.SESSION_REQUIRED,
        "this call needs a runtime session: give a runtime_session_hint",
    ),
    (SessionBusyError, 409, ErrorCode.SESSION_BUSY, "another call holds this session; retry"),
    (
        SessionConflictError,
        409,
        ErrorCode.SESSION_CONFLICT,
        "the session's sandbox is bound to another session",
    ),
    (
        ContextLostError,
        409,
        ErrorCode.CONTEXT_LOST,
        "the code context's interpreter is gone: restart the context",
    ),
    (InputMissingError, 400, ErrorCode.INPUT_MISSING, "an input file could not be delivered"),
    (
        (ProtocolMismatchError, PeerProtocolMismatchError),
        502,
        ErrorCode.PROTOCOL_MISMATCH,
        "the sandbox speaks an incompatible protocol version",
    ),
    # The runner's limits are above what this service reads: the same call fails
    # again until its operator raises the variable the detail names.
    (
        AnswerCeilingError,
        413,
        ErrorCode.PAYLOAD_TOO_LARGE,
        "the sandbox's answer is larger than this service reads",
    ),
    (SandboxUnavailableError, 503, ErrorCode.BUSY, "the sandbox is not available; retry"),
    (LockLostError, 503, ErrorCode.BUSY, "the session was taken over while this call ran; retry"),
    (RegistryError, 503, ErrorCode.BUSY, "the session registry is not available; retry"),
)
# The classes whose ``public_detail`` is the caller's to read (it names their input).
_DETAILED = (InputMissingError, RunnerRequestError, AnswerCeilingError)
_CALLER_REFUSED = "the request was refused"


def public_message(
    exc: BaseException, says: str, *, detailed: tuple[type[Exception], ...] = _DETAILED
) -> str:
    """``says`` (what failed), with the error's ``public_detail`` where it has one to give
    (only classes in ``detailed``: elsewhere a runner's words may fill it)."""
    detail = getattr(exc, "public_detail", None) if isinstance(exc, detailed) else None
    return f"{says}: {detail}" if detail else says


def explained(
    exc: BaseException,
    status: int,
    code: ErrorCode,
    says: str,
    *,
    detailed: tuple[type[Exception], ...] = _DETAILED,
) -> tuple[int, ErrorBody]:
    """``exc`` answered as ``status``/``code`` in the words ``says`` (see ``public_message``);
    the exception itself goes to the log, at WARNING for a 5xx."""
    _log_detail(status, code, exc)
    retryable = bool(getattr(exc, "retryable", False))
    body = error_body(code, public_message(exc, says, detailed=detailed), retryable=retryable)
    return status, body


def map_error(exc: BaseException) -> tuple[int, ErrorBody]:
    """The HTTP status and ``ErrorBody`` an exception becomes; total over exceptions.

    No answer names a runner's route, address or token: what the exception itself
    says goes to the log, and the caller gets a stable code and what failed.
    """
    if isinstance(exc, UnauthorizedError):
        return 401, error_body(ErrorCode.UNAUTHORIZED, "a valid bearer API key is required")
    if isinstance(exc, PayloadTooLargeError):
        return 413, error_body(
            ErrorCode.PAYLOAD_TOO_LARGE, f"the body exceeds {MAX_BODY_BYTES} bytes"
        )
    for kinds, status, code, says in _DIRECT:
        if isinstance(exc, kinds):
            if says is None:
                retryable = bool(getattr(exc, "retryable", False))
                return status, error_body(code, str(exc), retryable=retryable)
            return explained(exc, status, code, says)
    if isinstance(exc, RunnerRequestError):
        try:
            code = ErrorCode(exc.code)
        except ValueError:
            code = ErrorCode.INTERNAL
        if code in _CALLER_CODES:
            status = ERROR_SEMANTICS[code].http_status
            message = public_message(exc, _CALLER_REFUSED)
            return status, error_body(code, message, retryable=exc.retryable)
        log.error("the runner refused a request: %s", exc)
        return 500, error_body(ErrorCode.INTERNAL, "internal error")
    if isinstance(exc, SandboxTimeoutError):
        # The sandbox accepted the job and went quiet: its effects are unknown,
        # so this is not a blind-retry case.
        log.warning("answering 504: %s", exc)
        return 504, error_body(
            ErrorCode.BUSY, "the sandbox did not answer in time", retryable=False
        )
    if isinstance(exc, CheckpointError) and not exc.retryable:
        # A store that cannot be reached right now (``SnapshotUnavailableError``) is
        # not a fault of ours: it is answered below, a retryable 503.
        log.error("session state could not be restored: %s", exc)
        return 500, error_body(
            ErrorCode.INTERNAL, "the session's saved state could not be restored"
        )
    if isinstance(exc, SandcellError) and exc.retryable:
        _log_detail(503, ErrorCode.BUSY, exc)
        return 503, error_body(
            ErrorCode.BUSY, "the service cannot run this now; retry", retryable=True
        )
    if isinstance(exc, SandboxError):
        log.error("sandbox failure: %s", exc)
        return 503, error_body(ErrorCode.BUSY, "the sandbox failed; retry", retryable=True)
    log.error("unexpected %s", type(exc).__name__, exc_info=exc)
    return 500, error_body(ErrorCode.INTERNAL, "internal error")


def _log_detail(status: int, code: ErrorCode, exc: BaseException) -> None:
    """What the caller is not told: the error as raised (secrets already scrubbed where
    it was raised: ``runner.errors.Redactor``)."""
    level = logging.WARNING if status >= 500 else logging.INFO
    log.log(level, "answering %d %s: %s: %s", status, code.value, type(exc).__name__, exc)


def _error(exc: BaseException, extra: ExtraMapping | None = None) -> Response:
    mapped = extra(exc) if extra is not None else None
    status, body = mapped if mapped is not None else map_error(exc)
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    if body.error.code == ErrorCode.SESSION_BUSY:
        # Another turn holds the session; most turns end within seconds.
        headers = {"Retry-After": str(SESSION_BUSY_RETRY_AFTER_S)}
    return Response(encode(body), status_code=status, media_type=JSON_MEDIA_TYPE, headers=headers)


Endpoint = Callable[[Request], Awaitable[Response]]
"""A route's endpoint, as Starlette calls it."""
ExtraMapping = Callable[[BaseException], tuple[int, ErrorBody] | None]


def answered(endpoint: Endpoint, answer: Callable[[BaseException], Response]) -> Endpoint:
    """Wrap a route so every exception it raises is answered by ``answer``: a served
    surface's error table (``guarded``'s, LibreChat's, E2B's)."""

    async def guarded_endpoint(request: Request) -> Response:
        try:
            return await endpoint(request)
        except Exception as exc:
            return answer(exc)

    return guarded_endpoint


def guarded(endpoint: Endpoint, *, extra: ExtraMapping | None = None) -> Endpoint:
    """Wrap a route so every exception it raises is answered through ``map_error``.

    ``extra`` maps a feature's own errors first (``None``: not one of them).
    """
    return answered(endpoint, lambda exc: _error(exc, extra))


async def read_body(request: Request, *, max_bytes: int = MAX_BODY_BYTES) -> bytes:
    """The whole request body; ``PayloadTooLargeError`` past ``max_bytes``.

    A declared length past the limit is refused before a byte is read; a body
    that lies about (or omits) its length is cut off as it streams.
    """
    declared = request.headers.get("content-length", "")
    if is_ascii_digits(declared) and int(declared) > max_bytes:
        raise PayloadTooLargeError
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise PayloadTooLargeError
        chunks.append(chunk)
    return b"".join(chunks)


@contextlib.asynccontextmanager
async def form_of(request: Request, **limits: int) -> AsyncIterator[FormData]:
    """The request's parsed form; a malformed multipart body is a ``ProtocolError`` (400).

    Starlette raises ``HTTPException(400)`` (``MultiPartException`` outside an app)
    for it, which the routes' error mapping would otherwise answer as a 500.
    """
    try:
        form = await request.form(**limits)
    except (HTTPException, MultiPartException) as exc:
        detail = exc.detail if isinstance(exc, HTTPException) else exc.message
        raise ProtocolError(f"multipart body: {str(detail)[:200]}") from None
    try:
        yield form
    finally:
        await form.close()


def error_response(status: int, code: ErrorCode, message: str) -> Response:
    """A protocol ``ErrorBody`` answer."""
    return Response(
        encode(error_body(code, message)), status_code=status, media_type=JSON_MEDIA_TYPE
    )


_OTHER_SURFACES = ("/e2b", "/librechat/")
"""Path prefixes of the served APIs that answer in their own terms (their own
modules own what their clients see; here they keep the answers they had)."""


async def http_error_response(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 and 405 answered as protocol ``ErrorBody``s; a 405 with
    ``Allow``: the methods of every route of the path."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        return error_response(404, ErrorCode.NOT_FOUND, "no such route")
    if exc.status_code == 405:
        own = not request.url.path.startswith(_OTHER_SURFACES)
        code = ErrorCode.METHOD_NOT_ALLOWED if own else ErrorCode.BAD_REQUEST
        response = error_response(405, code, "method not allowed")
        allowed = allowed_methods(request) or (exc.headers or {}).get("Allow")
        if allowed:
            response.headers["Allow"] = allowed
        return response
    return error_response(exc.status_code, ErrorCode.BAD_REQUEST, "bad request")


def allowed_methods(request: Request) -> str | None:
    """What the app's routes of this path take. Starlette's own ``Allow`` names only the
    first route of the path, and one path may have a route per method (``egress``)."""
    router = getattr(request.scope.get("app"), "router", None)
    methods: set[str] = set()
    for route in getattr(router, "routes", ()):
        if isinstance(route, Route) and route.methods:
            match, _ = route.matches(request.scope)
            if match is not Match.NONE:
                methods |= route.methods
    return ", ".join(sorted(methods)) or None
