"""The runner's side of the extractor fork server (``extractor_server.py``).

A restore used to wait for a fresh extractor (an interpreter start plus ~85
CPU-ms of imports), or take a spare started ahead and then start the next spare
(~155 CPU-ms a restore, competing with the restores and jobs after it on a small
machine). Now one server, imported once per runner, forks a child per restore
(~1 ms): measured A/B in ``scripts/bench_checkpoint.py --small``. Each child
jails itself exactly as a fresh extractor did (``extractor_child.serve``).

Everything here runs on the event loop: the socket is read by ``add_reader``;
requests are small datagrams the server drains at once. The server is started
with ``subprocess.Popen`` from the loop's thread (vfork: no ``preexec_fn``) and
sets its own death signal towards the runner; it imports at nice 19 (a runner's
start-up and first job need the CPU more) and is put back to 0 when it is ready
or a restore waits for it. A server that was lost (killed, OOM) is restarted by
the next restore.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence

import anyio
import msgspec

from ..errors import ArchiveRejectedError
from ..jail.capabilities import CAP_SYS_NICE, holds
from ..jail.helper_socket import PendingRequests, helper_socketpair, stop_reading
from . import extractor_prefork, extractor_server
from .extractor_child import ExtractorArgs
from .extractor_server import ForkRequest, Reply

log = logging.getLogger(__name__)

_SPARE_NICE = 19
_KILLED = -signal.SIGKILL
"""The exit code reported for a child whose server was lost (it died with it)."""

_ARGV = (
    sys.executable,
    "-I",  # no cwd, user site or PYTHON* variables on sys.path
    "-X",
    "utf8",
    "-m",
    "sandcell_runner.checkpoint.extractor_server",
)
_decode_reply = msgspec.json.Decoder(Reply).decode
_Forked = tuple[Reply, list[int], "asyncio.Future[int]"]
"""The server's answer to a request, its pidfd (if forked) and the child's exit to come."""


class ServerLostError(ArchiveRejectedError):
    """The fork server went away before it forked the child (a retry starts a new one)."""


class ExtractorProcess:
    """One forked extractor child: its pidfd, its verdict and stderr pipes, its exit."""

    def __init__(
        self, pid: int, pidfd: int, stdout: int, stderr: int, exit_code: asyncio.Future[int]
    ) -> None:
        self.pid = pid
        self._pidfd = pidfd
        self.stdout_fd = stdout
        self.stderr_fd = stderr
        self._exit_code = exit_code
        self._closed = False

    def kill(self) -> None:
        """SIGKILL the child unless it is gone (a pidfd never names another process)."""
        if not self._exit_code.done() and not self._closed:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)

    async def wait(self) -> int:
        """The child's exit code (negative: killed by that signal), as its server saw it."""
        if not self._exit_code.done():
            await anyio.wait_readable(self._pidfd)
        return await asyncio.shield(self._exit_code)

    def close(self) -> None:
        """Release the descriptors; idempotent."""
        if self._closed:
            return
        self._closed = True
        for fd in (self.stdout_fd, self.stderr_fd, self._pidfd):
            os.close(fd)


class ExtractorServer:
    """One fork server per runner: started ahead, restarted when lost, stopped by ``aclose``."""

    def __init__(self) -> None:
        self._process: subprocess.Popen[bytes] | extractor_prefork.PreforkedServer | None = None
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Future[None] | None = None
        self._pending: PendingRequests[_Forked] = PendingRequests()
        self._exits: dict[int, asyncio.Future[int]] = {}
        self._closed = False

    @property
    def pid(self) -> int | None:
        """The server's pid while it runs."""
        return self._process.pid if self._process is not None else None

    def start(self) -> None:
        """Start the server unless it runs; needs a running loop. The first one of a
        runner forked from the zygote was forked already (``extractor_prefork.py``)."""
        if self._sock is not None or self._closed:
            return
        loop = asyncio.get_running_loop()
        preforked = extractor_prefork.take()
        if preforked is not None:
            self._process, ours = preforked, preforked.sock  # its imports are done
        else:
            ours = self._launch()
        ours.setblocking(False)
        self._sock = ours
        self._loop = loop
        self._ready = loop.create_future()
        loop.add_reader(ours.fileno(), self._on_readable)
        if preforked is None:
            self._set_nice(_SPARE_NICE)

    def _launch(self) -> socket.socket:
        with helper_socketpair() as (ours, theirs):
            self._process = subprocess.Popen(
                [*_ARGV, str(os.getpid())],
                stdin=theirs.fileno(),
                stdout=subprocess.DEVNULL,
                cwd="/",
                env={},
                close_fds=True,
                start_new_session=True,
            )
        return ours

    async def extract(self, args: ExtractorArgs, fds: Sequence[int]) -> ExtractorProcess:
        """Fork a child for one restore: ``fds`` are the archive pipe, the staging
        directory and the cgroup files, in that order (``extractor_child.Request``)."""
        if self._closed:
            raise ArchiveRejectedError("the extractor server is stopped")
        self.start()
        assert self._ready is not None
        if not self._ready.done():
            self._set_nice(0)  # a restore waits for it now
        await asyncio.shield(self._ready)
        stdout_r, stdout_w = os.pipe2(os.O_CLOEXEC)
        stderr_r, stderr_w = os.pipe2(os.O_CLOEXEC)
        try:
            reply, pidfds, exit_code = await self._request(args, [stdout_w, stderr_w, *fds])
        except BaseException:
            os.close(stdout_r)
            os.close(stderr_r)
            raise
        finally:
            os.close(stdout_w)
            os.close(stderr_w)
        if reply.op != "forked" or reply.pid is None or len(pidfds) != 1:
            for fd in (stdout_r, stderr_r, *pidfds):
                os.close(fd)
            raise ArchiveRejectedError(f"the extractor could not be started: {reply.why}")
        os.set_blocking(stdout_r, False)
        os.set_blocking(stderr_r, False)
        return ExtractorProcess(reply.pid, pidfds[0], stdout_r, stderr_r, exit_code)

    async def _request(self, args: ExtractorArgs, fds: list[int]) -> _Forked:
        sock = self._sock
        if sock is None:
            raise ServerLostError("the extractor server exited")
        seq = self._pending.next_seq()
        data = msgspec.json.encode(ForkRequest(seq=seq, args=args))
        return await self._pending.send(
            sock,
            seq,
            data,
            fds,
            unreachable=lambda exc: ServerLostError(f"the extractor server is unreachable: {exc}"),
            # The server forks it anyway: kill it the moment it is known.
            kill_when_answered=_kill_when_forked,
        )

    def _on_readable(self) -> None:
        sock = self._sock
        while sock is not None and self._sock is sock:
            fds: list[int]
            try:
                data, fds, _, _ = socket.recv_fds(
                    sock, extractor_server.MAX_MESSAGE_BYTES, 4, socket.MSG_CMSG_CLOEXEC
                )
            except BlockingIOError:
                return
            except OSError:
                data, fds = b"", []
            if not data:
                for fd in fds:
                    os.close(fd)
                self._lost()
                return
            self._dispatch(_decode_reply(data), fds)

    def _dispatch(self, reply: Reply, fds: list[int]) -> None:
        if reply.op == "ready":
            self._set_nice(0)
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(None)
        elif reply.op == "exited" and reply.pid is not None and reply.status is not None:
            future = self._exits.pop(reply.pid, None)
            if future is not None and not future.done():
                future.set_result(os.waitstatus_to_exitcode(reply.status))
            return
        # A child's exit always follows its ``forked``: the future waits here for it.
        exit_code: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        if reply.op == "forked" and reply.pid is not None:
            self._exits[reply.pid] = exit_code
        pending = self._pending.pop(reply.seq)
        if pending is not None and not pending.done():
            pending.set_result((reply, fds, exit_code))
        else:
            for fd in fds:
                os.close(fd)

    def _lost(self) -> None:
        """The server is gone: its children too (their death signal); tell every waiter."""
        if self._sock is not None:
            stop_reading(self._sock, self._loop)
            self._sock = None
        process, self._process = self._process, None
        if process is not None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            if self._loop is not None and not self._loop.is_closed():
                self._loop.run_in_executor(None, process.wait)
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(ServerLostError("the extractor server did not start"))
            self._ready.exception()  # retrieved: nobody may be waiting
        self._ready = None
        self._pending.fail_all(lambda: ServerLostError("the extractor server exited"))
        exits, self._exits = self._exits, {}
        for exit_code in exits.values():
            if not exit_code.done():
                exit_code.set_result(_KILLED)

    async def aclose(self) -> None:
        """Stop the server (its children, if any, die with it); later calls start none."""
        self._closed = True
        process = self._process
        self._lost()
        if process is not None:
            await anyio.to_thread.run_sync(process.wait)

    def _set_nice(self, nice: int) -> None:
        process = self._process
        if process is not None and _may_renice():
            with contextlib.suppress(ProcessLookupError):
                os.setpriority(os.PRIO_PROCESS, process.pid, nice)


def _kill_when_forked(future: asyncio.Future[_Forked]) -> None:
    if future.cancelled() or future.exception() is not None:
        return
    _, fds, _ = future.result()
    for fd in fds:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        os.close(fd)


@functools.cache
def _may_renice() -> bool:
    """Whether a server lowered to nice 19 can be raised back when it is ready.

    That takes CAP_SYS_NICE, which a container's root lacks unless granted; without
    it the server keeps the runner's priority rather than forking restores at 19.
    """
    return os.geteuid() == 0 and holds(CAP_SYS_NICE)


__all__ = ["ExtractorProcess", "ExtractorServer", "ServerLostError"]
