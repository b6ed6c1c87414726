"""A job cancelled while a thread makes its workspace or cgroup leaves nothing behind.

The thread cannot be stopped: awaited plainly, the cancelled job's cleanup ran at
once, before the thread had made anything, so it removed nothing and gave the UID
back while the thread went on making a workspace owned by it (a fresh job), made a
job directory after the session lock was released (a session job), or made a cgroup
no one would destroy (a launched job). A second cancellation of a launched job's
wait, while its cgroup's stats were read, skipped the cgroup's destroy. The thread
is held here until the cancellation has reached the job.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from sandcell_runner.jail.cgroups import JobCgroup
from sandcell_runner.jail.launched import LaunchedJob
from sandcell_runner.jail.uidpool import UidPool
from sandcell_runner.workspace.jobs import JobWorkspaces
from sandcell_runner.workspace.manager import JobDirs, WorkspaceManager
from sandcell_runner.workspace.session import SessionManager
from tests.fixtures.paths import traversable_dir, unmount_all
from tests.runner.jail.real_jail import real_jail, shell_job

SESSION = "rt_" + "c" * 64
T = TypeVar("T")


@pytest.fixture
def base() -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.fail("workspaces are owned by job UIDs: needs root")
    with traversable_dir("cancelws-") as path:
        try:
            yield path
        finally:
            unmount_all(path)


class _Held:
    """A blocking call held in its thread until ``release``; ``made`` is what it returned."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self.entered = threading.Event()
        self.release = threading.Event()
        self.finished = threading.Event()
        self.made: Any = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.entered.set()
        self.release.wait(60)
        try:
            self.made = self._real(*args, **kwargs)
            return self.made
        finally:
            self.finished.set()


def _jobs(base: Path, *, sessions: bool) -> tuple[JobWorkspaces, WorkspaceManager, UidPool]:
    workspaces = WorkspaceManager(base / "root", quota_bytes=16 << 20)
    workspaces.prepare()
    uids = UidPool(20_910, 20_919, lease_dir=base / "uid-leases")
    manager = SessionManager(enabled=sessions, workspaces=workspaces, uids=uids, wait_ms=100)
    return JobWorkspaces(workspaces, uids, manager), workspaces, uids


async def _cancel_while_held(held: _Held, task: asyncio.Task[None], probe: Callable[[], T]) -> T:
    """Cancel ``task`` while ``held`` runs in its thread; ``probe()`` once the cancellation
    has reached it; then let the thread end and wait for both."""
    await asyncio.to_thread(held.entered.wait, 60)
    task.cancel()
    for _ in range(10):  # the cancellation reaches the job, and its cleanup runs
        await asyncio.sleep(0)
    seen = probe()
    held.release.set()
    await asyncio.to_thread(held.finished.wait, 60)
    with pytest.raises(asyncio.CancelledError):
        await task
    return seen


async def test_a_fresh_job_cancelled_while_its_workspace_is_made_removes_it_before_its_uid_goes(
    base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    jobs, workspaces, uids = _jobs(base, sessions=False)
    held = _Held(workspaces.create_job)
    monkeypatch.setattr(workspaces, "create_job", held)

    async def job() -> None:
        async with jobs.fresh():
            pytest.fail("the job ran although it was cancelled before its workspace came")

    in_use = await _cancel_while_held(held, asyncio.create_task(job()), lambda: uids.in_use)
    await jobs.drain()
    assert in_use, "the UID went back while its workspace was still being made"
    dirs = held.made
    assert isinstance(dirs, JobDirs)
    assert not dirs.workspace.exists(), "the workspace the thread made was left"
    assert uids.in_use == frozenset()
    assert not jobs.busy()


async def test_a_session_job_cancelled_while_its_job_dir_is_made_removes_it(
    base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    jobs, workspaces, _ = _jobs(base, sessions=True)
    sessions = jobs.sessions
    await sessions.bind(SESSION)
    held = _Held(workspaces.create_session_job_dir)
    monkeypatch.setattr(workspaces, "create_session_job_dir", held)

    async def job() -> None:
        async with jobs.session(SESSION):
            pytest.fail("the job ran although it was cancelled before its job directory came")

    state = sessions.bound
    assert state is not None
    locked = await _cancel_while_held(held, asyncio.create_task(job()), state.lock.locked)
    assert locked, "the session lock went while its job directory was being made"
    job_dir = held.made
    assert isinstance(job_dir, Path)
    assert not job_dir.exists(), "the job directory the thread made was left"
    assert not state.lock.locked()
    assert not jobs.busy()
    await sessions.release(SESSION)


async def test_a_launch_cancelled_while_its_cgroup_is_made_destroys_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with real_jail("launchcg-") as (jail, cgroups, root):
        held = _Held(cgroups.create)
        monkeypatch.setattr(cgroups, "create", held)
        spec = shell_job(root / "ws", root / "job", "true", uid=20_930)
        stdin = os.open(os.devnull, os.O_RDONLY)
        output_r, output_w = os.pipe()
        try:
            task = asyncio.create_task(jail.launch(spec, stdin_fd=stdin, output_fd=output_w))
            await _cancel_while_held(held, task, lambda: None)
        finally:
            for fd in (stdin, output_r, output_w):
                os.close(fd)
        cgroup = held.made
        assert isinstance(cgroup, JobCgroup)
        assert _left_destroyed(cgroup) == [], "the cgroup the thread made was left"


async def test_a_launched_jobs_wait_cancelled_twice_still_destroys_its_cgroup() -> None:
    with real_jail("waitcg-") as (jail, _, root):
        spec = shell_job(root / "ws", root / "job", "sleep 60", uid=20_931)
        stdin = os.open(os.devnull, os.O_RDONLY)
        output_r, output_w = os.pipe()
        try:
            job = await jail.launch(spec, stdin_fd=stdin, output_fd=output_w)
        finally:
            for fd in (stdin, output_w):
                os.close(fd)
        try:
            cgroup = job._cgroup
            assert cgroup is not None
            # The first cancellation kills the job; its ``finally`` reads the cgroup's
            # stats in a thread, held there while the second one comes.
            held = _Held(cgroup.stats)
            cgroup.stats = held  # type: ignore[method-assign]
            task: asyncio.Task[None] = asyncio.create_task(_wait(job))
            for _ in range(10):
                await asyncio.sleep(0)
            task.cancel()
            await _cancel_while_held(held, task, lambda: None)
        finally:
            os.close(output_r)
        assert _left_destroyed(cgroup) == [], "the job's cgroup was left"


async def _wait(job: LaunchedJob) -> None:
    await job.wait()


def _left_destroyed(cgroup: JobCgroup) -> list[Path]:
    """The cgroup's directories still there, which are then removed (the test's own)."""
    left = [d for d in cgroup._dirs if d.exists()]
    cgroup.destroy()
    return left
