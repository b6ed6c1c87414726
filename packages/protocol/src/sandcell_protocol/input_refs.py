"""What an input reference may name, and how it is tied to a tenant.

An input reference (``FileRef``) names an object by ``(storage_session, object_id)``.
Both parts come from a caller, and both become a path component (the
orchestrator's input directory, an S3 key, the runner's file-server pull URL), so
both are held to one strict shape, checked by ``validate_input_ref`` wherever a
reference enters: 1 to 128 characters of ``[A-Za-z0-9._-]``, not starting with a
dot (so never ``.``, ``..`` or a hidden name), no ``/``, no NUL, ASCII only.

Every reference is scoped to the caller's namespace before any lookup:
``scoped_storage_session(namespace, storage_session)`` is what reaches the input
sources and the runner, so a name another tenant chose can never meet this
tenant's objects, and its object answers exactly as a missing one does. The
scoped form is ``t<30 hex of sha256(namespace)>.<storage_session>``: every
scoped value of one namespace shares that fixed-length prefix, so two namespaces'
values never coincide whatever the caller writes after it.
"""

from __future__ import annotations

import hashlib
import re

from .errors import ProtocolError

__all__ = [
    "INPUT_REF_PATTERN",
    "MAX_INPUT_REF_CHARS",
    "MAX_STORAGE_SESSION_CHARS",
    "scoped_storage_session",
    "validate_input_ref",
]

MAX_INPUT_REF_CHARS = 128
"""The longest ``storage_session`` (scoped) or ``object_id`` on the wire."""
_TAG_HEX_CHARS = 30
_SCOPE_CHARS = 1 + _TAG_HEX_CHARS + 1
MAX_STORAGE_SESSION_CHARS = MAX_INPUT_REF_CHARS - _SCOPE_CHARS
"""The longest ``storage_session`` a caller may name (its scoped form adds 32)."""

_PART = rf"[A-Za-z0-9_-][A-Za-z0-9._-]{{0,{MAX_INPUT_REF_CHARS - 1}}}"
INPUT_REF_PATTERN = rf"^{_PART}(?![\s\S])"
"""``storage_session`` and ``object_id`` on the wire. ``(?![\\s\\S])`` and not ``$``:
``$`` also matches before a trailing newline, and the lookahead reads the same in
Python and ECMAScript (the JSON Schema's dialect)."""
_PART_RE = re.compile(_PART)


def _check(field: str, value: object, *, max_chars: int = MAX_INPUT_REF_CHARS) -> str:
    if not isinstance(value, str) or not _PART_RE.fullmatch(value):
        raise ProtocolError(
            f"{field}: must be 1 to {MAX_INPUT_REF_CHARS} characters of [A-Za-z0-9._-], "
            "not starting with a dot"
        )
    if len(value) > max_chars:
        raise ProtocolError(f"{field}: longer than {max_chars} characters")
    return value


def validate_input_ref(storage_session: str, object_id: str) -> tuple[str, str]:
    """Return ``(storage_session, object_id)`` if both are valid parts, else ``ProtocolError``.

    The message names the offending field and never echoes its value.
    """
    return _check("storage_session", storage_session), _check("object_id", object_id)


def scoped_storage_session(namespace: str, storage_session: str) -> str:
    """``storage_session`` as seen inside ``namespace``: what sources and runners are given.

    ``ProtocolError`` for an invalid ``storage_session`` (or one longer than
    ``MAX_STORAGE_SESSION_CHARS``) or an empty namespace.
    """
    if not isinstance(namespace, str) or not namespace or "\x00" in namespace:
        raise ProtocolError("namespace: must be a non-empty string without NUL")
    _check("storage_session", storage_session, max_chars=MAX_STORAGE_SESSION_CHARS)
    try:
        encoded = namespace.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ProtocolError("namespace: must be valid UTF-8") from exc
    tag = hashlib.sha256(encoded).hexdigest()[:_TAG_HEX_CHARS]
    return f"t{tag}.{storage_session}"
