"""Pooled job cgroups under concurrency, driven through ``Jail`` with a real nsjail.

An unprivileged runner gives every job the same UID (``UidPool.shared``), so the
pooled cgroup a job runs in must not be chosen by UID: two concurrent jobs would
share it, and the first to finish would kill the other as its "leftover".
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandcell_runner.errors import JailError
from sandcell_runner.jail.cgroups import CgroupManager
from sandcell_runner.jail.nsjail import Jail
from sandcell_runner.jail.nsjail_config import MAX_CONFIG_BYTES
from sandcell_runner.jail.spec import JobSpec
from tests.runner.jail.real_jail import SPAWN_METHODS, real_jail, release_fifo, shell_job

UID = 61_234


@pytest.fixture(params=SPAWN_METHODS)
def jail_root(request: pytest.FixtureRequest) -> Iterator[tuple[Jail, CgroupManager, Path]]:
    """On both of the spawn helper's paths (the child joins the cgroup either way)."""
    with real_jail("jail-", method=request.param) as made:
        yield made


def _spec(root: Path, name: str, script: str) -> JobSpec:
    return shell_job(root / name, root / f"{name}-job", script, uid=UID)


def test_concurrent_jobs_of_one_uid_do_not_share_a_cgroup(
    jail_root: tuple[Jail, CgroupManager, Path],
) -> None:
    jail, _, root = jail_root
    # The slow job blocks on a FIFO the test opens only once the quick job is done,
    # so the two overlap however slow the host is.
    slow = _spec(root, "slow", "cat gate > /dev/null; echo survived")
    gate = slow.workspace / "gate"
    os.mkfifo(gate, 0o666)
    quick = _spec(root, "quick", "echo quick")

    async def both() -> tuple[str, str]:
        slow_task = asyncio.create_task(jail.run(slow))
        quick_outcome = await jail.run(quick)
        assert not slow_task.done()
        await release_fifo(gate)
        slow_outcome = await slow_task
        assert quick_outcome.exit_code == 0, quick_outcome.jail_log
        assert slow_outcome.exit_code == 0, (slow_outcome.signal, slow_outcome.jail_log)
        return slow_outcome.stdout.decode(), quick_outcome.stdout.decode()

    slow_out, quick_out = asyncio.run(both())
    assert (slow_out, quick_out) == ("survived\n", "quick\n")


def test_a_job_that_cannot_start_leaks_no_descriptor(
    jail_root: tuple[Jail, CgroupManager, Path],
) -> None:
    jail, _, root = jail_root
    oversized = dataclasses.replace(
        _spec(root, "huge", "true"), env={"PATH": "/usr/bin:/bin", "X": "a" * MAX_CONFIG_BYTES}
    )

    async def refused() -> None:
        with pytest.raises(JailError, match="too large"):
            await jail.run(oversized)

    asyncio.run(refused())  # a first run settles what the loop itself opens
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        asyncio.run(refused())
    assert len(os.listdir("/proc/self/fd")) == before


def test_slots_are_reused_not_multiplied(jail_root: tuple[Jail, CgroupManager, Path]) -> None:
    jail, cgroups, root = jail_root

    async def sequential() -> None:
        for index in range(4):
            outcome = await jail.run(_spec(root, f"job{index}", "true"))
            assert outcome.exit_code == 0, outcome.jail_log

    asyncio.run(sequential())
    pooled = {path.name for directory in cgroups._parents for path in directory.iterdir()}
    assert {name for name in pooled if name.startswith("job-pool-")} == {"job-pool-s0"}


def test_a_pooled_cgroup_reports_each_job_apart(
    jail_root: tuple[Jail, CgroupManager, Path],
) -> None:
    """One slot, four jobs in turn: the OOM kill and the memory peak are each job's own."""
    jail, cgroups, root = jail_root
    hog = "exec /usr/bin/python3 -c 'b = bytearray({} << 20)'"

    async def sequential() -> list[tuple[bool, int | None]]:
        seen = []
        for index, script in enumerate([hog.format(400), "true", hog.format(64), "true"]):
            outcome = await jail.run(_spec(root, f"job{index}", script))
            assert outcome.cgroup is not None
            seen.append((outcome.cgroup.oom_killed, outcome.cgroup.memory_peak_bytes))
        return seen

    seen = asyncio.run(sequential())
    assert [oom for oom, _ in seen] == [True, False, False, False]
    peaks = [peak or 0 for _, peak in seen]
    assert all(peak is not None for _, peak in seen), seen
    assert peaks[2] >= 64 << 20
    # Neither the first job's peak (at its 256 MiB limit) nor the third's carries over.
    assert peaks[1] < 32 << 20
    assert peaks[3] < 32 << 20
    pooled = {path.name for directory in cgroups._parents for path in directory.iterdir()}
    assert {name for name in pooled if name.startswith("job-pool-")} == {"job-pool-s0"}


@pytest.fixture(autouse=True)
def _needs_root() -> None:
    if os.geteuid() != 0:
        pytest.fail("the jail tests run as root, as CI does")


def test_a_process_left_in_a_slot_is_killed_after_the_next_job(
    jail_root: tuple[Jail, CgroupManager, Path],
) -> None:
    """Whatever is in a pooled cgroup when a job ends is SIGKILLed: the check that
    usually finds nothing (one read of ``pids.current``) still sees a process there."""
    jail, cgroups, root = jail_root

    async def run(name: str) -> None:
        outcome = await jail.run(_spec(root, name, "true"))
        assert outcome.exit_code == 0, outcome.jail_log

    asyncio.run(run("first"))
    stray = subprocess.Popen(["/bin/sleep", "60"])
    try:
        for parent in cgroups._parents:
            (parent / "job-pool-s0" / "cgroup.procs").write_text(str(stray.pid))
        asyncio.run(run("second"))
        assert stray.wait(timeout=10) == -signal.SIGKILL
    finally:
        if stray.poll() is None:
            stray.kill()
            stray.wait()
