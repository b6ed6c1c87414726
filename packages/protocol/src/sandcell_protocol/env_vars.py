"""Environment variables a caller names for a job: the one rule both peers check.

A name is a shell identifier (``[A-Za-z_][A-Za-z0-9_]*``, at most 256 characters);
a value holds no NUL (``execve`` would cut it there); all of them together take at
most ``MAX_ENV_BYTES`` as ``env_bytes`` counts them. The runner checks it where
a job starts; a surface that keeps variables for later jobs (E2B's ``envVars``)
checks it where they enter, so bad input is a 400 at the door, not at every run.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from .errors import ProtocolError

__all__ = ["ENV_NAME_PATTERN", "MAX_ENV_BYTES", "env_bytes", "validate_env"]

ENV_NAME_PATTERN = r"[A-Za-z_][A-Za-z0-9_]{0,255}"
_ENV_NAME_RE = re.compile(ENV_NAME_PATTERN)


MAX_ENV_BYTES = 48 << 10
"""What a job's variables may take together, counted by ``env_bytes``: the runner's jail
configuration carries them escaped, a line each; its cap
(``sandcell_runner.jail.nsjail_config.MAX_CONFIG_BYTES``) holds the most this admits,
however many variables that is (13,149 empty ones)."""

_PRINTABLE_ASCII = bytes(range(0x20, 0x7F))


def env_bytes(env: Mapping[str, str]) -> int:
    """The size of ``env`` as ``NAME=value`` entries escaped as C string literals: a
    printable ASCII byte counts 1, ``"`` and backslash 2, any other byte 4 (``\\ooo``)."""
    total = 0
    for key, value in env.items():
        entry = f"{key}={value}"
        escaped = entry.count('"') + entry.count("\\")
        if entry.isascii() and entry.isprintable():
            total += len(entry) + escaped  # the usual case, without a per-byte pass
            continue
        raw = entry.encode("utf-8", "surrogatepass")
        total += len(raw) + escaped + 3 * len(raw.translate(None, _PRINTABLE_ASCII))
    return total


def validate_env(env: Mapping[str, str], *, field: str = "env") -> dict[str, str]:
    """A copy of ``env`` if every name and value is valid and they fit in
    ``MAX_ENV_BYTES``; else ``ProtocolError`` naming ``field`` and the first bad variable."""
    for key, value in env.items():
        if not _ENV_NAME_RE.fullmatch(key):
            raise ProtocolError(f"{field}: invalid variable name {key[:64]!r}")
        if "\x00" in value:
            raise ProtocolError(f"{field}[{key[:64]}]: must not contain NUL")
    size = env_bytes(env)
    if size > MAX_ENV_BYTES:
        raise ProtocolError(
            f"{field}: the variables take {size} bytes, more than the {MAX_ENV_BYTES} a job"
            " may have"
        )
    return dict(env)
