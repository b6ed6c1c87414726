"""How a job or a restore joins its pooled cgroup, and what a retired slot leaves.

Real nsjail and cgroups. A pooled cgroup holds its v1 ``tasks`` files open, so a
job's join (and a restore extractor's) is a write to a held descriptor (the two opens
per job were most of the join's cost); those descriptors are the cgroup's, closed
when its slot is retired. A slot is retired when its job is cancelled while a thread
works on its cgroup: the thread is waited for, then the cgroup goes with every
descriptor it held (before, the thread went on and made a cgroup, with descriptors,
that nothing would close for the runner's life).
"""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from sandcell_runner.checkpoint.session import SessionCheckpoints
from sandcell_runner.jail.cgroups import CgroupManager
from sandcell_runner.jail.spawner import SpawnRequest, StartedProcess
from tests.runner.jail.real_jail import real_jail, release_fifo, shell_job

UID = 61_236


@pytest.fixture(autouse=True)
def _needs_root() -> None:
    if os.geteuid() != 0:
        pytest.fail("the jail tests run as root, as CI does")


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def _slot_files(cgroups: CgroupManager, slot: str, name: str) -> list[str]:
    return [str(parent / f"job-pool-{slot}" / name) for parent in cgroups._parents]


async def test_a_job_joins_its_pooled_cgroup_through_held_tasks_descriptors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three jobs in one slot: each request carries the same open descriptors of the
    slot's ``tasks`` files (no path for the child to open), and each job runs."""
    with real_jail("join-") as (jail, cgroups, root):
        spawner = jail._spawner
        real_start = spawner.start
        seen: list[tuple[list[int], list[str], object]] = []

        def recording(request: SpawnRequest) -> StartedProcess:
            fds = list(request.cgroup_fds)
            seen.append(
                (fds, [os.readlink(f"/proc/self/fd/{fd}") for fd in fds], request.cgroup_tasks)
            )
            return real_start(request)

        monkeypatch.setattr(spawner, "start", recording)
        for index in range(3):
            outcome = await jail.run(
                shell_job(root / f"w{index}", root / f"j{index}", "true", uid=UID)
            )
            assert outcome.exit_code == 0, outcome.jail_log
        tasks = _slot_files(cgroups, "s0", "tasks")
        assert [paths for _, paths, _ in seen] == [tasks] * 3
        assert [tasks_paths for _, _, tasks_paths in seen] == [None] * 3
        assert seen[0][0] == seen[1][0] == seen[2][0], "the descriptors are the slot's own"


class _Held:
    """A blocking call held in its thread until ``release``."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self.entered = threading.Event()
        self.release = threading.Event()
        self.finished = threading.Event()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.entered.set()
        self.release.wait(60)
        try:
            return self._real(*args, **kwargs)
        finally:
            self.finished.set()


async def test_a_slot_retired_by_a_cancelled_job_leaves_no_descriptor_or_cgroup(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A job cancelled while its new slot's cgroup is made in a thread: once it has
    ended, the runner holds as many descriptors as before, and that slot's cgroup is
    gone; the next job still runs."""
    with real_jail("retire-") as (jail, cgroups, root):

        def job(name: str, script: str) -> Any:
            return jail.run(shell_job(root / name, root / f"{name}-job", script, uid=UID))

        first = await job("first", "true")  # slot 0, and whatever the loop opens once
        assert first.exit_code == 0, first.jail_log
        before = _fd_count()
        # Slot 0 stays busy (its job waits on a FIFO), so the cancelled job makes slot 1.
        slow = asyncio.create_task(job("slow", "cat gate > /dev/null"))
        gate = root / "slow" / "gate"
        os.mkfifo(gate, 0o666)  # before the task first runs
        held = _Held(cgroups.acquire)
        monkeypatch.setattr(cgroups, "acquire", held)
        cancelled = asyncio.create_task(job("cancelled", "true"))
        await asyncio.to_thread(held.entered.wait, 60)
        cancelled.cancel()
        for _ in range(10):
            await asyncio.sleep(0)
        held.release.set()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        assert held.finished.is_set()
        await release_fifo(gate)
        assert (await slow).exit_code == 0
        monkeypatch.undo()
        assert _fd_count() == before, "the retired slot's cgroup kept descriptors open"
        assert not any(Path(path).exists() for path in _slot_files(cgroups, "s1", ""))
        assert "s1" not in cgroups._pool
        after = await job("after", "true")
        assert after.exit_code == 0, after.jail_log


def test_a_restores_extractor_joins_through_the_pooled_cgroups_held_descriptors() -> None:
    """The restore's pooled cgroup hands its extractor the same held ``tasks``
    descriptors each time, none opened (nor closed) by the restore itself."""
    with real_jail("restorejoin-") as (_, cgroups, _root):
        cgroup = cgroups.acquire("restore", memory_bytes=256 << 20, pids=16)
        first = SessionCheckpoints._join_fds(cgroup)
        second = SessionCheckpoints._join_fds(cgroup)
        assert first == second
        fds, moves_thread, opened = first
        assert moves_thread
        assert opened == []
        assert [os.readlink(f"/proc/self/fd/{fd}") for fd in fds] == _slot_files(
            cgroups, "restore", "tasks"
        )
