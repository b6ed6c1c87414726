"""The bound session's contexts: created, listed, run, interrupted, restarted, deleted.

A context is a driver (``drivers.py``) in its own long-lived jail, started on
create and kept until it is deleted or restarted, idle past
``SANDCELL_RUNNER_CONTEXT_IDLE_S``, or the session is released. An interpreter
that dies (memory kill, a timeout past the grace, a crash) leaves the context
``lost``: its runs answer ``context_lost`` until it is restarted, never a
silently empty namespace. A restore replaces the workspace the interpreters
run in, so it loses every context of the session too.

Runs take the session lock (they use the workspace, and a checkpoint must not
see half a cell); interrupt, list and delete do not, so a cell stuck in
``while True`` can be stopped while it holds the lock.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sandcell_protocol.contexts import (
    ContextCreate,
    ContextEndEvent,
    ContextInfo,
    ContextRun,
    ContextState,
)
from sandcell_protocol.sandbox_messages import SANDBOX_HOME

from ..cancelling import to_thread_to_the_end
from ..config import MIB, RunnerSettings
from ..env_vars import checked_env
from ..errors import (
    BadRequestError,
    ContextLostError,
    NotFoundError,
    SessionBusyError,
    SessionConflictError,
    UnsupportedLanguageError,
)
from ..jail.nsjail import Jail
from ..jail.spec import JobLimits, JobSpec
from ..languages import LanguageSpec
from ..workspace.cwd import workspace_cwd
from ..workspace.manager import WorkspaceManager
from ..workspace.session import SessionState
from .drivers import DRIVERS, Driver
from .interpreter import EventCallback, Interpreter, InterpreterStartError, OutputCaps

log = logging.getLogger(__name__)


_READY_TIMEOUT_S = 30.0
_RESULT_BYTES = 64 * MIB


@dataclass(slots=True)
class _Context:
    context_id: str
    language: str
    cwd: str
    env: dict[str, str]
    last_used_s: float
    interpreter: Interpreter | None = None
    job_dir: Path | None = None
    execution_count: int = 0
    lost_reason: str | None = None
    running: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def info(self) -> ContextInfo:
        if self.interpreter is not None and not self.interpreter.alive and not self.lost_reason:
            self.lost_reason = self.interpreter.lost_reason()
        state: ContextState = "lost" if self.lost_reason else "busy" if self.running else "idle"
        return ContextInfo(
            context_id=self.context_id,
            language=self.language,
            state=state,
            cwd=self.cwd,
            execution_count=self.execution_count,
            lost_reason=self.lost_reason,
        )


class ContextManager:
    """Every context of the bound session (a runner holds at most one session)."""

    def __init__(
        self,
        settings: RunnerSettings,
        *,
        jail: Jail,
        workspaces: WorkspaceManager,
        languages: dict[str, LanguageSpec],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._jail = jail
        self._workspaces = workspaces
        self._clock = clock
        self.languages = {name: spec for name, spec in languages.items() if name in DRIVERS}
        """Languages with a driver and an interpreter on this machine."""
        self._sessions: dict[str, dict[str, _Context]] = {}

    # -- queries ----------------------------------------------------------------------

    def list(self, session_id: str) -> list[ContextInfo]:
        return [c.info() for c in self._sessions.get(session_id, {}).values()]

    def _get(self, session_id: str, context_id: str) -> _Context:
        context = self._sessions.get(session_id, {}).get(context_id)
        if context is None:
            raise NotFoundError(f"no context {context_id!r} in this session")
        return context

    def keep_paths(self) -> set[Path]:
        """Job directories of live interpreters (the reaper must skip them)."""
        return {
            c.job_dir
            for contexts in self._sessions.values()
            for c in contexts.values()
            if c.job_dir is not None
        }

    # -- lifecycle --------------------------------------------------------------------

    async def create(self, state: SessionState, request: ContextCreate) -> ContextInfo:
        """Start an interpreter for ``request.language`` in the session's jail."""
        if request.language not in self.languages:
            offered = ", ".join(sorted(self.languages)) or "none"
            raise UnsupportedLanguageError(
                f"no contexts for language {request.language!r} (offered: {offered})"
            )
        contexts = self._sessions.setdefault(state.session_id, {})
        context_id = request.context_id or f"ctx-{secrets.token_hex(8)}"
        if context_id in contexts:
            raise SessionConflictError(f"context {context_id!r} exists already")
        if len(contexts) >= self._settings.max_contexts:
            raise BadRequestError(
                f"at most {self._settings.max_contexts} contexts per session "
                "(SANDCELL_RUNNER_MAX_CONTEXTS); delete one first"
            )
        env = checked_env(request.env)
        cwd = await workspace_cwd(request.cwd, state.workspace)
        context = _Context(
            context_id=context_id,
            language=request.language,
            cwd=cwd,
            env=env,
            last_used_s=self._clock(),
        )
        contexts[context_id] = context
        try:
            await self._start(state, context)
        except BaseException:
            contexts.pop(context_id, None)
            raise
        state.contexts[context_id] = context.language
        log.info("context %s (%s) started", context_id, request.language)
        return context.info()

    async def _start(self, state: SessionState, context: _Context) -> None:
        job_dir = await to_thread_to_the_end(
            self._workspaces.create_session_job_dir, undo=self._workspaces.remove_dir
        )
        driver = DRIVERS[context.language]
        try:
            await to_thread_to_the_end(functools.partial(_write_driver, job_dir, driver))
            spec = self._spec(state, context, job_dir)
            interpreter = await Interpreter.start(
                self._jail, spec, ready_timeout_s=_READY_TIMEOUT_S
            )
        except InterpreterStartError as exc:
            await to_thread_to_the_end(functools.partial(self._workspaces.remove_dir, job_dir))
            raise BadRequestError(str(exc)) from None
        except BaseException:
            await to_thread_to_the_end(functools.partial(self._workspaces.remove_dir, job_dir))
            raise
        context.interpreter = interpreter
        context.job_dir = job_dir
        context.lost_reason = None
        context.execution_count = 0

    def _spec(self, state: SessionState, context: _Context, job_dir: Path) -> JobSpec:
        workspace_inside, job_inside = self._jail.inside_paths(state.workspace, job_dir)
        cwd_inside = f"{workspace_inside}/{context.cwd}" if context.cwd else workspace_inside
        binary = self.languages[context.language].binary
        driver = DRIVERS[context.language]
        # The jail's own /tmp (a tmpfs per jail), or, unjailed, the job directory.
        tmp = "/tmp" if self._jail.jailed else str(job_dir)  # noqa: S108
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": workspace_inside,
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            # Figures render off-screen and come back as PNGs (the driver collects them);
            # matplotlib's cache lives in the jail's /tmp, not in the checkpointed workspace.
            "MPLBACKEND": "Agg",
            "MPLCONFIGDIR": f"{tmp}/matplotlib",
            # fontconfig's cache too (it would write ~/.cache into the workspace).
            "XDG_CACHE_HOME": f"{tmp}/cache",
            **context.env,
        }
        conf = self._settings.limits
        return JobSpec(
            argv=[binary, *driver.flags, f"{job_inside}/{driver.file_name}", cwd_inside],
            workspace=state.workspace,
            job_dir=job_dir,
            uid=state.uid,
            gid=state.uid,
            env=env,
            limits=JobLimits(
                timeout_ms=conf.max_timeout_ms,
                memory_bytes=conf.memory_mib * MIB,
                pids=conf.pids,
                stdout_bytes=conf.stdout_bytes,
                stderr_bytes=conf.stderr_bytes,
                file_size_mib=conf.file_size_mib,
                open_files=conf.open_files,
                tmp_mib=conf.tmp_mib,
            ),
            network=self._settings.allow_network,
            netns_fd=state.netns.fd if state.netns is not None else None,
            long_running=True,
            # E2B-style clients name the workspace /home/user (sandbox_messages.SANDBOX_HOME).
            home_link=SANDBOX_HOME,
        )

    async def _stop(self, context: _Context, *, lost_reason: str | None = None) -> None:
        interpreter, job_dir = context.interpreter, context.job_dir
        context.interpreter = None
        context.job_dir = None
        if lost_reason is not None:
            context.lost_reason = lost_reason
        if interpreter is not None:
            await interpreter.close()
        if job_dir is not None:
            await to_thread_to_the_end(functools.partial(self._workspaces.remove_dir, job_dir))

    async def delete(self, state: SessionState, context_id: str) -> None:
        """Stop the interpreter and forget the context."""
        context = self._get(state.session_id, context_id)
        self._sessions[state.session_id].pop(context_id, None)
        state.contexts.pop(context_id, None)
        await self._stop(context)
        log.info("context %s deleted", context_id)

    async def restart(self, state: SessionState, context_id: str) -> ContextInfo:
        """A fresh interpreter (empty namespace) under the same id."""
        context = self._get(state.session_id, context_id)
        if context.interpreter is not None:
            context.interpreter.kill()
        try:
            async with asyncio.timeout(5):
                await context.lock.acquire()
        except TimeoutError:
            raise SessionBusyError("the context is still stopping a run; retry") from None
        try:
            await self._stop(context)
            context.lost_reason = None
            context.last_used_s = self._clock()
            await self._start(state, context)
        finally:
            context.lock.release()
        return context.info()

    def interrupt(self, session_id: str, context_id: str) -> ContextInfo:
        """SIGINT the cell the context is running (nothing when it is idle)."""
        context = self._get(session_id, context_id)
        if context.interpreter is not None:
            context.interpreter.interrupt()
        return context.info()

    # -- running ----------------------------------------------------------------------

    def check_runnable(self, session_id: str, context_id: str) -> None:
        """Raise before a run starts: unknown context (404), lost context (409)."""
        context = self._get(session_id, context_id)
        interpreter = context.interpreter
        if interpreter is not None and not interpreter.alive and context.lost_reason is None:
            # Died between runs (a background thread's memory, os._exit in a thread).
            context.lost_reason = interpreter.lost_reason()
        if context.lost_reason is not None or interpreter is None:
            raise ContextLostError(
                f"context {context_id!r} is lost ({context.lost_reason or 'not running'}); "
                "restart it for a fresh one"
            )

    async def run(
        self, state: SessionState, context_id: str, request: ContextRun, on_event: EventCallback
    ) -> ContextEndEvent:
        """Run one cell (the caller holds the session lock); ``on_event`` gets its events."""
        self.check_runnable(state.session_id, context_id)
        context = self._get(state.session_id, context_id)
        env = checked_env(request.env)
        if context.lock.locked():
            raise SessionBusyError(f"context {context_id!r} is running a cell; retry")
        async with context.lock:
            self.check_runnable(state.session_id, context_id)
            interpreter = context.interpreter
            assert interpreter is not None
            conf = self._settings.limits
            timeout_ms = min(request.timeout_ms or conf.timeout_ms, conf.max_timeout_ms)
            context.running = True
            try:
                end = await interpreter.run(
                    request.code,
                    env=env,
                    timeout_s=timeout_ms / 1000,
                    grace_s=self._settings.context_grace_ms / 1000,
                    caps=OutputCaps(
                        stdout_bytes=conf.stdout_bytes,
                        stderr_bytes=conf.stderr_bytes,
                        result_bytes=_RESULT_BYTES,
                    ),
                    on_event=on_event,
                )
            finally:
                context.running = False
                context.last_used_s = self._clock()
            if end.context_lost:
                await self._stop(context, lost_reason=interpreter.lost_reason())
            else:
                context.execution_count = end.execution_count
            return end

    # -- session events ---------------------------------------------------------------

    async def restored(self, state: SessionState) -> None:
        """A restore replaced the workspace: every context is lost, those the archive
        names included (a restore into a new sandbox brings files, not variables)."""
        contexts = self._sessions.setdefault(state.session_id, {})
        for context in list(contexts.values()):
            await self._stop(context, lost_reason="the workspace was restored from a checkpoint")
            state.contexts[context.context_id] = context.language
        for context_id, language in state.contexts.items():
            if context_id not in contexts and len(contexts) < self._settings.max_contexts:
                contexts[context_id] = _Context(
                    context_id=context_id,
                    language=language,
                    cwd="",
                    env={},
                    last_used_s=self._clock(),
                    lost_reason="the workspace was restored from a checkpoint; "
                    "variables do not survive a restore",
                )

    async def release(self, state: SessionState) -> None:
        """The session ends: stop and forget its contexts (a release hook; idempotent)."""
        contexts = self._sessions.pop(state.session_id, {})
        await asyncio.gather(*(self._stop(c) for c in contexts.values()), return_exceptions=True)

    async def shutdown(self) -> None:
        every = [c for contexts in self._sessions.values() for c in contexts.values()]
        await asyncio.gather(*(self._stop(c) for c in every), return_exceptions=True)
        self._sessions.clear()

    async def sweep_idle(self) -> int:
        """Stop interpreters idle past ``context_idle_s`` (their contexts become lost)."""
        limit = self._settings.context_idle_s
        now = self._clock()
        stopped = 0
        for contexts in self._sessions.values():
            for context in list(contexts.values()):
                idle = now - context.last_used_s
                if context.interpreter is not None and not context.running and idle > limit:
                    await self._stop(context, lost_reason=f"stopped after {int(idle)} s idle")
                    stopped += 1
        return stopped


__all__ = ["ContextManager"]


def _write_driver(job_dir: Path, driver: Driver) -> None:
    for relative, data in driver.files().items():
        path = job_dir / relative
        path.parent.mkdir(mode=0o755, exist_ok=True)
        path.write_bytes(data)
