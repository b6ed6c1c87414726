"""Killed runners' cgroup subtrees are reaped (issue 14, item 9): real runners, real cgroups."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

from sandcell_runner.jail.cgroup_reaper import (
    EXIT_LEFT,
    LEASE_DIR,
    InstanceLease,
    instance_key,
    reap_instance,
    reap_orphans,
)
from sandcell_runner.jail.cgroups import CGROUP_ROOT, V1_CONTROLLERS
from tests.fixtures.paths import traversable_dir
from tests.fixtures.runner_process import RunnerProcess, start_runner
from tests.runner.helpers import execute
from tests.runner.jail.real_jail import real_jail, shell_job


def subtree_folders(runners: list[RunnerProcess]) -> int:
    """Folders under ``sandcell/`` in every controller that belong to these runners."""
    count = 0
    for runner in runners:
        key = instance_key(runner.workspace_root)
        for top in (
            *(CGROUP_ROOT / c / "sandcell" / key for c in V1_CONTROLLERS),
            CGROUP_ROOT / "sandcell" / key,
        ):
            if top.is_dir():
                count += 1 + sum(1 for child in top.iterdir() if child.is_dir())
    return count


def _sigkill(runner: RunnerProcess) -> None:
    os.killpg(runner.process.pid, signal.SIGKILL)
    runner.process.wait(timeout=10)


def test_a_killed_runners_cgroups_are_reaped_by_the_fixture() -> None:
    """Two runners run jobs and are SIGKILLed; stopping them (the fixtures' teardown)
    leaves no folder of theirs under the cgroup hierarchy."""
    with traversable_dir() as root:
        runners = [start_runner(root / "a"), start_runner(root / "b")]
        try:
            before = subtree_folders(runners)
            for runner in runners:
                assert execute(runner, language="bash", code="echo hi")["stdout"] == "hi\n"
            assert subtree_folders(runners) > before
            for runner in runners:
                _sigkill(runner)
            assert subtree_folders(runners) > before  # nobody removed them yet
        finally:
            for runner in runners:
                runner.stop()
        assert subtree_folders(runners) == 0


def test_a_live_runners_cgroups_are_never_reaped() -> None:
    """A live runner holds a lease on its subtree: neither a targeted reap nor the host-wide
    orphan sweep touches it, and its next job runs; once killed, the sweep removes it."""
    with traversable_dir() as root:
        runner = start_runner(root / "live")
        try:
            execute(runner, language="bash", code="true")
            key = instance_key(runner.workspace_root)
            assert not reap_instance(key)
            assert key not in reap_orphans(older_than_s=0)
            assert execute(runner, language="bash", code="echo still")["stdout"] == "still\n"
            _sigkill(runner)
            assert key in reap_orphans(older_than_s=0)
            assert subtree_folders([runner]) == 0
        finally:
            runner.stop()


def test_reaper_command_removes_one_runner() -> None:
    """``python -m sandcell_runner.jail.cgroup_reaper ROOT`` (what the local provider and
    the MicroVM emulator run) removes exactly that runner's subtree."""
    with traversable_dir() as root:
        runner = start_runner(root / "cmd")
        try:
            execute(runner, language="bash", code="true")
            _sigkill(runner)
            assert subtree_folders([runner]) > 0
            done = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "sandcell_runner.jail.cgroup_reaper",
                    str(runner.workspace_root),
                ],
                capture_output=True,
                check=False,
                timeout=60,
            )
            assert done.returncode == 0, done.stderr
            assert subtree_folders([runner]) == 0
        finally:
            runner.stop()


def test_reaper_command_says_a_leased_subtree_is_left_in_its_own_status() -> None:
    """A subtree it must leave (its lease is held) exits ``EXIT_LEFT``: not 1, which is
    what any crash of the interpreter exits, and the local provider keeps a runner's
    root only for the former."""
    with traversable_dir() as root:
        lease = InstanceLease(instance_key(root / "ws"))
        assert lease.held
        try:
            done = subprocess.run(
                [sys.executable, "-m", "sandcell_runner.jail.cgroup_reaper", str(root / "ws")],
                capture_output=True,
                check=False,
                timeout=60,
            )
        finally:
            lease.release()
            assert reap_instance(instance_key(root / "ws"))  # and its lease file goes
        assert done.returncode == EXIT_LEFT, done.stderr
        assert EXIT_LEFT not in (0, 1, 2)


def test_a_runner_stopped_gracefully_leaves_neither_its_cgroups_nor_its_lease_file() -> None:
    """A runner that ran a job and was stopped with SIGTERM removes its own subtree and
    its lease file: each root is a runner's own, so files left by graceful stops would
    pile up in /run for as long as the host runs."""
    with traversable_dir() as root:
        runner = start_runner(root / "graceful")
        lease_file = LEASE_DIR / instance_key(runner.workspace_root)
        try:
            execute(runner, language="bash", code="true")
            assert lease_file.exists()
            assert subtree_folders([runner]) > 0
            os.killpg(runner.process.pid, signal.SIGTERM)
            runner.process.wait(timeout=60)
            assert subtree_folders([runner]) == 0
            assert not lease_file.exists()
        finally:
            runner.stop()


def test_the_host_wide_sweep_leaves_a_test_jails_pooled_cgroups() -> None:
    """A test's jail (``real_jail``) leases its instance as a runner does: the orphan
    sweep another test runs in parallel, between two of its jobs (its pooled cgroup
    empty then), leaves it, and its next job runs in the same slot."""
    with real_jail("sweep-") as (jail, cgroups, root):

        async def run(name: str) -> str:
            spec = shell_job(root / name, root / f"{name}-job", "echo ran", uid=61_237)
            outcome = await jail.run(spec)
            assert outcome.exit_code == 0, outcome.jail_log
            return outcome.stdout.decode()

        assert asyncio.run(run("before")) == "ran\n"
        instance = cgroups.instance_dir("memory")
        assert instance is not None
        assert instance.name not in reap_orphans(older_than_s=0)
        assert (instance / "job-pool-s0").is_dir()
        assert asyncio.run(run("after")) == "ran\n"
