"""Where the runner's bearer token comes from, and how it is kept from every child.

The token arrives either in ``SANDCELL_RUNNER_TOKEN`` or in a file named by
``SANDCELL_RUNNER_TOKEN_FILE`` (read, then unlinked where the filesystem allows;
``/dev/fd/N`` is read from descriptor N, which is then closed). Popping a variable
from ``os.environ`` does not scrub the process's initial environment block, which
``/proc/<pid>/environ`` shows for the process's whole life, so a runner given the
token in its environment execs itself again at once with the token on a pipe
(``SANDCELL_RUNNER_TOKEN_FILE=/dev/fd/N``) and without the variable: same pid,
clean environment block. The runner then marks itself non-dumpable
(``PR_SET_DUMPABLE`` 0: its ``/proc`` files and memory need ``CAP_SYS_PTRACE``),
and the warmup command runs without that capability (``warmup.py``).

This module imports only the standard library: it runs before the runner's own
imports, so the re-exec costs one interpreter start, not two.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import stat
import sys
from collections.abc import Mapping, MutableMapping

TOKEN_VARIABLE = "SANDCELL_RUNNER_TOKEN"  # noqa: S105 - a variable name, not a secret
TOKEN_FILE_VARIABLE = "SANDCELL_RUNNER_TOKEN_FILE"  # noqa: S105
MAX_TOKEN_BYTES = 4096
"""Far above any real token, and below a pipe's buffer: the re-exec's write never blocks."""

_FD_PATH_RE = re.compile(r"^/(?:dev/fd|proc/self/fd)/([0-9]{1,9})$")
_PR_SET_DUMPABLE = 4


class TokenSourceError(ValueError):
    """The token's source is unusable; the message names the variable."""


def reexec_without_token_variable(
    environ: Mapping[str, str], argv: list[str], *, executable: str = sys.executable
) -> None:
    """Exec the runner again with the environment's token moved onto a pipe.

    Returns only when there is nothing to do (no ``SANDCELL_RUNNER_TOKEN``);
    raises ``TokenSourceError`` when both sources are set or the token is too long.
    """
    token = environ.get(TOKEN_VARIABLE)
    if not token:
        return  # unset or empty: settings decide whether that is allowed
    if environ.get(TOKEN_FILE_VARIABLE):
        raise TokenSourceError(f"set {TOKEN_VARIABLE} or {TOKEN_FILE_VARIABLE}, not both")
    data = token.encode()
    if len(data) > MAX_TOKEN_BYTES:
        raise TokenSourceError(f"{TOKEN_VARIABLE} is longer than {MAX_TOKEN_BYTES} bytes")
    read_fd, write_fd = os.pipe()
    try:
        os.write(write_fd, data)
    finally:
        os.close(write_fd)
    os.set_inheritable(read_fd, True)
    env = {k: v for k, v in environ.items() if k != TOKEN_VARIABLE}
    env[TOKEN_FILE_VARIABLE] = f"/dev/fd/{read_fd}"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(executable, [executable, "-m", "sandcell_runner", *argv[1:]], env)  # noqa: S606


def take_token_file(path: str, *, consume: bool = True) -> str:
    """The token in ``path``; with ``consume`` the file is unlinked (for ``/dev/fd/N``:
    the descriptor closed) once read.

    A trailing newline is dropped. A file the filesystem will not let go of (a
    read-only secret mount) stays; the runner's children cannot reach it anyway.
    """
    match = _FD_PATH_RE.fullmatch(path)
    try:
        if match is not None and consume:
            fd = int(match.group(1))
            try:
                data = _read_all(fd)
            finally:
                os.close(fd)
        else:
            flags = os.O_RDONLY | os.O_CLOEXEC | (0 if match else os.O_NOFOLLOW)
            fd = os.open(path, flags)
            try:
                if match is None and not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise TokenSourceError(f"{TOKEN_FILE_VARIABLE}: {path!r} is not a file")
                data = _read_all(fd)
            finally:
                os.close(fd)
            if consume:
                with contextlib.suppress(OSError):
                    os.unlink(path)
    except OSError as exc:
        raise TokenSourceError(
            f"{TOKEN_FILE_VARIABLE}: cannot read {path!r}: {exc.strerror}"
        ) from None
    try:
        token = data.decode("utf-8").removesuffix("\n").removesuffix("\r")
    except UnicodeDecodeError:
        raise TokenSourceError(f"{TOKEN_FILE_VARIABLE}: the token is not UTF-8") from None
    if not token:
        raise TokenSourceError(f"{TOKEN_FILE_VARIABLE}: {path!r} is empty")
    return token


def read_token_file(path: str) -> str:
    """The token in ``path``, leaving the file in place (settings read in tests)."""
    return take_token_file(path, consume=False)


def scrub_environment(environ: MutableMapping[str, str]) -> None:
    """Remove both token variables from ``environ`` (children build on it)."""
    environ.pop(TOKEN_VARIABLE, None)
    environ.pop(TOKEN_FILE_VARIABLE, None)


def make_undumpable() -> bool:
    """``PR_SET_DUMPABLE`` 0 for this process; False where prctl is unavailable.

    Non-dumpable: ``/proc/<pid>/{environ,mem,fd,...}`` and ptrace need
    ``CAP_SYS_PTRACE``, and no core dump holds the token.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _read_all(fd: int) -> bytes:
    chunks = []
    size = 0
    while chunk := os.read(fd, MAX_TOKEN_BYTES + 1):
        chunks.append(chunk)
        size += len(chunk)
        if size > MAX_TOKEN_BYTES:
            raise TokenSourceError(f"{TOKEN_FILE_VARIABLE}: longer than {MAX_TOKEN_BYTES} bytes")
    return b"".join(chunks)


__all__ = [
    "MAX_TOKEN_BYTES",
    "TOKEN_FILE_VARIABLE",
    "TOKEN_VARIABLE",
    "TokenSourceError",
    "make_undumpable",
    "read_token_file",
    "reexec_without_token_variable",
    "scrub_environment",
    "take_token_file",
]
