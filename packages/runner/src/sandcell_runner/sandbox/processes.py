"""A session's interactive processes: any argv, stdin, signals, a PTY, reattachable.

What an envd-style API needs beyond ``apps/processes.py`` (tagged dev servers
with a line log): each process is ``cmd args…`` under the sandbox init
(``init.py``) in its own nsjail, in the session's workspace (seen as
``/home/user``), UID and network namespace, with the same jail launch, job
directories, limits and path checks as the app processes. It gets a small
runner-assigned pid (host pids never leave the runner), an optional tag, a
stdin pipe and, when asked, a terminal allocated inside the jail.

Output is not kept: it goes to whoever is subscribed when it is produced (the
stream that started the process, and any stream reattached by pid or tag).
Each subscriber has a bounded queue; one that falls that far behind is dropped
(its stream ends), never buffered without bound. A process lives until it
exits, is signalled, reaches its ``timeout_ms`` or the session is released;
closing a stream does not stop it. Ended processes leave the table at once.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import itertools
import logging
import os
import signal
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

from sandcell_protocol import ProtocolError
from sandcell_protocol import sandbox_messages as sm

from ..cancelling import to_thread_to_the_end
from ..config import MIB, RunnerSettings
from ..errors import BadRequestError, InvalidPathError, NotFoundError
from ..jail.fdio import write_all
from ..jail.launched import LaunchedJob, LaunchOutcome
from ..jail.nsjail import Jail
from ..jail.spec import JobLimits, JobSpec
from ..jail.stopping import end_within
from ..workspace.cwd import require_dir
from ..workspace.manager import WorkspaceManager
from .env import process_env
from .events import SIGNALS, Subscriber, ended, read_report
from .init import INIT_SOURCE

log = logging.getLogger(__name__)

_READ_BYTES = 65536
_STOP_GRACE_S = 3.0


@dataclass(frozen=True, slots=True)
class SandboxTarget:
    """Where a process runs: the session's workspace, UID and network namespace."""

    workspace: Path
    uid: int
    netns_fd: int | None


@dataclass(eq=False)
class _Process:
    pid: int
    info: sm.SandboxProcessInfo
    job_dir: Path
    job: LaunchedJob | None = None
    stdin_fd: int | None = None
    control_fd: int | None = None
    sent: str | None = None
    ended: sm.ProcessEnded | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    subscribers: set[Subscriber] = field(default_factory=set)
    monitor: asyncio.Task[None] | None = None
    timer: asyncio.TimerHandle | None = None

    def publish(self, event: sm.ProcessEvent | None) -> None:
        for sub in list(self.subscribers):
            if not sub.offer(event):
                self.subscribers.discard(sub)


class SandboxProcesses:
    """The interactive processes of one session (a runner holds at most one)."""

    def __init__(
        self,
        settings: RunnerSettings,
        *,
        jail: Jail,
        workspaces: WorkspaceManager,
        python: str,
        max_running: int = 64,
        new_pid: Callable[[], int] | None = None,
    ) -> None:
        self._settings = settings
        self._jail = jail
        self._workspaces = workspaces
        self._python = python
        self._max_running = max_running
        counter = itertools.count(1000)
        self._new_pid = new_pid or (lambda: next(counter))
        self._procs: dict[int, _Process] = {}
        self._background: set[asyncio.Task[None]] = set()

    # -- queries ----------------------------------------------------------------

    def list(self) -> list[sm.SandboxProcessInfo]:
        """The running processes, oldest first."""
        return [proc.info for proc in self._procs.values() if not proc.done.is_set()]

    def _find(self, pid: int) -> _Process:
        proc = self._procs.get(pid)
        if proc is None or proc.done.is_set():
            raise NotFoundError(f"process with pid {pid} not found")
        return proc

    def pid_of_tag(self, tag: str) -> int:
        """The running process tagged ``tag``; ``NotFoundError`` if none."""
        for proc in self._procs.values():
            if proc.info.tag == tag and not proc.done.is_set():
                return proc.pid
        raise NotFoundError(f"process with tag {tag[:80]!r} not found")

    def keep_paths(self) -> set[Path]:
        """Job directories of processes not yet finished (the reaper must skip them)."""
        return {proc.job_dir for proc in self._procs.values() if not proc.done.is_set()}

    # -- start ------------------------------------------------------------------

    async def start(
        self, request: sm.SandboxProcessStart, target: SandboxTarget, *, timeout_ms: int | None
    ) -> AsyncIterator[sm.ProcessEvent]:
        """Launch ``request``; its events (``ProcessStarted`` first) as an iterator.

        Raises before the iterator is returned when the process cannot start.
        """
        if len(self.list()) >= self._max_running:
            raise BadRequestError(f"at most {self._max_running} processes may run at once")
        if request.tag is not None:
            with contextlib.suppress(NotFoundError):
                self.pid_of_tag(request.tag)
                raise BadRequestError(f"a process tagged {request.tag[:80]!r} is running")
        # Jailed, the workspace is also reachable as /home/user (a link the jail makes).
        home = sm.SANDBOX_HOME if self._jail.jailed else str(target.workspace)
        env = process_env(request.envs, home=home)
        relative = await self._cwd(request.cwd, target.workspace)
        cwd_inside = f"{home}/{relative}" if relative else home
        # A shell's pwd then names /home/user, not the link's target.
        env.setdefault("PWD", cwd_inside)
        job_dir = await to_thread_to_the_end(
            self._workspaces.create_session_job_dir, undo=self._workspaces.remove_dir
        )
        pid = self._new_pid()
        proc = _Process(
            pid=pid,
            info=sm.SandboxProcessInfo(
                pid=pid,
                cmd=request.cmd,
                args=list(request.args),
                envs=dict(request.envs),
                cwd=request.cwd,
                tag=request.tag,
                pty=request.pty is not None,
            ),
            job_dir=job_dir,
        )
        subscriber = Subscriber()
        proc.subscribers.add(subscriber)
        try:
            await self._launch(proc, request, target, env, cwd_inside, timeout_ms)
        except BaseException:
            await to_thread_to_the_end(functools.partial(self._workspaces.remove_dir, job_dir))
            raise
        self._procs[pid] = proc
        log.info("sandbox process %d started", pid)
        return self._events(proc, subscriber, started=True)

    def attach(self, pid: int) -> AsyncIterator[sm.ProcessEvent]:
        """Events of a running process from now on (``ProcessStarted`` first)."""
        proc = self._find(pid)
        subscriber = Subscriber()
        proc.subscribers.add(subscriber)
        return self._events(proc, subscriber, started=True)

    async def _events(
        self, proc: _Process, subscriber: Subscriber, *, started: bool
    ) -> AsyncIterator[sm.ProcessEvent]:
        try:
            if started:
                yield sm.ProcessStarted(pid=proc.pid)
            while True:
                event = await subscriber.queue.get()
                if event is None:
                    if subscriber.dropped:
                        yield sm.ProcessEnded(
                            exit_code=None,
                            status="stream dropped",
                            error="the client fell too far behind the process's output",
                        )
                    return
                yield event
                if isinstance(event, sm.ProcessEnded):
                    return
        finally:
            proc.subscribers.discard(subscriber)

    async def _cwd(self, cwd: str | None, workspace: Path) -> str:
        if cwd is None:
            return ""
        try:
            relative = sm.sandbox_path(cwd)
        except ProtocolError as exc:
            raise InvalidPathError(f"invalid cwd: {exc}") from None
        if not relative:
            return ""
        return await require_dir(workspace, relative, shown=cwd[:200])

    async def _launch(
        self,
        proc: _Process,
        request: sm.SandboxProcessStart,
        target: SandboxTarget,
        env: dict[str, str],
        cwd_inside: str,
        timeout_ms: int | None,
    ) -> None:
        stdin_r, stdin_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        control_r, control_w = os.pipe()
        report_r, report_w = os.pipe()
        keep = [stdin_w, out_r, err_r, control_w, report_r]
        mode = "pipe" if request.pty is None else f"{request.pty.cols}x{request.pty.rows}"
        argv = [self._python, "-I", "-S", "-c", INIT_SOURCE]
        argv += [str(report_w), str(err_w), str(control_r), cwd_inside, mode]
        argv += [request.cmd, *request.args]
        try:
            spec = JobSpec(
                argv=argv,
                workspace=target.workspace,
                job_dir=proc.job_dir,
                uid=target.uid,
                gid=target.uid,
                env=env,
                limits=self._limits(timeout_ms),
                network=self._settings.allow_network,
                netns_fd=target.netns_fd,
                long_running=True,
                pass_fds=(report_w, err_w, control_r),
                home_link=sm.SANDBOX_HOME,
                devpts=request.pty is not None,
            )
            proc.job = await self._jail.launch(spec, stdin_fd=stdin_r, output_fd=out_w)
        except BaseException:
            for fd in keep:
                os.close(fd)
            raise
        finally:
            for fd in (stdin_r, out_w, err_w, control_r, report_w):
                os.close(fd)
        if request.stdin or request.pty is not None:
            os.set_blocking(stdin_w, False)
            proc.stdin_fd = stdin_w
        else:
            os.close(stdin_w)
        os.set_blocking(control_w, False)
        proc.control_fd = control_w
        loop = asyncio.get_running_loop()
        streams_open = {out_r: "pty" if request.pty is not None else "stdout", err_r: "stderr"}
        all_read = asyncio.Event()

        def reader(fd: int) -> Callable[[], None]:
            def read() -> None:
                try:
                    data = os.read(fd, _READ_BYTES)
                except BlockingIOError:
                    return
                except OSError:
                    data = b""
                if data:
                    stream = streams_open[fd]
                    text = base64.b64encode(data).decode("ascii")
                    proc.publish(sm.ProcessOutput(stream=stream, data=text))  # type: ignore[arg-type]
                    return
                loop.remove_reader(fd)
                del streams_open[fd]
                if not streams_open:
                    all_read.set()

            return read

        for fd in (out_r, err_r):
            os.set_blocking(fd, False)
            loop.add_reader(fd, reader(fd))
        proc.monitor = asyncio.create_task(
            self._monitor(proc, (out_r, err_r), report_r, all_read),
            name=f"sandcell-sandbox-proc-{proc.pid}",
        )
        if timeout_ms is not None:
            proc.timer = loop.call_later(timeout_ms / 1000, self._on_timeout, proc)

    def _limits(self, timeout_ms: int | None) -> JobLimits:
        conf = self._settings.limits
        return JobLimits(
            timeout_ms=min(timeout_ms or conf.max_timeout_ms, conf.max_timeout_ms),
            memory_bytes=conf.memory_mib * MIB,
            pids=conf.pids,
            stdout_bytes=conf.stdout_bytes,
            stderr_bytes=conf.stderr_bytes,
            file_size_mib=conf.file_size_mib,
            open_files=conf.open_files,
            tmp_mib=conf.tmp_mib,
        )

    def _on_timeout(self, proc: _Process) -> None:
        task = asyncio.ensure_future(self._stop(proc))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _monitor(
        self, proc: _Process, outputs: tuple[int, ...], report_r: int, all_read: asyncio.Event
    ) -> None:
        assert proc.job is not None
        loop = asyncio.get_running_loop()
        outcome: LaunchOutcome | None = None
        try:
            outcome = await proc.job.wait()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(2):
                    await all_read.wait()
        finally:
            for fd in outputs:
                loop.remove_reader(fd)
                os.close(fd)
            report = read_report(report_r)
            for attr in ("stdin_fd", "control_fd"):
                fd = getattr(proc, attr)
                if fd is not None:
                    os.close(fd)
                    setattr(proc, attr, None)
            if proc.timer is not None:
                proc.timer.cancel()
            proc.ended = ended(proc.sent, outcome, report)
            proc.done.set()
            proc.publish(proc.ended)
            proc.publish(None)
            self._procs.pop(proc.pid, None)
            log.info("sandbox process %d ended (%s)", proc.pid, proc.ended.status)
            await to_thread_to_the_end(functools.partial(self._workspaces.remove_dir, proc.job_dir))

    # -- input, signals, terminal --------------------------------------------------------

    async def write_input(self, pid: int, data: bytes) -> None:
        """Write to the process's stdin (its terminal, for a PTY process)."""
        proc = self._find(pid)
        fd = proc.stdin_fd
        if fd is None:
            raise BadRequestError(f"process {pid} has no open stdin (start it with stdin)")
        try:
            await write_all(fd, data)
        except TimeoutError:
            raise BadRequestError(f"process {pid} is not reading its stdin") from None
        except BrokenPipeError:
            raise BadRequestError(f"process {pid} closed its stdin") from None

    def close_stdin(self, pid: int) -> None:
        """Close the process's stdin (EOF); idempotent."""
        proc = self._find(pid)
        if proc.info.pty:
            raise BadRequestError("a PTY process has no stdin to close; send Ctrl-D (0x04)")
        if proc.stdin_fd is not None:
            os.close(proc.stdin_fd)
            proc.stdin_fd = None

    def signal(self, pid: int, name: sm.SignalName) -> None:
        """Send ``name`` to the process's group (SIGKILL also ends its whole jail)."""
        proc = self._find(pid)
        proc.sent = name
        self._control(proc, f"s {int(SIGNALS[name])}\n")
        if name == "SIGKILL" and proc.job is not None:
            proc.job.kill()

    def resize(self, pid: int, size: sm.PtySize) -> None:
        """Resize the process's terminal (the kernel sends it SIGWINCH)."""
        proc = self._find(pid)
        if not proc.info.pty:
            raise BadRequestError(f"process {pid} has no terminal")
        self._control(proc, f"r {size.cols} {size.rows}\n")

    @staticmethod
    def _control(proc: _Process, line: str) -> None:
        if proc.control_fd is None:
            return
        with contextlib.suppress(BlockingIOError, BrokenPipeError):
            os.write(proc.control_fd, line.encode("ascii"))

    # -- stopping ----------------------------------------------------------------------

    async def _stop(self, proc: _Process) -> None:
        if proc.done.is_set() or proc.job is None:
            return
        job = proc.job
        proc.sent = "SIGTERM"
        self._control(proc, f"s {int(signal.SIGTERM)}\n")

        def kill() -> None:
            proc.sent = "SIGKILL"
            job.kill()

        await end_within(proc.done, grace_s=_STOP_GRACE_S, kill=kill)

    async def stop_all(self) -> None:
        """Stop every running process (release, shutdown); waits for them to end."""
        running = [p for p in self._procs.values() if not p.done.is_set()]
        await asyncio.gather(*(self._stop(p) for p in running), return_exceptions=True)
        for proc in running:
            if proc.monitor is not None:
                with contextlib.suppress(BaseException):
                    await proc.monitor


__all__ = ["SandboxProcesses", "SandboxTarget"]
