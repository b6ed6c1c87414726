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

from .. import session_process
from ..config import MIB, RunnerSettings
from ..errors import BadRequestError, InvalidPathError, NotFoundError
from ..jail.launched import LaunchOutcome
from ..jail.nsjail import Jail
from ..jail.spec import JobLimits
from ..session_process import LaunchPipes, Report, SessionProcess, SessionTarget
from ..workspace.cwd import require_dir
from ..workspace.manager import WorkspaceManager
from .env import process_env
from .events import SIGNALS, Subscriber, dropped_note, ended
from .init import INIT_SOURCE

log = logging.getLogger(__name__)

_STOP_GRACE_S = 3.0


@dataclass(eq=False, kw_only=True)
class _Process(SessionProcess):
    pid: int
    info: sm.SandboxProcessInfo
    control_fd: int | None = None
    sent: str | None = None
    ended: sm.ProcessEnded | None = None
    subscribers: set[Subscriber] = field(default_factory=set)

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
        self, request: sm.SandboxProcessStart, target: SessionTarget, *, timeout_ms: int | None
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
        job_dir = await session_process.new_job_dir(self._workspaces)
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
        subscriber = Subscriber(self._settings.process_stream_events)
        proc.subscribers.add(subscriber)
        try:
            await self._launch(proc, request, target, env, cwd_inside, timeout_ms)
        except BaseException:
            await session_process.remove_job_dir(self._workspaces, job_dir)
            raise
        self._procs[pid] = proc
        log.info("sandbox process %d started", pid)
        return self._events(proc, subscriber, started=True)

    def attach(self, pid: int) -> AsyncIterator[sm.ProcessEvent]:
        """Events of a running process from now on (``ProcessStarted`` first)."""
        proc = self._find(pid)
        subscriber = Subscriber(self._settings.process_stream_events)
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
                        note = dropped_note(subscriber.limit)
                        # Also on stderr: E2B's Python SDK shows stderr, not the
                        # end's error, in its CommandExitException.
                        data = base64.b64encode(f"\n{note}\n".encode()).decode()
                        yield sm.ProcessOutput(stream="stderr", data=data)
                        yield sm.ProcessEnded(exit_code=None, status="stream dropped", error=note)
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
        target: SessionTarget,
        env: dict[str, str],
        cwd_inside: str,
        timeout_ms: int | None,
    ) -> None:
        mode = "pipe" if request.pty is None else f"{request.pty.cols}x{request.pty.rows}"
        with LaunchPipes() as pipes:
            stdin_w, stdin_r = pipes.to_child()
            out_r, out_w = pipes.from_child()
            err_r, err_w = pipes.from_child()
            control_w, control_r = pipes.to_child()
            report_r, report_w = pipes.from_child()
            argv = [self._python, "-I", "-S", "-c", INIT_SOURCE]
            argv += [str(report_w), str(err_w), str(control_r), cwd_inside, mode]
            argv += [request.cmd, *request.args]
            spec = target.job_spec(
                argv=argv,
                job_dir=proc.job_dir,
                env=env,
                limits=self._limits(timeout_ms),
                network=self._settings.allow_network,
                pass_fds=(report_w, err_w, control_r),
                home_link=sm.SANDBOX_HOME,
                devpts=request.pty is not None,
            )
            proc.job = await self._jail.launch(spec, stdin_fd=stdin_r, output_fd=out_w)
        if request.stdin or request.pty is not None:
            os.set_blocking(stdin_w, False)
            proc.stdin_fd = stdin_w
        else:
            os.close(stdin_w)
        os.set_blocking(control_w, False)
        proc.control_fd = control_w

        def publisher(stream: str) -> Callable[[bytes], None]:
            def publish(data: bytes) -> None:
                text = base64.b64encode(data).decode("ascii")
                proc.publish(sm.ProcessOutput(stream=stream, data=text))  # type: ignore[arg-type]

            return publish

        outputs = session_process.read_outputs(
            {
                out_r: publisher("pty" if request.pty is not None else "stdout"),
                err_r: publisher("stderr"),
            }
        )
        session_process.supervise_soon(
            proc,
            outputs,
            report_r,
            workspaces=self._workspaces,
            finish=functools.partial(self._finish, proc),
            name=f"sandcell-sandbox-proc-{proc.pid}",
        )
        if timeout_ms is not None:
            loop = asyncio.get_running_loop()
            proc.timer = loop.call_later(timeout_ms / 1000, self._on_timeout, proc)

    def _limits(self, timeout_ms: int | None) -> JobLimits:
        conf = self._settings.limits
        return session_process.job_limits(
            conf, timeout_ms=timeout_ms, memory_bytes=conf.memory_mib * MIB, pids=conf.pids
        )

    def _on_timeout(self, proc: _Process) -> None:
        task = asyncio.ensure_future(self._stop(proc))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _finish(self, proc: _Process, outcome: LaunchOutcome | None, report: Report) -> None:
        if proc.control_fd is not None:
            os.close(proc.control_fd)
            proc.control_fd = None
        proc.ended = ended(proc.sent, outcome, report)
        proc.done.set()
        proc.publish(proc.ended)
        proc.publish(None)
        self._procs.pop(proc.pid, None)
        log.info("sandbox process %d ended (%s)", proc.pid, proc.ended.status)

    # -- input, signals, terminal --------------------------------------------------------

    async def write_input(self, pid: int, data: bytes) -> None:
        """Write to the process's stdin (its terminal, for a PTY process)."""
        proc = self._find(pid)
        fd = proc.stdin_fd
        if fd is None:
            raise BadRequestError(f"process {pid} has no open stdin (start it with stdin)")
        await session_process.write_stdin(fd, data, shown=str(pid))

    def close_stdin(self, pid: int) -> None:
        """Close the process's stdin (EOF); idempotent."""
        proc = self._find(pid)
        if proc.info.pty:
            raise BadRequestError("a PTY process has no stdin to close; send Ctrl-D (0x04)")
        proc.close_stdin()

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
        job = proc.job

        def term() -> None:
            proc.sent = "SIGTERM"
            self._control(proc, f"s {int(signal.SIGTERM)}\n")

        def kill() -> None:
            assert job is not None
            proc.sent = "SIGKILL"
            job.kill()

        await session_process.stop(proc, grace_s=_STOP_GRACE_S, term=term, kill=kill)

    async def stop_all(self) -> None:
        """Stop every running process (release, shutdown); waits for them to end."""
        await session_process.stop_all(list(self._procs.values()), self._stop)


__all__ = ["SandboxProcesses"]
