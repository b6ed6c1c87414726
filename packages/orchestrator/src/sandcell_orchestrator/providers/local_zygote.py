"""The local provider's runner zygote: runners forked from one pre-imported process.

A plain launch (``python -m sandcell_runner``) spends ~180 of its ~230 CPU-ms
before ``/health`` on imports; a cold session without a warm pool waited for
them. The zygote (``sandcell_runner.zygote``, one per provider) has done them
once, and forks a child per launch that becomes the runner. The runner's side
says how the child is made a runner like any other, and why it watches this
process's pidfd instead of holding a death signal towards the zygote.

Here: the zygote is started lazily by the first launch (which does not wait for
it: it launches plainly meanwhile), with ``PR_SET_PDEATHSIG`` from the event
loop's thread and in a session of its own; a launch uses it once it said it is
ready. One that died or misbehaved is stopped and started again by a later
launch (a few times at most), and the provider falls back to the plain launch.
``aclose`` closes its socket (it exits on EOF) and waits for it, by its pid.

All socket I/O is blocking, under one lock, in a worker thread: requests and
replies pair up in order whatever loop or thread asks.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import logging
import os
import select
import signal
import socket
import subprocess
import threading
from collections.abc import Mapping
from dataclasses import dataclass

import anyio

__all__ = ["ForkedRunner", "RunnerZygote", "ZygoteError"]

log = logging.getLogger(__name__)

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)

ENV_SPACE_BYTES = 32 * 1024
"""Room in the zygote's environment block for a child's own (a runner's is ~1-2 KiB)."""
_ENV_SPACE_VARIABLE = "SANDCELL_ZYGOTE_ENV_SPACE"
_REPLY_TIMEOUT_S = 10.0
_MAX_STARTS = 3
"""Zygotes started per provider before it gives up on them (plain launches only)."""


class ZygoteError(Exception):
    """The zygote could not fork this runner (the launch falls back to a plain one)."""


class ForkedRunner:
    """A runner the zygote forked: its pid, and a pidfd that says when it exits.

    Not this process's child (the zygote reaps it), so no exit status: ``poll``
    answers -1 once it has exited, as a Popen's non-zero ``returncode``.
    """

    def __init__(self, pid: int, pidfd: int) -> None:
        self.pid = pid
        self.pidfd = pidfd

    def poll(self) -> int | None:
        ready = select.poll()
        ready.register(self.pidfd, select.POLLIN)
        return -1 if ready.poll(0) else None

    def wait(self) -> int:
        ready = select.poll()
        ready.register(self.pidfd, select.POLLIN)
        ready.poll()
        return -1

    def close(self) -> None:
        """Let go of the pidfd (the provider's liveness checks use pid and start time)."""
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


@dataclass(slots=True)
class _Running:
    process: subprocess.Popen[bytes]
    sock: socket.socket
    ready: bool = False


class RunnerZygote:
    """One zygote for one provider; ``fork`` returns None while none is ready."""

    def __init__(self, *, python: str, env: Mapping[str, str]) -> None:
        self._python = python
        self._env = dict(env)
        self._lock = threading.Lock()
        self._running: _Running | None = None
        self._starts = 0
        self._closed = False

    @property
    def pid(self) -> int | None:
        """The zygote's pid while one runs (tests)."""
        running = self._running
        return running.process.pid if running is not None else None

    def fits(self, env: Mapping[str, str]) -> bool:
        """Whether a child's environment fits the block it is shown in."""
        size = sum(len(k.encode()) + len(v.encode()) + 2 for k, v in env.items())
        return size + 256 < ENV_SPACE_BYTES  # + the token pipe and listener variables

    def start(self) -> None:
        """Start one unless it runs, was closed, or has failed too often.

        Call from the event loop's thread: the death signal follows the forking thread.
        Never waits: a lock held by a fork in flight means one runs.
        """
        if not self._lock.acquire(blocking=False):
            return
        try:
            if self._closed or self._running is not None or self._starts >= _MAX_STARTS:
                return
            self._starts += 1
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                process = subprocess.Popen(
                    [self._python, "-m", "sandcell_runner.zygote", str(os.getpid())],
                    env={**self._env, _ENV_SPACE_VARIABLE: "x" * ENV_SPACE_BYTES},
                    stdin=theirs.fileno(),
                    # Nothing to say: a failure is this side's to log (a fork refused or
                    # lost), and a CLI's stderr is its user's.
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                    preexec_fn=_die_with_parent,
                )
            except OSError as exc:
                ours.close()
                log.warning("runner zygote did not start: %s", exc)
                return
            finally:
                theirs.close()
            self._running = _Running(process, ours)
        finally:
            self._lock.release()

    async def fork(
        self, env: Mapping[str, str], *, log_fd: int, token_fd: int, listener_fd: int
    ) -> ForkedRunner | None:
        """A runner forked with ``env`` and the three descriptors; None while no zygote is
        ready (then the caller launches plainly). ``ZygoteError`` when this one failed."""
        return await anyio.to_thread.run_sync(
            self._fork, dict(env), (log_fd, token_fd, listener_fd)
        )

    def _fork(self, env: dict[str, str], fds: tuple[int, int, int]) -> ForkedRunner | None:
        with self._lock:
            running = self._running
            if running is None:
                return None
            try:
                if not running.ready:
                    if not self._is_ready(running):
                        return None
                    running.ready = True
                socket.send_fds(running.sock, [json.dumps({"env": env}).encode()], list(fds))
                reply, pidfds = self._receive(running, timeout_s=_REPLY_TIMEOUT_S)
            except (OSError, ValueError, ZygoteError) as exc:
                self._stop(running)
                raise ZygoteError(f"runner zygote lost: {exc}") from None
            pid = reply.get("pid")
            if reply.get("op") != "forked" or not isinstance(pid, int) or len(pidfds) != 1:
                for fd in pidfds:
                    os.close(fd)
                self._stop(running)  # a refusal would repeat: a later launch starts another
                raise ZygoteError(f"runner zygote refused: {reply.get('why')}")
            return ForkedRunner(pid, pidfds[0])

    def _is_ready(self, running: _Running) -> bool:
        """Whether its ``ready`` has come (without waiting); ``ZygoteError`` if it died."""
        if running.process.poll() is not None:
            raise ZygoteError(f"exited ({running.process.returncode}) before it was ready")
        try:
            reply, fds = self._receive(running, timeout_s=0)
        except TimeoutError:
            return False
        for fd in fds:
            os.close(fd)
        if reply.get("op") != "ready":
            raise ZygoteError(f"said {reply!r} before ready")
        return True

    @staticmethod
    def _receive(running: _Running, *, timeout_s: float) -> tuple[dict[str, object], list[int]]:
        ready = select.poll()
        ready.register(running.sock.fileno(), select.POLLIN)
        if not ready.poll(int(timeout_s * 1000)):
            raise TimeoutError("no reply from the runner zygote")
        data, fds, _, _ = socket.recv_fds(running.sock, 4096, 1, socket.MSG_CMSG_CLOEXEC)
        if not data:
            raise ZygoteError("the runner zygote closed its socket")
        message = json.loads(data)
        if not isinstance(message, dict):
            raise ZygoteError(f"not a message: {message!r}")
        return message, fds

    def _stop(self, running: _Running) -> None:
        """Close its socket (it exits on EOF), then SIGKILL it if it lingers; reap it."""
        self._running = None
        running.sock.close()
        try:
            running.process.wait(timeout=2)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(running.process.pid, signal.SIGKILL)  # our unreaped child: its pid
            running.process.wait()

    async def aclose(self) -> None:
        """Stop the zygote (idempotent); runners it forked run on."""
        await anyio.to_thread.run_sync(self._close)

    def _close(self) -> None:
        with self._lock:
            self._closed = True
            if self._running is not None:
                self._stop(self._running)


def _die_with_parent() -> None:
    _libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
