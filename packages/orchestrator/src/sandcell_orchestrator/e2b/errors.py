"""The E2B surface's error table: one place where sandcell errors become E2B's answers.

Control plane: ``{"code": <status>, "message": …, "error_code": <sandcell code>}``
with the status ``serve.errors.map_error`` gives (E2B's own ``E2bError`` first).
envd RPCs: a ``ConnectError`` whose code the SDK turns into the same exception
E2B's envd would have caused (``NOT_FOUND`` → ``NotFoundException``, …).
"""

from __future__ import annotations

from typing import TypeVar

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from sandcell_protocol import ProtocolError, decode, encode

from ..errors import (
    ArchiveRejectedError,
    CheckpointError,
    RunnerRequestError,
    SandboxUnavailableError,
)
from ..serve.errors import allowed_methods, map_error, public_message, read_body
from ..snapshots import SnapshotTooLargeError
from .wire import ErrorBody

__all__ = [
    "UNSAVABLE",
    "E2bError",
    "connect_error",
    "e2b_error_response",
    "e2b_route_error_response",
    "read_message",
    "sandbox_gone_response",
    "unsavable",
]

JSON = "application/json"
T = TypeVar("T")


class E2bError(Exception):
    """An answer of the E2B surface itself: an HTTP status and a sandcell error code."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


UNSAVABLE = (SnapshotTooLargeError, ArchiveRejectedError)
"""What a copy of a workspace raises when the workspace itself cannot be saved: past
``SANDCELL_CHECKPOINT_MAX_BYTES``, or refused by its runner's export (more entries than
a checkpoint holds: hard links cost no inode). The tenant's own files: ``unsavable``."""


def unsavable(
    sandbox_id: str, exc: CheckpointError, *, what: str, most_bytes: int, after: str = ""
) -> E2bError:
    """The 413 for a workspace that ``what`` (``a snapshot may be``, ``a pause may save``)
    cannot hold (``UNSAVABLE``), naming why; a runner's refusal was a 500 "the session's
    saved state could not be restored"."""
    if isinstance(exc, SnapshotTooLargeError):
        why = (
            f"its workspace is larger than {what} ({most_bytes} bytes,"
            " SANDCELL_CHECKPOINT_MAX_BYTES)"
        )
    else:
        why = f"its workspace cannot be saved ({exc.public_detail or 'refused'})"
    return E2bError(413, "payload_too_large", f"sandbox {sandbox_id}: {why}{after}")


async def read_message(request: Request, kind: type[T], *, empty_ok: bool = False) -> T:
    """The body decoded as ``kind`` (an empty one as ``{}`` when ``empty_ok``); a body
    that is not one is ``E2bError`` 400 ``bad_request``: every E2B route reads its
    JSON this way."""
    body = await read_body(request)
    if empty_ok and not body.strip():
        body = b"{}"
    try:
        return decode(body, kind)
    except ProtocolError as exc:
        raise E2bError(400, "bad_request", str(exc)) from None


def e2b_error_response(exc: BaseException) -> Response:
    """Any exception as E2B's error body (unexpected ones say nothing about themselves)."""
    if isinstance(exc, E2bError):
        status, code, message = exc.status, exc.code, str(exc)
    else:
        status, body = map_error(exc)
        code, message = body.error.code, body.error.message
    payload = ErrorBody(code=status, message=message, error_code=str(code))
    return Response(encode(payload), status_code=status, media_type=JSON)


def e2b_route_error_response(request: Request, exc: HTTPException) -> Response:
    """Starlette's own 404 (no route) and 405 (a route, not that method) under ``/e2b``,
    answered as E2B's API does: its OpenAPI validator finds no operation first, so the
    body is E2B's error shape with the validator's words, not sandcell's generic one;
    a 405 names the path's methods in ``Allow``."""
    if exc.status_code == 404:
        return e2b_error_response(E2bError(404, "not_found", "no matching operation was found"))
    if exc.status_code == 405:
        response = e2b_error_response(E2bError(405, "bad_request", "method not allowed"))
        allowed = allowed_methods(request) or (exc.headers or {}).get("Allow")
        if allowed:
            response.headers["Allow"] = allowed
        return response
    return e2b_error_response(E2bError(exc.status_code, "bad_request", "bad request"))


def sandbox_gone_response(sandbox_id: str | None) -> Response:
    """What E2B's proxy answers for a sandbox it cannot reach (missing, paused, another
    tenant's, or a wrong access token: all alike)."""
    payload = ErrorBody(
        code=502,
        message=f"The sandbox {(sandbox_id or '')[:40]} was not found",
        error_code="not_found",
    )
    return Response(encode(payload), status_code=502, media_type=JSON)


_RUNNER_CODES = {
    "not_found": Code.NOT_FOUND,
    "invalid_path": Code.INVALID_ARGUMENT,
    "bad_request": Code.INVALID_ARGUMENT,
    "payload_too_large": Code.RESOURCE_EXHAUSTED,
    "session_busy": Code.UNAVAILABLE,
    "busy": Code.RESOURCE_EXHAUSTED,
}


def connect_error(exc: BaseException) -> ConnectError:
    """The ``ConnectError`` an envd call answers for ``exc``."""
    if isinstance(exc, ConnectError):
        return exc
    if isinstance(exc, E2bError):
        by_status = {400: Code.INVALID_ARGUMENT, 404: Code.NOT_FOUND, 409: Code.ALREADY_EXISTS}
        return ConnectError(by_status.get(exc.status, Code.INTERNAL), str(exc))
    if isinstance(exc, RunnerRequestError):
        code = _RUNNER_CODES.get(exc.code)
        if code is not None:
            # Its own message names the runner's route: the caller gets what was refused.
            return ConnectError(code, public_message(exc, "the request was refused"))
    if isinstance(exc, SandboxUnavailableError):
        return ConnectError(Code.UNAVAILABLE, "the sandbox is not reachable")
    status, body = map_error(exc)
    code = Code.INVALID_ARGUMENT if 400 <= status < 500 else Code.INTERNAL
    return ConnectError(code, body.error.message)
