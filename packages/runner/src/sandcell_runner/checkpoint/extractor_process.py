"""Extractor child processes, started ahead of the restore each one serves.

A restore of a small checkpoint used to wait ~200 ms for its extractor: an
interpreter start plus ~85 CPU-ms of imports, then the jail. Now one spare
(``WarmExtractor``) is started ahead and sits, imports done, blocked on its end
of a socketpair; a restore hands it its arguments, the archive's pipe, the
staging directory and the restore cgroup over that socket (SCM_RIGHTS), and the
child jails itself (``extractor.py``, ``confine.py``) before it reads a byte, as
a freshly started one did. Each child serves exactly one restore and exits, and
the spare is replaced after the restore is over (not during it: its imports
would take CPU from the restore on a small machine), so no state outlives a
restore and no session meets another's extractor. A spare imports at nice 19
(a runner's start-up and first job need the CPU more) and is put back to 0
when a restore takes it.

Children are started with ``subprocess.Popen`` in a thread of the event loop's
default executor: forking the runner from the event loop (uvloop's spawn) costs
the loop 2-3 ms. They get ``PR_SET_PDEATHSIG`` (SIGKILL), which follows the
forking *thread*: the default executor's threads live as long as the loop
(anyio's expire after idle, which would kill a long restore). A spare still
importing at nice 19 would otherwise outlive a killed runner until it reached
its socket and read its end.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence

import anyio

from ..jail.capabilities import CAP_SYS_NICE, holds

log = logging.getLogger(__name__)

_SPARE_NICE = 19

_ARGV = (
    sys.executable,
    "-I",  # no cwd, user site or PYTHON* variables on sys.path
    "-X",
    "utf8",
    "-m",
    "sandcell_runner.checkpoint.extractor",
)


class ExtractorProcess:
    """One extractor child: its control socket, its verdict and stderr pipes, its exit."""

    def __init__(
        self, popen: subprocess.Popen[bytes], control: socket.socket, stdout: int, stderr: int
    ) -> None:
        self.popen = popen
        self._control: socket.socket | None = control
        self.stdout_fd = stdout
        self.stderr_fd = stderr
        self._pidfd = os.pidfd_open(popen.pid)
        self._closed = False

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self.popen.pid

    def hand(self, message: bytes, fds: Sequence[int]) -> None:
        """Send the child its one request; raises ``OSError`` if it is gone."""
        if self._control is None:
            raise BrokenPipeError("extractor already handed a request")
        try:
            socket.send_fds(self._control, [message], list(fds))
        finally:
            self._control.close()
            self._control = None

    def set_nice(self, nice: int) -> None:
        """The child's nice value, where the runner may set it (raising it back needs root)."""
        if _may_renice():
            with contextlib.suppress(ProcessLookupError):
                os.setpriority(os.PRIO_PROCESS, self.popen.pid, nice)

    def kill(self) -> None:
        """SIGKILL the child unless it was reaped (the pidfd makes this race-free)."""
        if self.popen.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)

    async def wait(self) -> int:
        """The child's exit status, waited for without a thread."""
        if self.popen.returncode is None:
            await anyio.wait_readable(self._pidfd)
        return self.popen.wait()

    def wait_blocking(self) -> int:
        """``wait`` for a worker thread."""
        return self.popen.wait()

    def close(self) -> None:
        """Release the descriptors (the child must have been waited for, or be left to die)."""
        if self._closed:
            return
        self._closed = True
        if self._control is not None:
            self._control.close()
            self._control = None
        for fd in (self.stdout_fd, self.stderr_fd, self._pidfd):
            os.close(fd)


_libc = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1


def _die_with_runner(runner_pid: int) -> Callable[[], None]:
    def setup() -> None:
        # In the forked child, before exec: a raw syscall, nothing that allocates much.
        if _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            os._exit(126)
        if os.getppid() != runner_pid:  # the runner died between fork and prctl
            os._exit(126)

    return setup


def start_extractor(*, background: bool = False) -> ExtractorProcess:
    """Start one extractor child (blocking: call it from a worker thread).

    ``background``: a spare, whose imports yield the CPU to everything else (a
    runner's start-up and first job above all) until a restore takes it.
    """
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    stdout_r, stdout_w = os.pipe2(os.O_CLOEXEC)
    stderr_r, stderr_w = os.pipe2(os.O_CLOEXEC)
    try:
        popen = subprocess.Popen(
            _ARGV,
            stdin=theirs.fileno(),
            stdout=stdout_w,
            stderr=stderr_w,
            cwd="/",
            env={},
            close_fds=True,
            preexec_fn=_die_with_runner(os.getpid()),
        )
    except BaseException:
        ours.close()
        for fd in (stdout_r, stderr_r):
            os.close(fd)
        raise
    finally:
        theirs.close()
        os.close(stdout_w)
        os.close(stderr_w)
    os.set_blocking(stdout_r, False)
    os.set_blocking(stderr_r, False)
    process = ExtractorProcess(popen, ours, stdout_r, stderr_r)
    if background:
        process.set_nice(_SPARE_NICE)
    return process


@functools.cache
def _may_renice() -> bool:
    """Whether a spare lowered to nice 19 can be raised back when a restore takes it.

    That takes CAP_SYS_NICE, which a container's root lacks unless granted; without
    it the spare keeps the runner's priority rather than holding a restore at 19.
    """
    return os.geteuid() == 0 and holds(CAP_SYS_NICE)


def stop_extractor(process: ExtractorProcess) -> None:
    """Kill, reap and close a child nobody will hand a request (blocking)."""
    process.kill()
    process.wait_blocking()
    process.close()


class ExtractorSource:
    """Where a restore gets its extractor: a fresh one by default."""

    async def take(self) -> ExtractorProcess:
        """An extractor nobody else holds, not yet handed a request."""
        # asyncio's executor, not anyio's: its threads outlive the child (PDEATHSIG).
        return await asyncio.to_thread(start_extractor)

    def done(self) -> None:
        """A restore that took one is over (a pool starts the next spare)."""


class WarmExtractor(ExtractorSource):
    """One spare extractor, started ahead; replaced after each restore that took it.

    Two restores at once (two sessions' locks) get the spare and a fresh one.
    A spare costs an idle interpreter (~20 MiB) per runner.
    """

    def __init__(self) -> None:
        self._spare: asyncio.Task[ExtractorProcess] | None = None
        self._closed = False

    def start(self) -> None:
        """Start the spare (in a worker thread) unless one is there; needs a running loop."""
        if self._spare is None and not self._closed:
            self._spare = asyncio.get_running_loop().create_task(
                asyncio.to_thread(start_extractor, background=True),
                name="sandcell-extractor-spare",
            )

    async def take(self) -> ExtractorProcess:
        spare, self._spare = self._spare, None
        if spare is not None:
            try:
                # Shielded: a cancelled restore must not leave a started child unowned.
                process = await asyncio.shield(spare)
            except asyncio.CancelledError:
                spare.add_done_callback(_stop_when_started)
                raise
            except Exception:
                log.warning("the spare extractor did not start", exc_info=True)
            else:
                if process.popen.poll() is None:
                    process.set_nice(0)  # the restore waits for it now
                    return process
                await anyio.to_thread.run_sync(stop_extractor, process)
        return await super().take()

    def done(self) -> None:
        self.start()

    async def aclose(self) -> None:
        """Stop the spare; later ``done`` calls start none."""
        self._closed = True
        spare, self._spare = self._spare, None
        if spare is None:
            return
        with contextlib.suppress(Exception):
            process = await spare
            await anyio.to_thread.run_sync(stop_extractor, process)


def _stop_when_started(task: asyncio.Task[ExtractorProcess]) -> None:
    if not task.cancelled() and task.exception() is None:
        loop = asyncio.get_running_loop()
        loop.run_in_executor(None, stop_extractor, task.result())


__all__ = ["ExtractorProcess", "ExtractorSource", "WarmExtractor", "start_extractor"]
