"""A session's long-running jailed process: launched, read, reaped and stopped one way.

Both kinds of session process, the tagged app processes (``apps/processes.py``)
and the interactive sandbox processes (``sandbox/processes.py``), are a command
under an init (PID 1 of its own nsjail, ``long_running``) in the session's
workspace, UID and network namespace, with a job directory of its own. What they
share lives here, so the two cannot drift apart on the parts that keep the
runner safe:

- fd hygiene at launch (``LaunchPipes``): the child's ends are closed once the
  jail has them, ours too when the launch fails;
- the output pipes, read on the loop until each reaches EOF (``read_outputs``);
- the init's exit report (``read_report``: ``exit N`` / ``signal N``, written by
  ``apps/procinit.py`` and ``sandbox/init.py``);
- reaping (``supervise``): the job is waited, its output drained a bounded while,
  every descriptor closed, its timer cancelled and its job directory removed,
  even when the supervising task is cancelled;
- stopping (``stop``): the caller's polite signal, then SIGKILL to the whole jail
  after the grace.

What each kind does with its output and its end (a line log, or events to
subscribers) stays with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from sandcell_protocol.digits import is_ascii_digits

from .cancelling import to_thread_to_the_end
from .config import LimitSettings
from .errors import BadRequestError
from .jail.fdio import write_all
from .jail.launched import LaunchedJob, LaunchOutcome
from .jail.spec import JobLimits, JobSpec
from .jail.stopping import end_within
from .workspace.manager import WorkspaceManager

Report = tuple[int | None, int | None]
"""(exit code, signal number) from the init's report; (None, None) when it wrote none."""

OUTPUT_DRAIN_S = 2.0
"""How long output may still be read after the job ended (a grandchild may hold a pipe)."""

_READ_BYTES = 65536


@dataclass(frozen=True, slots=True)
class SessionTarget:
    """Where a process runs: the session's workspace, UID and network namespace."""

    workspace: Path
    uid: int
    netns_fd: int | None

    def job_spec(
        self,
        *,
        argv: list[str],
        job_dir: Path,
        env: dict[str, str],
        limits: JobLimits,
        network: bool,
        pass_fds: Sequence[int],
        home_link: str | None = None,
        devpts: bool = False,
    ) -> JobSpec:
        """The jail spec of a long-running process here (its GID is its UID)."""
        return JobSpec(
            argv=argv,
            workspace=self.workspace,
            job_dir=job_dir,
            uid=self.uid,
            gid=self.uid,
            env=env,
            limits=limits,
            network=network,
            netns_fd=self.netns_fd,
            long_running=True,
            pass_fds=pass_fds,
            home_link=home_link,
            devpts=devpts,
        )


@dataclass(eq=False, slots=True)
class SessionProcess:
    """What every session process has: its job directory, job, stdin, timer and end."""

    job_dir: Path
    job: LaunchedJob | None = None
    stdin_fd: int | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    monitor: asyncio.Task[None] | None = None
    timer: asyncio.TimerHandle | None = None

    def close_stdin(self) -> None:
        """Close our end of its stdin (EOF to the process); idempotent."""
        if self.stdin_fd is not None:
            os.close(self.stdin_fd)
            self.stdin_fd = None


_P = TypeVar("_P", bound=SessionProcess)


class LaunchPipes:
    """The pipes of one launch: ``with`` it around the launch.

    On leaving, the child's ends are closed (the jail holds its own copies); when
    the launch raised, ours are closed too, so a failed start leaks nothing.
    """

    def __init__(self) -> None:
        self._ours: list[int] = []
        self._theirs: list[int] = []

    def to_child(self) -> tuple[int, int]:
        """A pipe the child reads: (our write end, its read end)."""
        read, write = os.pipe()
        self._ours.append(write)
        self._theirs.append(read)
        return write, read

    def from_child(self) -> tuple[int, int]:
        """A pipe the child writes: (our read end, its write end)."""
        read, write = os.pipe()
        self._ours.append(read)
        self._theirs.append(write)
        return read, write

    def __enter__(self) -> LaunchPipes:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        try:
            if kind is not None:
                for fd in self._ours:
                    os.close(fd)
        finally:
            for fd in self._theirs:
                os.close(fd)


class Outputs:
    """A process's output pipes, read on the loop until each reaches EOF."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fds: Sequence[int]) -> None:
        self._loop = loop
        self.fds = tuple(fds)
        self.all_read = asyncio.Event()

    async def drain(self, *, timeout_s: float = OUTPUT_DRAIN_S) -> None:
        """Wait up to ``timeout_s`` for every pipe to reach EOF."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self.all_read.wait()

    def close(self) -> None:
        """Stop reading and close every pipe (the process has been reaped)."""
        for fd in self.fds:
            self._loop.remove_reader(fd)
            os.close(fd)


def read_outputs(handlers: Mapping[int, Callable[[bytes], None]]) -> Outputs:
    """Read each pipe (non-blocking, on the running loop) into its handler until EOF."""
    loop = asyncio.get_running_loop()
    outputs = Outputs(loop, list(handlers))
    open_fds = set(handlers)

    def reader(fd: int, handle: Callable[[bytes], None]) -> Callable[[], None]:
        def read() -> None:
            try:
                data = os.read(fd, _READ_BYTES)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if data:
                handle(data)
                return
            loop.remove_reader(fd)
            open_fds.discard(fd)
            if not open_fds:
                outputs.all_read.set()

        return read

    for fd, handle in handlers.items():
        os.set_blocking(fd, False)
        loop.add_reader(fd, reader(fd, handle))
    return outputs


def parse_report(text: str) -> Report | None:
    """(exit code, signal number) from the init's report; None when it wrote none."""
    kind, _, value = text.strip().partition(" ")
    if not is_ascii_digits(value, max_length=10):
        return None
    if kind == "exit":
        return int(value), None
    if kind == "signal":
        return None, int(value)
    return None


def read_report(fd: int) -> Report:
    """The init's report from its pipe (closed here); (None, None) when it wrote none."""
    try:
        os.set_blocking(fd, False)
        text = os.read(fd, 256).decode("ascii", "replace")
    except OSError:
        text = ""
    finally:
        os.close(fd)
    return parse_report(text) or (None, None)


async def new_job_dir(workspaces: WorkspaceManager) -> Path:
    """A fresh session job directory (removed again if the caller is cancelled)."""
    return await to_thread_to_the_end(workspaces.create_session_job_dir, undo=workspaces.remove_dir)


async def remove_job_dir(workspaces: WorkspaceManager, job_dir: Path) -> None:
    """Remove a job directory, to the end even when the caller is cancelled."""
    await to_thread_to_the_end(functools.partial(workspaces.remove_dir, job_dir))


async def supervise(
    proc: SessionProcess,
    outputs: Outputs,
    report_r: int,
    *,
    workspaces: WorkspaceManager,
    finish: Callable[[LaunchOutcome | None, Report], None],
) -> None:
    """Wait for ``proc``'s job to end, then reap it: ``finish`` gets what the jail
    saw (None if this task was cancelled first) and the init's report."""
    assert proc.job is not None
    outcome: LaunchOutcome | None = None
    try:
        outcome = await proc.job.wait()
        await outputs.drain()
    finally:
        outputs.close()
        report = read_report(report_r)
        proc.close_stdin()
        if proc.timer is not None:
            proc.timer.cancel()
        finish(outcome, report)
        await remove_job_dir(workspaces, proc.job_dir)


def supervise_soon(
    proc: SessionProcess,
    outputs: Outputs,
    report_r: int,
    *,
    workspaces: WorkspaceManager,
    finish: Callable[[LaunchOutcome | None, Report], None],
    name: str,
) -> None:
    """Start ``supervise`` as ``proc``'s monitor task, named ``name``."""
    proc.monitor = asyncio.create_task(
        supervise(proc, outputs, report_r, workspaces=workspaces, finish=finish), name=name
    )


async def stop(
    proc: SessionProcess, *, grace_s: float, term: Callable[[], None], kill: Callable[[], None]
) -> None:
    """``term`` (the caller's polite signal), then ``kill`` past ``grace_s``; no-op once ended."""
    if proc.done.is_set() or proc.job is None:
        return
    term()
    await end_within(proc.done, grace_s=grace_s, kill=kill)


async def stop_all(procs: Iterable[_P], stop_one: Callable[[_P], Awaitable[None]]) -> None:
    """Stop every running process of ``procs``; waits for each to be reaped."""
    running = [p for p in procs if not p.done.is_set()]
    await asyncio.gather(*(stop_one(p) for p in running), return_exceptions=True)
    for proc in running:
        if proc.monitor is not None:
            with contextlib.suppress(BaseException):
                await proc.monitor


async def write_stdin(fd: int, data: bytes, *, shown: str) -> None:
    """Write ``data`` to a process's stdin; ``BadRequestError`` naming ``shown`` when
    it does not read it or has closed it."""
    try:
        await write_all(fd, data)
    except TimeoutError:
        raise BadRequestError(f"process {shown} is not reading its stdin") from None
    except BrokenPipeError:
        raise BadRequestError(f"process {shown} closed its stdin") from None


def job_limits(
    conf: LimitSettings, *, timeout_ms: int | None, memory_bytes: int, pids: int
) -> JobLimits:
    """A session process's limits: ``timeout_ms`` capped by the runner's, the rest its own."""
    return JobLimits(
        timeout_ms=min(timeout_ms or conf.max_timeout_ms, conf.max_timeout_ms),
        memory_bytes=memory_bytes,
        pids=pids,
        stdout_bytes=conf.stdout_bytes,
        stderr_bytes=conf.stderr_bytes,
        file_size_mib=conf.file_size_mib,
        open_files=conf.open_files,
        tmp_mib=conf.tmp_mib,
    )


__all__ = [
    "OUTPUT_DRAIN_S",
    "LaunchPipes",
    "Outputs",
    "Report",
    "SessionProcess",
    "SessionTarget",
    "job_limits",
    "new_job_dir",
    "parse_report",
    "read_outputs",
    "read_report",
    "remove_job_dir",
    "stop",
    "stop_all",
    "supervise",
    "supervise_soon",
    "write_stdin",
]
