"""A job directory whose removal fails is no longer counted as in use.

``JobWorkspaces`` counts the directories of running jobs: the reaper leaves them and
the idle exit waits for them. A removal that raised left the count behind for ever,
so the reaper never retried the directory and a detached runner never idled out.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandcell_runner.jail.uidpool import UidPool
from sandcell_runner.workspace.jobs import JobWorkspaces
from sandcell_runner.workspace.manager import WorkspaceManager
from sandcell_runner.workspace.session import SessionManager
from tests.fixtures.paths import traversable_dir, unmount_all


@pytest.fixture
def base() -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.fail("the failing removal is a mount point under the job directory: needs root")
    with traversable_dir("jobws-") as path:
        try:
            yield path
        finally:
            unmount_all(path)


def _jobs(base: Path) -> JobWorkspaces:
    workspaces = WorkspaceManager(base / "root", quota_bytes=16 << 20)
    workspaces.prepare()
    uids = UidPool(20_900, 20_909, lease_dir=base / "uid-leases")
    sessions = SessionManager(enabled=False, workspaces=workspaces, uids=uids, wait_ms=100)
    return JobWorkspaces(workspaces, uids, sessions)


async def test_a_fresh_job_whose_removal_fails_is_not_kept_busy(base: Path) -> None:
    jobs = _jobs(base)
    async with jobs.fresh() as workspace:
        assert workspace.job_dir is not None
        busy_dir = workspace.job_dir.parent
        assert jobs.busy()
        # A mount point in the job directory: emptying it for reuse fails (EBUSY).
        (workspace.job_dir / "pinned").mkdir()
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "none", str(workspace.job_dir / "pinned")],
            check=True,
        )
    await jobs.drain()
    assert busy_dir.exists()  # the removal did fail
    assert not jobs.busy()
    assert busy_dir not in jobs.keep_paths()  # the reaper may retry it
