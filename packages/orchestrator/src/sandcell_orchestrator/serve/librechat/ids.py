"""LibreChat's ids: 21-character nanoids (``^[A-Za-z0-9_-]{21}$``).

``session_id``, ``storage_session_id`` and file ids all have this shape; LibreChat's
own download route refuses anything else with 400, and so does this API.
"""

from __future__ import annotations

import re
import secrets
import string

from sandcell_protocol import ProtocolError

__all__ = ["NANOID_LENGTH", "is_nanoid", "new_nanoid", "require_nanoid"]

NANOID_LENGTH = 21
_ALPHABET = string.ascii_letters + string.digits + "_-"
_ALNUM = string.ascii_letters + string.digits
_NANOID_RE = re.compile(r"[A-Za-z0-9_-]{21}")


def new_nanoid() -> str:
    """A fresh id: 21 characters of nanoid's alphabet, ~125 bits from ``secrets``.

    The first character is alphanumeric so the id is also a valid object-store key
    component (those may not start with ``-``).
    """
    return secrets.choice(_ALNUM) + "".join(
        secrets.choice(_ALPHABET) for _ in range(NANOID_LENGTH - 1)
    )


def is_nanoid(value: object) -> bool:
    """True for a string of exactly 21 characters of ``[A-Za-z0-9_-]``."""
    return isinstance(value, str) and bool(_NANOID_RE.fullmatch(value))


def require_nanoid(field: str, value: object) -> str:
    """``value`` if it is a nanoid, else ``ProtocolError`` (a 400) naming ``field``."""
    if not is_nanoid(value):
        raise ProtocolError(f"{field}: must match ^[A-Za-z0-9_-]{{21}}$")
    assert isinstance(value, str)
    return value
