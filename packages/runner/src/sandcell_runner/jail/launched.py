"""A job that outlives the request that started it (``Jail.launch``): signal it, wait for it.

Kept apart from ``nsjail.py``, which builds the nsjail command line; reading nsjail's
log for the job's own status is passed in (``status_of``) so nsjail's log format
stays known to that module alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass

from ..cancelling import to_thread_to_the_end
from .job_cgroup import JobCgroup
from .outcome import decode_status, warnings_only
from .spawner import SpawnedProcess

StatusReader = Callable[[str, int], tuple[int | None, str | None, bool]]
"""(jail log, wait status) -> (exit code, signal name, whether the jail never said)."""

_LOG_TAIL_BYTES = 65536


@dataclass(frozen=True, slots=True)
class LaunchOutcome:
    """How a launched job ended.

    ``jail_failed``: nsjail never reported the job's end (it was killed, or could
    not start the job; ``jail_log`` then says why).
    """

    exit_code: int | None
    signal: str | None
    jail_failed: bool
    oom_killed: bool
    jail_log: str


class LaunchedJob:
    """A running job; ``wait`` once, ``signal``/``kill`` any time (idempotent)."""

    def __init__(
        self,
        process: SpawnedProcess,
        cgroup: JobCgroup | None,
        log_fd: int,
        *,
        status_of: StatusReader | None,
    ) -> None:
        self.process = process
        self._cgroup = cgroup
        self._log_fd = log_fd
        self._status_of = status_of
        self._log_tail = b""
        self._log_eof = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        os.set_blocking(log_fd, False)
        # Drained as it comes (a full pipe would stall nsjail); only the tail matters.
        self._loop.add_reader(log_fd, self._drain_log)

    @property
    def pid(self) -> int:
        return self.process.pid

    def _drain_log(self) -> None:
        try:
            data = os.read(self._log_fd, 65536)
        except BlockingIOError:
            return
        if not data:
            self._loop.remove_reader(self._log_fd)
            self._log_eof.set()
            return
        self._log_tail = (self._log_tail + data)[-_LOG_TAIL_BYTES:]

    def signal(self, signum: int) -> None:
        """Deliver ``signum``: nsjail forwards fatal signals to the job (unjailed: the group)."""
        self.process.send_signal(signum, group=self._status_of is None)

    def kill(self) -> None:
        """SIGKILL nsjail, the job, and everything left in the job's cgroup."""
        self.process.send_signal(signal.SIGKILL, group=True)
        if self._cgroup is not None:
            self._cgroup.kill_all()

    async def wait(self) -> LaunchOutcome:
        """Wait for the end, then release the log pipe and the cgroup."""
        try:
            status, _ = await self.process.wait()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(2):
                    await self._log_eof.wait()
        except BaseException:
            self.kill()
            with contextlib.suppress(ChildProcessError):
                await asyncio.shield(self.process.wait())
            raise
        finally:
            self._loop.remove_reader(self._log_fd)
            os.close(self._log_fd)
            oom_killed = False
            if self._cgroup is not None:
                # One hop, to its end: a second cancellation during the stats' read
                # skipped the destroy, and the cgroup stayed for the runner's life.
                oom_killed = await to_thread_to_the_end(functools.partial(_settle, self._cgroup))
        log_text = self._log_tail.decode("utf-8", "replace")
        if self._status_of is not None:
            exit_code, signame, failed = self._status_of(log_text, status)
        else:
            exit_code, signame = decode_status(status)
            failed = False
        return LaunchOutcome(
            exit_code=exit_code,
            signal=signame,
            jail_failed=failed,
            oom_killed=oom_killed,
            jail_log=warnings_only(log_text),
        )


def _settle(cgroup: JobCgroup) -> bool:
    """Whether the job was OOM-killed; the cgroup destroyed."""
    try:
        return cgroup.stats().oom_killed
    finally:
        cgroup.destroy()


__all__ = ["LaunchOutcome", "LaunchedJob", "StatusReader"]
