"""The runner zygote: imported once, it forks a child that becomes a runner.

    python -m sandcell_runner.zygote <launcher pid>
    (fd 0: a SOCK_SEQPACKET socket to the launcher)

Why. A runner's start is ~230 CPU-ms before ``/health`` answers, ~180 of them
imports (uvicorn, the HTTP app, the settings): a cold session without a warm
pool waited for all of it. A fork of a process that has done those imports costs
a few ms, and the child then only builds its ``RunnerService``.

The child becomes the runner exactly as ``python -m sandcell_runner`` would
(``become_runner``): its own session and process group, the environment it was
sent (and shown as its ``/proc/<pid>/environ``), its stdout/stderr on the log it
was sent, nothing of the zygote's (its socket, its other children's pidfds) but
the one pidfd it watches; then ``__main__.main`` reads its settings, its token
(from the pipe it was sent), its listener, and makes itself undumpable.

Lifetimes. The zygote has ``PR_SET_PDEATHSIG`` towards the launcher and exits on
its socket's EOF (the launcher closed it or died). Its children do not die with
it (a killed zygote must not take every sandbox it started along): each watches
the launcher's pidfd and stops itself (SIGTERM, as the plain launch's death
signal) when the launcher exits. The zygote reaps its children (by pidfd, so a
pid it hands out is never reused before the launcher has its own pidfd); once it
is gone, init does.

It forks only while it has one thread and no event loop (it never starts
either); ``random`` reseeds itself in a forked child and ``secrets`` reads the
kernel's, so no child shares another's randomness. What siblings do share is the
zygote's address-space layout and ``str`` hash seed (as Android's zygote children
do). The runner runs no untrusted code in its own process (jobs are exec'd under
nsjail, each with a fresh layout), so that hands a job nothing; it would matter
only to an exploit of the runner's own memory, which would already hold its token.

Wire (JSON datagrams): launcher -> zygote ``{"env": {...}}`` with descriptors
[log, token pipe, listener]; zygote -> launcher ``{"op": "ready"}`` once imported,
then per request ``{"op": "forked", "pid": N}`` with the child's pidfd attached,
or ``{"op": "failed", "why": ...}``.
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import json
import os
import select
import signal
import socket
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from . import runner_token

MAX_MESSAGE_BYTES = 256 * 1024
ENV_SPACE_VARIABLE = "SANDCELL_ZYGOTE_ENV_SPACE"
"""Padding in the zygote's environment block: the room a child rewrites with its own
environment, so ``/proc/<pid>/environ`` shows the runner's, not the zygote's."""
LISTEN_FD_VARIABLE = "SANDCELL_RUNNER_LISTEN_FD"

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)

# What ``python -m sandcell_runner`` imports before it serves, uvicorn's lazily
# loaded protocol, lifespan and loop modules included.
_PREIMPORTS = (
    "uvicorn",
    "uvicorn.lifespan.on",
    "uvicorn.loops.asyncio",
    "uvicorn.loops.uvloop",
    "uvicorn.protocols.http.httptools_impl",
    "uvicorn.protocols.websockets.auto",
    "nsjail",
    "encodings.ascii",
    "sandcell_runner.__main__",
    "sandcell_runner.config",
    "sandcell_runner.errors",
    "sandcell_runner.http.app",
    "sandcell_runner.service",
)


@dataclass(frozen=True, slots=True)
class Fork:
    """What a forked child was sent: its environment and descriptors, the launcher's pidfd."""

    env: dict[str, str]
    log_fd: int
    token_fd: int
    listener_fd: int
    launcher_pidfd: int


class Zygote:
    """The zygote's state: its socket, the launcher's pidfd, its unreaped children."""

    def __init__(self, sock: socket.socket, launcher_pidfd: int) -> None:
        self.sock = sock
        self.launcher_pidfd = launcher_pidfd
        self.poller = select.poll()
        self.poller.register(sock.fileno(), select.POLLIN)
        self.children: dict[int, int] = {}
        """pidfd -> pid"""

    def send(self, reply: dict[str, object], fds: list[int] | None = None) -> None:
        socket.send_fds(self.sock, [json.dumps(reply).encode()], fds or [])

    def run(self) -> Fork | None:
        """Serve until EOF (None); in a forked child, what it was sent."""
        self.send({"op": "ready"})
        while True:
            for fd, _ in self.poller.poll():
                if fd != self.sock.fileno():
                    self.reap(fd)
                    continue
                try:
                    data, fds, flags, _ = socket.recv_fds(
                        self.sock, MAX_MESSAGE_BYTES, 4, socket.MSG_CMSG_CLOEXEC
                    )
                except ConnectionError:  # the launcher went: as EOF
                    return None
                if not data:
                    for fd_ in fds:
                        os.close(fd_)
                    return None
                child = self.fork(data, fds, truncated=bool(flags & socket.MSG_CTRUNC))
                if child is not None:
                    return child

    def fork(self, data: bytes, fds: list[int], *, truncated: bool) -> Fork | None:
        """Fork for one request: the child gets its ``Fork``, the zygote None."""
        try:
            env = _checked_env(data, fds, truncated=truncated)
        except ValueError as exc:
            for fd in fds:
                os.close(fd)
            self.send({"op": "failed", "why": f"bad request: {exc}"})
            return None
        if threading.active_count() != 1:  # never expected: refuse rather than fork threads
            for fd in fds:
                os.close(fd)
            self.send({"op": "failed", "why": "the zygote has threads"})
            return None
        try:
            pid = os.fork()
        except OSError as exc:
            for fd in fds:
                os.close(fd)
            self.send({"op": "failed", "why": f"fork: {exc.strerror}"})
            return None
        if pid == 0:
            # Nothing of the zygote's: not its socket, not a sibling's pidfd.
            self.sock.close()
            for pidfd in self.children:
                os.close(pidfd)
            return Fork(env, fds[0], fds[1], fds[2], self.launcher_pidfd)
        for fd in fds:
            os.close(fd)
        pidfd = os.pidfd_open(pid)
        self.children[pidfd] = pid
        self.poller.register(pidfd, select.POLLIN)
        self.send({"op": "forked", "pid": pid}, [pidfd])
        return None

    def reap(self, pidfd: int) -> None:
        pid = self.children.pop(pidfd)
        self.poller.unregister(pidfd)
        os.close(pidfd)
        os.waitpid(pid, 0)


def _checked_env(data: bytes, fds: list[int], *, truncated: bool) -> dict[str, str]:
    if truncated or len(fds) != 3:
        raise ValueError("expected three descriptors: log, token pipe, listener")
    message = json.loads(data)
    env = message.get("env") if isinstance(message, dict) else None
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and k and "=" not in k and "\0" not in k + v
        for k, v in env.items()
    ):
        raise ValueError("env must map names to strings")
    if runner_token.TOKEN_VARIABLE in env or runner_token.TOKEN_FILE_VARIABLE in env:
        raise ValueError("the token comes on its pipe, never in env")
    return dict(env)


def become_runner(child: Fork) -> int:
    """In a forked child: set up as ``python -m sandcell_runner`` would be, then run it."""
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDONLY)  # fd 0 (the zygote's socket) is closed
    if devnull != 0:
        os.dup2(devnull, 0)
        os.close(devnull)
    os.dup2(child.log_fd, 1)
    os.dup2(child.log_fd, 2)
    os.close(child.log_fd)
    # Now, with one thread, the token unread and the zygote's environment: the runner's
    # restore fork server, forked instead of started afresh (``extractor_prefork.py``).
    from .checkpoint import extractor_prefork

    extractor_prefork.prefork()
    sys.argv = sys.argv[:1]
    env = {
        **child.env,
        runner_token.TOKEN_FILE_VARIABLE: f"/dev/fd/{child.token_fd}",
        LISTEN_FD_VARIABLE: str(child.listener_fd),
    }
    os.environ.clear()  # unsetenv each: the C environment no longer points into the block
    os.environ.update(env)
    _show_environ(env)
    threading.Thread(
        target=_stop_when_exited, args=(child.launcher_pidfd,), name="launcher-watch", daemon=True
    ).start()
    from . import __main__ as runner_main

    return runner_main.main()


def _stop_when_exited(pidfd: int) -> None:
    """SIGTERM to this runner once the launcher exits: the plain launch's death signal."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    poller.poll()
    os.kill(os.getpid(), signal.SIGTERM)


def _show_environ(env: Mapping[str, str]) -> bool:
    """Write ``env`` over the environment block ``/proc/<pid>/environ`` shows (the
    zygote's, inherited); False (left as it was) where it does not fit or is still in use."""
    try:
        with open("/proc/self/stat", "rb") as stat:
            fields = stat.read().rpartition(b")")[2].split()
        start, end = int(fields[47]), int(fields[48])  # fields 50, 51: env_start, env_end
    except (OSError, ValueError, IndexError):
        return False
    block = b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items())
    if not start or len(block) >= end - start or _environ_points_into(start, end):
        return False
    ctypes.memmove(start, block + b"\0" * (end - start - len(block)), end - start)
    return True


def _environ_points_into(start: int, end: int) -> bool:
    """Whether any entry of the C ``environ`` still lives in [start, end)."""
    environ = ctypes.POINTER(ctypes.c_void_p).in_dll(_libc, "environ")
    i = 0
    while (entry := environ[i]) is not None:
        if start <= entry < end:
            return True
        i += 1
    return False


def _preimport() -> None:
    for name in _PREIMPORTS:
        try:
            importlib.import_module(name)
        except ImportError:  # an optional one (uvloop, websockets): the runner does without
            continue
    # Everything imported so far is never collected: the children's collections skip it,
    # and do not write to (and so copy) the pages it is on.
    gc.collect()
    gc.freeze()


def main(argv: list[str]) -> int:
    """Serve the launcher on fd 0 until it closes the socket; in a child, be the runner."""
    launcher = int(argv[1])
    if _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return 1
    if os.getppid() != launcher:  # the launcher died before the death signal was set
        return 1
    launcher_pidfd = os.pidfd_open(launcher)
    sock = socket.socket(fileno=0)
    _preimport()
    child = Zygote(sock, launcher_pidfd).run()
    if child is None:
        return 0
    return become_runner(child)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
