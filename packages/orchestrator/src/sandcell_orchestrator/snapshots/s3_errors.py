"""Every minio / urllib3 / socket error of the S3 store, as a ``CheckpointError``.

One table (``translate_error``) for every call ``S3SnapshotStore`` and its upload
make: a missing object is ``SnapshotNotFoundError``, a transient failure or an
endpoint that cannot be reached is ``SnapshotUnavailableError`` (retryable), and
anything else a plain ``CheckpointError``. No message names a credential.
"""

from __future__ import annotations

import urllib3
from minio.error import InvalidResponseError, S3Error, ServerError

from ..errors import CheckpointError
from .base import SnapshotNotFoundError, SnapshotUnavailableError

__all__ = ["translate_error"]

_NOT_FOUND_CODES = frozenset({"NoSuchKey", "NoSuchObject", "NoSuchVersion"})
_TRANSIENT_CODES = frozenset(
    {
        "InternalError",
        "OperationAborted",
        "PreconditionFailed",  # replaced between our HEAD and GET
        "RequestTimeout",
        "ServiceUnavailable",
        "SlowDown",
        "XMinioServerNotInitialized",
    }
)


def translate_error(
    exc: BaseException, *, operation: str, key: str, endpoint: str
) -> CheckpointError:
    """Map a minio / urllib3 / socket error to a ``CheckpointError`` that names no credential."""
    where = f"snapshot {operation} of {key!r} at {endpoint}"
    if isinstance(exc, S3Error):
        code = exc.code or "unknown error"
        if code in _NOT_FOUND_CODES:
            return SnapshotNotFoundError(f"no snapshot under {key!r} at {endpoint}")
        if code in _TRANSIENT_CODES:
            return SnapshotUnavailableError(f"{where} failed: {code}")
        return CheckpointError(f"{where} failed: {code}")
    if isinstance(exc, ServerError):
        return SnapshotUnavailableError(f"{where} failed: HTTP {exc.status_code}")
    if isinstance(exc, InvalidResponseError):
        return SnapshotUnavailableError(f"{where} failed: the endpoint sent a non-S3 response")
    if isinstance(exc, urllib3.exceptions.HTTPError | OSError):
        reason = exc.reason if isinstance(exc, urllib3.exceptions.MaxRetryError) else exc
        return SnapshotUnavailableError(
            f"{where} failed: cannot reach the endpoint ({type(reason).__name__})"
        )
    return CheckpointError(f"{where} failed: {type(exc).__name__}")
