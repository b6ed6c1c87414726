"""The host made ready for jobs at a runner's start: its limits, workspaces, cgroups
and instance lease, with the job-user probe beside them; and what it weakens.

``RunnerService`` builds everything else on what ``prepare_host`` returns.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import resource
from dataclasses import dataclass
from pathlib import Path

from .apps.processes import MAX_RUNNING_PROCESSES
from .config import MIB, RunnerSettings
from .jail.cgroup_reaper import InstanceLease, instance_key
from .jail.cgroups import CgroupManager
from .jail.host_limits import apply_host_limits, required_limits
from .jail.job_user import probe_job_user_nsjail
from .jail.nsjail import Jail
from .jail.spawn_helper import SpawnHelper
from .jail.uidpool import UidPool
from .workspace.manager import WorkspaceManager

log = logging.getLogger(__name__)

__all__ = ["PreparedHost", "prepare_host", "raise_nofile_limit", "weakened_isolation"]


def raise_nofile_limit() -> tuple[int, int]:
    """Raise RLIMIT_NOFILE's soft limit to the hard limit; never lower it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


@dataclass(frozen=True, slots=True)
class PreparedHost:
    """What ``prepare_host`` made: the runner holds these for its lifetime."""

    workspaces: WorkspaceManager
    cgroups: CgroupManager
    lease: InstanceLease
    job_user_refused: str | None
    """Why jobs cannot run as their own UID (None: they can)."""
    warnings: tuple[str, ...]
    """Host limits that could not be raised, and the job-user refusal."""


def prepare_host(
    settings: RunnerSettings, nsjail: Path | None, spawner: SpawnHelper
) -> PreparedHost:
    """Workspaces, cgroups and host limits, with the job-user probe beside them and
    ``spawner``'s start awaited last (it was launched before, to overlap them)."""
    warnings: list[str] = []
    probe: concurrent.futures.Future[str | None] | None = None
    if nsjail is not None:
        needs = required_limits(
            max_jobs=settings.max_jobs,
            max_pids=settings.limits.max_pids,
            open_files=settings.limits.open_files,
            session_processes=MAX_RUNNING_PROCESSES if settings.sessions_enabled else 0,
        )
        # First: the probe needs the user-namespace budget raised.
        warnings += apply_host_limits(needs, may_raise=os.geteuid() == 0)
    if nsjail is not None and os.geteuid() == 0:
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sandcell-probe")
        probe = pool.submit(probe_job_user_nsjail, nsjail, settings.uid_max)
        pool.shutdown(wait=False)  # its one thread ends with the probe
    workspaces = WorkspaceManager(
        settings.workspace_root,
        quota_bytes=settings.limits.workspace_quota_mib * MIB,
        inodes=settings.limits.workspace_inodes,
        image_dir=settings.image_dir,
        # A kept workspace is the same directory for the next job, maybe another
        # tenant's: a descriptor to it that outlived its job would reach into the
        # next one. Jobs in the host's network namespace share its abstract unix
        # sockets and so can pass descriptors to each other (or to a host process):
        # then every workspace is wiped and made anew.
        keep_untouched=not settings.allow_network,
    )
    workspaces.prepare()
    instance = instance_key(settings.workspace_root)
    lease = InstanceLease(instance)
    cgroups = CgroupManager(instance, cpu_millicores=settings.cpu_millicores)
    if lease.held:
        reaped = cgroups.reap_leftovers()
        if reaped:
            log.warning("killed leftovers of %d job cgroups from a previous runner", reaped)
    spawner.wait_started()
    refused = probe.result() if probe is not None else None
    if refused is not None:
        warnings.append(
            "nsjail runs as root, so jobs' inotify and namespace budgets are "
            f"root's, shared by every job ({refused})"
        )
    return PreparedHost(workspaces, cgroups, lease, refused, tuple(warnings))


def weakened_isolation(
    settings: RunnerSettings,
    *,
    jail: Jail,
    cgroups: CgroupManager,
    workspaces: WorkspaceManager,
    uids: UidPool,
) -> list[str]:
    """What this runner's set-up weakens against the full jail, one sentence each."""
    warnings: list[str] = []
    if not jail.jailed:
        warnings.append("jail disabled (SANDCELL_RUNNER_JAIL=none): jobs are NOT isolated")
    if not cgroups.available:
        warnings.append(f"{cgroups.reason}; memory and pids limits fall back to rlimits")
    elif not cgroups.cpu_limited:
        warnings.append("no cpu cgroup controller: the session's CPU use is not bounded")
    if workspaces.backend == "tmpfs":
        warnings.append(
            f"workspace images unavailable ({workspaces.images_refused}): workspaces "
            "are tmpfs, so their bytes are memory charged to the jobs that write them"
        )
    if not workspaces.quota_enforced:
        warnings.append("workspace disk quota not enforced (not root: no tmpfs mounts)")
    if uids.shared:
        warnings.append("not root: every job runs as the runner's own UID")
    if settings.token is None:
        warnings.append("authentication disabled (SANDCELL_RUNNER_INSECURE_NO_AUTH=1)")
    return warnings
