"""Environment variables a caller names for a job: the one rule both peers check.

A name is a shell identifier (``[A-Za-z_][A-Za-z0-9_]*``, at most 256 characters);
a value holds no NUL (``execve`` would cut it there). The runner checks it where
a job starts; a surface that keeps variables for later jobs (E2B's ``envVars``)
checks it where they enter, so bad input is a 400 at the door, not at every run.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from .errors import ProtocolError

__all__ = ["ENV_NAME_PATTERN", "validate_env"]

ENV_NAME_PATTERN = r"[A-Za-z_][A-Za-z0-9_]{0,255}"
_ENV_NAME_RE = re.compile(ENV_NAME_PATTERN)


def validate_env(env: Mapping[str, str], *, field: str = "env") -> dict[str, str]:
    """A copy of ``env`` if every name and value is valid; else ``ProtocolError``
    naming ``field`` and the first bad variable."""
    for key, value in env.items():
        if not _ENV_NAME_RE.fullmatch(key):
            raise ProtocolError(f"{field}: invalid variable name {key[:64]!r}")
        if "\x00" in value:
            raise ProtocolError(f"{field}[{key[:64]}]: must not contain NUL")
    return dict(env)
