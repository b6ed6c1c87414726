"""What a snapshot key may be: the one rule every store and the S3 prefix share."""

from __future__ import annotations

import re

from ..errors import CheckpointError

__all__ = ["KEY_COMPONENT", "validate_snapshot_key"]

# One component of a key: no leading dot, so ``.``/``..`` and the stores' own
# hidden temp and staging names can never be addressed as a key.
KEY_COMPONENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,254}")
_MAX_KEY_CHARS = 1024


def validate_snapshot_key(key: str) -> str:
    """Return ``key`` if it is a safe relative object key, else raise ``CheckpointError``.

    A key is ``/``-separated components of ``[A-Za-z0-9._-]`` that do not start
    with a dot (so no ``..``, no absolute path, no empty component, no NUL).
    """
    if not isinstance(key, str) or not key:
        raise CheckpointError("snapshot key: must be a non-empty string")
    if len(key) > _MAX_KEY_CHARS:
        raise CheckpointError(f"snapshot key: longer than {_MAX_KEY_CHARS} characters")
    if not all(KEY_COMPONENT.fullmatch(part) for part in key.split("/")):
        raise CheckpointError(
            f"snapshot key {key[:80]!r}: components must match [A-Za-z0-9_][A-Za-z0-9._-]*"
        )
    return key
