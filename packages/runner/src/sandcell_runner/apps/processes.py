"""A session's background processes: started by tag, jailed, logged, stopped on request.

Each process is ``bash -lc <command>`` under ``procinit`` in its own nsjail (own
cgroup limits, no wall time unless asked), in the session's workspace and network
namespace. It outlives the request that started it; it is reported with its exit
status when it ends and never restarted. Stopping sends SIGTERM, then SIGKILL
after a grace. Checkpoints and restores do not touch processes: a restored
session runs nothing until its processes are started again (after an in-place
restore, a process still running keeps the workspace it started with).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sandcell_protocol.app_messages import ProcessInfo, ProcessStart

from .. import session_process
from ..config import MIB, RunnerSettings
from ..env_vars import checked_env
from ..errors import BadRequestError, NotFoundError, SessionConflictError
from ..jail.launched import LaunchOutcome
from ..jail.nsjail import Jail
from ..jail.outcome import signal_name
from ..jail.spec import JobLimits
from ..session_process import LaunchPipes, Report, SessionProcess, SessionTarget
from ..workspace.cwd import workspace_cwd
from ..workspace.manager import WorkspaceManager
from .logbuffer import LineBuffer
from .procinit import INIT_SOURCE
from .runtime_errors import ErrorEvent, RuntimeErrorStore
from .tracescan import TraceScanner

log = logging.getLogger(__name__)

NOTE = "[sandcell] "


@dataclass(eq=False, slots=True, kw_only=True)
class _Process(SessionProcess):
    tag: str
    buffer: LineBuffer
    started_at_s: float
    ended_at_s: float | None = None
    exit_code: int | None = None
    signal: str | None = None
    sent: int | None = None

    def info(self) -> ProcessInfo:
        running = not self.done.is_set()
        return ProcessInfo(
            tag=self.tag,
            pid=self.job.pid if self.job is not None and running else None,
            state="running" if running else "exited",
            exit_code=self.exit_code,
            signal=self.signal,
            started_at_s=self.started_at_s,
            ended_at_s=self.ended_at_s,
        )


MAX_RUNNING_PROCESSES = 16
"""Long-lived processes a session may run at once."""


class ProcessManager:
    """The processes of one session (a runner holds at most one)."""

    def __init__(
        self,
        settings: RunnerSettings,
        *,
        jail: Jail,
        workspaces: WorkspaceManager,
        errors: RuntimeErrorStore,
        python: str | None,
        bash: str,
        grace_s: float = 3.0,
        max_running: int = MAX_RUNNING_PROCESSES,
        max_kept: int = 64,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._settings = settings
        self._jail = jail
        self._workspaces = workspaces
        self._errors = errors
        self._python = python
        self._bash = bash
        self.grace_s = grace_s
        self._max_running = max_running
        self._max_kept = max_kept
        self._clock = clock
        self._procs: dict[str, _Process] = {}
        self._background: set[asyncio.Task[None]] = set()

    # -- queries ----------------------------------------------------------------

    def list(self) -> list[ProcessInfo]:
        return [proc.info() for proc in sorted(self._procs.values(), key=lambda p: p.started_at_s)]

    def buffer(self, tag: str) -> LineBuffer:
        return self._get(tag).buffer

    def _get(self, tag: str) -> _Process:
        proc = self._procs.get(tag)
        if proc is None:
            raise NotFoundError(f"no process tagged {tag!r}")
        return proc

    def keep_paths(self) -> set[Path]:
        """Job directories of processes not yet finished (the reaper must skip them)."""
        return {proc.job_dir for proc in self._procs.values() if not proc.done.is_set()}

    # -- start ------------------------------------------------------------------

    async def start(self, request: ProcessStart, target: SessionTarget) -> ProcessInfo:
        """Launch ``request`` in ``target``; 409 when the tag is running already."""
        old = self._procs.get(request.tag)
        if old is not None and not old.done.is_set():
            raise SessionConflictError(f"process {request.tag!r} is already running")
        if sum(not p.done.is_set() for p in self._procs.values()) >= self._max_running:
            raise BadRequestError(f"at most {self._max_running} processes may run at once")
        workspace_inside, _ = self._jail.inside_paths(target.workspace, target.workspace)
        env = self._env(request, home=workspace_inside)
        relative = await workspace_cwd(request.cwd, target.workspace)
        cwd_inside = f"{workspace_inside}/{relative}" if relative else workspace_inside
        job_dir = await session_process.new_job_dir(self._workspaces)
        proc = _Process(
            tag=request.tag,
            buffer=LineBuffer(on_line=TraceScanner(f"process:{request.tag}", self._record).feed),
            started_at_s=self._clock(),
            job_dir=job_dir,
        )
        try:
            await self._launch(proc, request, target, env, cwd_inside)
        except BaseException:
            await session_process.remove_job_dir(self._workspaces, job_dir)
            raise
        self._procs.pop(request.tag, None)
        self._procs[request.tag] = proc
        self._trim()
        log.info("process %s started (pid %d)", request.tag, proc.job.pid if proc.job else -1)
        return proc.info()

    def _record(self, event: ErrorEvent) -> None:
        self._errors.record(event)

    async def _launch(
        self,
        proc: _Process,
        request: ProcessStart,
        target: SessionTarget,
        env: dict[str, str],
        cwd_inside: str,
    ) -> None:
        with LaunchPipes() as pipes:
            stdin_w, stdin_r = pipes.to_child()
            out_r, out_w = pipes.from_child()
            report_r, report_w = pipes.from_child()
            if self._python is not None:
                argv = [self._python, "-I", "-S", "-c", INIT_SOURCE, str(report_w), cwd_inside]
                argv += [self._bash, "-lc", request.command]
            else:
                argv = [self._bash, "-lc", f'cd -- "$0" || exit 1\n{request.command}', cwd_inside]
            spec = target.job_spec(
                argv=argv,
                job_dir=proc.job_dir,
                env=env,
                limits=self._limits(request),
                network=self._settings.allow_network,
                pass_fds=(report_w,),
            )
            proc.job = await self._jail.launch(spec, stdin_fd=stdin_r, output_fd=out_w)
        proc.stdin_fd = stdin_w
        os.set_blocking(stdin_w, False)
        outputs = session_process.read_outputs({out_r: proc.buffer.feed})
        session_process.supervise_soon(
            proc,
            outputs,
            report_r,
            workspaces=self._workspaces,
            finish=functools.partial(self._finish, proc),
            name=f"sandcell-proc-{proc.tag}",
        )
        if request.timeout_ms is not None:
            timeout_s = min(request.timeout_ms, self._settings.limits.max_timeout_ms) / 1000
            loop = asyncio.get_running_loop()
            proc.timer = loop.call_later(timeout_s, self._on_timeout, proc)

    def _on_timeout(self, proc: _Process) -> None:
        proc.buffer.write_line(NOTE + "timeout reached; stopping")
        task = asyncio.ensure_future(self._stop(proc))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _finish(self, proc: _Process, outcome: LaunchOutcome | None, report: Report) -> None:
        exit_code, signum = report
        if exit_code is not None or signum is not None:
            proc.exit_code = exit_code
            proc.signal = signal_name(signum) if signum is not None else None
        elif outcome is None or (outcome.jail_failed and proc.sent == signal.SIGKILL):
            proc.exit_code, proc.signal = None, "SIGKILL"
        else:
            proc.exit_code, proc.signal = outcome.exit_code, outcome.signal
            if outcome.jail_failed:
                proc.buffer.write_line(NOTE + "the jail could not run the process:")
                for line in outcome.jail_log.splitlines()[-20:]:
                    proc.buffer.write_line(NOTE + line)
        if outcome is not None and outcome.oom_killed:
            proc.buffer.write_line(NOTE + "killed: memory limit reached")
        ending = f"exit code {proc.exit_code}" if proc.signal is None else proc.signal
        proc.buffer.write_line(NOTE + f"process exited ({ending})")
        proc.buffer.close()
        proc.ended_at_s = self._clock()
        proc.done.set()
        log.info("process %s exited (%s)", proc.tag, ending)

    # -- stop, stdin --------------------------------------------------------------

    async def stop(self, tag: str) -> ProcessInfo:
        """SIGTERM, SIGKILL after the grace; the process's info once it has ended."""
        proc = self._get(tag)
        await self._stop(proc)
        return proc.info()

    async def _stop(self, proc: _Process) -> None:
        job = proc.job

        def term() -> None:
            assert job is not None
            if proc.sent is None:
                proc.sent = signal.SIGTERM
                job.signal(signal.SIGTERM)

        def kill() -> None:
            assert job is not None
            proc.sent = signal.SIGKILL
            job.kill()

        await session_process.stop(proc, grace_s=self.grace_s, term=term, kill=kill)

    async def write_stdin(self, tag: str, data: bytes, *, close: bool = False) -> None:
        """Write to the process's stdin (then close it, when asked); 400 if it has ended."""
        proc = self._get(tag)
        fd = proc.stdin_fd
        if fd is None or proc.done.is_set():
            raise BadRequestError(f"process {tag!r} is not running")
        await session_process.write_stdin(fd, data, shown=repr(tag))
        if close:
            proc.close_stdin()

    async def stop_all(self) -> None:
        """Stop every running process (release, shutdown); waits for them to end."""
        await session_process.stop_all(self._procs.values(), self._stop)

    # -- helpers ------------------------------------------------------------------

    def _env(self, request: ProcessStart, *, home: str) -> dict[str, str]:
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": home,
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            # Dev servers' prints reach the log as they happen, not at exit.
            "PYTHONUNBUFFERED": "1",
        }
        if "\x00" in request.command:
            raise BadRequestError("command must not contain NUL")
        env.update(checked_env(request.env))
        return env

    def _limits(self, request: ProcessStart) -> JobLimits:
        conf = self._settings.limits
        asked = request.limits
        memory = asked.memory_mib if asked and asked.memory_mib else conf.memory_mib
        pids = asked.pids if asked and asked.pids else conf.pids
        return session_process.job_limits(
            conf,
            timeout_ms=request.timeout_ms,
            memory_bytes=min(memory, conf.max_memory_mib) * MIB,
            pids=min(pids, conf.max_pids),
        )

    def _trim(self) -> None:
        exited = [p for p in self._procs.values() if p.done.is_set()]
        exited.sort(key=lambda p: p.ended_at_s or 0)
        while len(self._procs) > self._max_kept and exited:
            del self._procs[exited.pop(0).tag]


__all__ = ["ProcessManager"]
