"""The runner's process-wide state: settings, jail, pools, and the job lifecycle."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import resource
from collections.abc import AsyncIterator
from pathlib import Path

from sandcell_protocol import ExecuteResult

from .cgroups import CgroupManager
from .config import MIB, RunnerSettings
from .errors import BusyError
from .executor import Executor, JobWorkspace, PreparedRequest
from .jail import Jail, OutputCallback
from .languages import LanguageSpec, discover_languages
from .spawner import Spawner
from .uidpool import UidPool
from .workspace import JobDirs, WorkspaceManager

log = logging.getLogger(__name__)


def raise_nofile_limit() -> tuple[int, int]:
    """Raise RLIMIT_NOFILE's soft limit to the hard limit; never lower it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def instance_key(workspace_root: Path) -> str:
    """Stable per-runner key (from its workspace root) naming its cgroup subtree."""
    return hashlib.sha256(str(workspace_root).encode()).hexdigest()[:16]


class RunnerService:
    """Everything a runner process holds; built once at start-up."""

    def __init__(
        self,
        settings: RunnerSettings,
        *,
        languages: dict[str, LanguageSpec] | None = None,
    ) -> None:
        self.settings = settings
        self.warnings: list[str] = []
        self.workspaces = WorkspaceManager(
            settings.workspace_root, quota_bytes=settings.limits.workspace_quota_mib * MIB
        )
        self.workspaces.prepare()
        self.cgroups = CgroupManager(instance_key(settings.workspace_root))
        reaped = self.cgroups.reap_leftovers()
        if reaped:
            log.warning("killed leftovers of %d job cgroups from a previous runner", reaped)
        self.spawner = Spawner()
        self.jail = Jail(
            nsjail=settings.nsjail_path if settings.jail_mode == "nsjail" else None,
            cgroups=self.cgroups,
            spawner=self.spawner,
            run_dir=settings.workspace_root,
        )
        self.uids = UidPool(settings.uid_min, settings.uid_max)
        self.languages = (
            languages if languages is not None else discover_languages(jailed=self.jail.jailed)
        )
        self.executor = Executor(
            settings, jail=self.jail, workspaces=self.workspaces, languages=self.languages
        )
        self._slots = asyncio.Semaphore(settings.max_jobs)
        self._collect_warnings()

    def _collect_warnings(self) -> None:
        if not self.jail.jailed:
            self.warnings.append("jail disabled (SANDCELL_RUNNER_JAIL=none): jobs are NOT isolated")
        if not self.cgroups.available:
            self.warnings.append(
                f"{self.cgroups.reason}; memory and pids limits fall back to rlimits"
            )
        if not self.workspaces.quota_enforced:
            self.warnings.append("workspace disk quota not enforced (not root: no tmpfs mounts)")
        if self.uids.shared:
            self.warnings.append("not root: every job runs as the runner's own UID")
        if self.settings.token is None:
            self.warnings.append("authentication disabled (SANDCELL_RUNNER_INSECURE_NO_AUTH=1)")
        for warning in self.warnings:
            log.warning("weakened isolation: %s", warning)

    @contextlib.asynccontextmanager
    async def job_slot(self) -> AsyncIterator[None]:
        """One of ``SANDCELL_RUNNER_MAX_JOBS`` slots, or ``BusyError`` (503) at once."""
        if self._slots.locked():
            raise BusyError(f"runner at its concurrency limit ({self.settings.max_jobs} jobs)")
        async with self._slots:
            yield

    @contextlib.asynccontextmanager
    async def fresh_workspace(self) -> AsyncIterator[JobWorkspace]:
        """A fresh per-job workspace and UID, removed and released afterwards."""
        uid = self.uids.allocate()
        dirs: JobDirs | None = None
        try:
            dirs = await asyncio.to_thread(self.workspaces.create_job, uid=uid, gid=uid)
            yield JobWorkspace(path=dirs.workspace, uid=uid, gid=uid, job_dir=dirs.job_dir)
        finally:
            if dirs is not None:
                await asyncio.shield(asyncio.to_thread(self.workspaces.remove_job, dirs))
            self.uids.release(uid)

    async def execute_fresh(
        self, prepared: PreparedRequest, *, on_output: OutputCallback | None = None
    ) -> ExecuteResult:
        """Run a request in a fresh workspace (the caller holds a job slot)."""
        async with self.fresh_workspace() as workspace:
            await asyncio.to_thread(self.executor.write_inputs, prepared, workspace)
            return await self.executor.run_in(prepared, workspace, on_output=on_output)


__all__ = ["RunnerService", "instance_key", "raise_nofile_limit"]
