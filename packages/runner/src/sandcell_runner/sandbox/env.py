"""The environment of a sandbox process: a fixed base, then the caller's variables."""

from __future__ import annotations

import re
from collections.abc import Mapping

from ..errors import BadRequestError

_ENV_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,255}")
_MAX_VARS = 1024


def process_env(envs: Mapping[str, str], *, home: str) -> dict[str, str]:
    """The base environment (PATH, HOME, USER, LANG…) updated with ``envs``, validated.

    Nothing of the runner's own environment reaches a process.
    """
    if len(envs) > _MAX_VARS:
        raise BadRequestError(f"envs: at most {_MAX_VARS} variables")
    env = {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": home,
        "USER": "user",
        "LOGNAME": "user",
        "SHELL": "/bin/bash",
        "LANG": "C.UTF-8",
        "TERM": "xterm-256color",
        "PYTHONUNBUFFERED": "1",
    }
    for key, value in envs.items():
        if not _ENV_KEY_RE.fullmatch(key):
            raise BadRequestError(f"envs: invalid variable name {key[:64]!r}")
        if "\x00" in value:
            raise BadRequestError(f"envs[{key}]: must not contain NUL")
        env[key] = value
    return env


__all__ = ["process_env"]
