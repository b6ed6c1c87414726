"""``Upkeep``: the runner's rounds in the background while it serves.

The reaper removes leftover per-job directories (never one a feature still uses)
and the cgroups of runners that are gone; the idle round stops idle interpreters
and, past ``SANDCELL_RUNNER_IDLE_EXIT_S`` without a request and with nothing
running, ends the runner. ``service.RunnerService.running`` runs both.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from .config import RunnerSettings
from .contexts.manager import ContextManager
from .jail.cgroup_reaper import reap_orphans
from .jail.cgroups import CgroupManager
from .workspace.jobs import JobWorkspaces
from .workspace.manager import WorkspaceManager
from .workspace.session import SessionManager

__all__ = ["Upkeep"]

log = logging.getLogger(__name__)


class _Keeper(Protocol):
    def keep_paths(self) -> set[Path]: ...


class Upkeep:
    """The reaper and the idle round; ``keepers`` name the paths the reaper leaves."""

    def __init__(
        self,
        settings: RunnerSettings,
        *,
        workspaces: WorkspaceManager,
        cgroups: CgroupManager,
        sessions: SessionManager,
        jobs: JobWorkspaces,
        contexts: ContextManager,
        keepers: Sequence[_Keeper],
    ) -> None:
        self._settings = settings
        self._workspaces = workspaces
        self._cgroups = cgroups
        self._sessions = sessions
        self._jobs = jobs
        self._contexts = contexts
        self._keepers = keepers
        self._last_request_s = time.monotonic()

    def note_request(self) -> None:
        """A request arrived (the idle exit counts from the last one)."""
        self._last_request_s = time.monotonic()

    def reap(self) -> list[Path]:
        """Remove leftover per-job directories; never the session's, staging, or the cache."""
        keep: set[Path] = set()
        for keeper in self._keepers:
            keep |= keeper.keep_paths()
        if self._cgroups.available:
            orphans = reap_orphans(older_than_s=self._settings.reap_age_s)
            if orphans:
                log.info("reaper removed the cgroups of %d runners that are gone", len(orphans))
        return self._workspaces.reap(older_than_s=self._settings.reap_age_s, keep=keep)

    async def reaper_loop(self) -> None:
        while True:
            removed = await asyncio.to_thread(self.reap)
            if removed:
                log.info("reaper removed %d leftover workspaces", len(removed))
            await asyncio.sleep(self._settings.reap_interval_s)

    def _busy(self) -> bool:
        bound = self._sessions.bound
        return self._jobs.busy() or (bound is not None and bound.lock.locked())

    async def idle_loop(self) -> None:
        """Stop idle interpreters; exit the runner when idle past ``idle_exit_s``."""
        interval_s = min(60.0, max(1.0, self._settings.context_idle_s / 4))
        if self._settings.idle_exit_s:
            interval_s = min(interval_s, max(0.5, self._settings.idle_exit_s / 4))
        while True:
            await asyncio.sleep(interval_s)
            stopped = await self._contexts.sweep_idle()
            if stopped:
                log.info("stopped %d idle context interpreters", stopped)
            idle_s = time.monotonic() - self._last_request_s
            limit_s = self._settings.idle_exit_s
            if limit_s and idle_s > limit_s and not self._busy():
                log.info("no request for %d s (SANDCELL_RUNNER_IDLE_EXIT_S): exiting", idle_s)
                # uvicorn's own graceful shutdown: the lifespan then runs shutdown().
                os.kill(os.getpid(), signal.SIGTERM)
                return
