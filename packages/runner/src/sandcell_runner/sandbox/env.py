"""The environment of a sandbox process: a fixed base, then the caller's variables."""

from __future__ import annotations

from collections.abc import Mapping

from ..env_vars import checked_env
from ..errors import BadRequestError

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
    env.update(checked_env(envs, field="envs"))
    return env


__all__ = ["process_env"]
