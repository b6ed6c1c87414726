"""The local provider reaps the cgroups of a runner it had to kill (issue 14, item 9)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from sandcell_orchestrator.handle import SandboxHandle
from sandcell_orchestrator.providers.base import SandboxSpec
from sandcell_orchestrator.providers.local import LocalProvider, LocalSettings
from sandcell_orchestrator.providers.runner_roots import free_loopback_port, reap_runner_cgroups
from sandcell_protocol import ExecuteRequest
from sandcell_runner.jail.cgroup_reaper import InstanceLease, instance_key
from sandcell_runner.jail.cgroups import CGROUP_ROOT, V1_CONTROLLERS
from tests.fixtures.paths import traversable_dir
from tests.orchestrator.cli.conftest import stop_leftovers


def _folders(key: str) -> int:
    count = 0
    for top in (
        *(CGROUP_ROOT / c / "sandcell" / key for c in V1_CONTROLLERS),
        CGROUP_ROOT / "sandcell" / key,
    ):
        if top.is_dir():
            count += 1 + sum(1 for child in top.iterdir() if child.is_dir())
    return count


def _pool_cgroups(key: str) -> list[Path]:
    return [
        child
        for top in (
            *(CGROUP_ROOT / c / "sandcell" / key for c in V1_CONTROLLERS),
            CGROUP_ROOT / "sandcell" / key,
        )
        if top.is_dir()
        for child in top.iterdir()
        if child.is_dir() and child.name.startswith("job-pool-")
    ]


async def _one_job_ran(provider: LocalProvider, root: Path) -> tuple[SandboxHandle, Path, str, int]:
    """A sandbox that ran one job: its handle, its runner's root, cgroup key and pid."""
    handle = await provider.create(SandboxSpec())
    result = await handle.runner.execute(ExecuteRequest(language="bash", code="echo hi"))
    assert result.stdout == "hi\n"
    runner_root = root / "rt" / handle.sandbox_id
    pid = json.loads((runner_root / "sandbox.json").read_text())["pid"]
    return handle, runner_root, instance_key(runner_root / "workspaces"), pid


async def test_destroying_a_killed_runner_removes_its_cgroups() -> None:
    """A runner that died by SIGKILL (a crash, an OOM kill of the runner) leaves its job
    cgroups; destroy removes them: no folder of it is left."""
    with traversable_dir("reap-") as root:
        provider = LocalProvider(LocalSettings(runtime_dir=root / "rt"))
        try:
            handle, _, key, pid = await _one_job_ran(provider, root)
            assert _folders(key) > 0
            os.killpg(pid, signal.SIGKILL)
            await handle.runner.close()
            await provider.destroy(handle.sandbox_id)
            assert _folders(key) == 0
        finally:
            await provider.close()


async def test_the_sweeper_reaps_a_runner_killed_before_its_launch_was_recorded() -> None:
    """A worker died while launching a runner (so no ``sandbox.json`` was written), and
    the runner was SIGKILLed after it had made its cgroups. The root is a dead sandbox;
    destroying it (what the sweeper does) removes the cgroups too, not only the root:
    nothing else would ever find them once the root's name is gone."""
    with traversable_dir("reap-") as base:
        runtime = base / "rt"
        provider = LocalProvider(LocalSettings(runtime_dir=runtime))
        sandbox_id = "local-" + secrets.token_hex(8)
        root = runtime / sandbox_id
        root.mkdir(0o711)
        token_file = root / "token"
        token_file.write_text(secrets.token_urlsafe(32))
        token_file.chmod(0o600)
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "SANDCELL_RUNNER_HOST": "127.0.0.1",
            "SANDCELL_RUNNER_PORT": str(free_loopback_port()),
            "SANDCELL_WORKSPACE_ROOT": str(root / "workspaces"),
            "SANDCELL_INPUT_CACHE_DIR": str(root / "input-cache"),
            "SANDCELL_RUNNER_SESSIONS": "1",
            "SANDCELL_RUNNER_TOKEN_FILE": str(token_file),
        }
        key = instance_key(root / "workspaces")
        with (root / "runner.log").open("ab") as out:
            runner = subprocess.Popen(
                [sys.executable, "-m", "sandcell_runner"],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            deadline = time.monotonic() + 60
            # Up to its cgroups (a runner makes its parents as it starts).
            while not _folders(key) and time.monotonic() < deadline:
                assert runner.poll() is None, (root / "runner.log").read_text()[-2000:]
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.2)
            assert _folders(key)
            os.killpg(runner.pid, signal.SIGKILL)
            runner.wait()
            assert sandbox_id in await provider.dead_sandboxes()
            await provider.destroy(sandbox_id)
            assert _folders(key) == 0
            assert not root.exists()
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(runner.pid, signal.SIGKILL)
            runner.wait()
            await provider.close()


async def test_a_runner_killed_while_destroy_waits_for_it_leaves_no_cgroups() -> None:
    """A runner SIGKILLed by someone else (an OOM kill, an operator) while destroy waits
    for it to stop after its SIGTERM: it never ran its own removal, so its job-pool
    cgroups (made by its first restore and job, kept for the next ones) are destroy's
    to remove, though the runner did stop within the wait."""
    with traversable_dir("reap-") as root:
        provider = LocalProvider(LocalSettings(runtime_dir=root / "rt"))
        try:
            handle, runner_root, key, pid = await _one_job_ran(provider, root)
            assert _pool_cgroups(key)
            # Stopped, it cannot act on the SIGTERM; the SIGKILL lands in the wait.
            os.killpg(pid, signal.SIGSTOP)
            await handle.runner.close()
            destroying = asyncio.create_task(provider.destroy(handle.sandbox_id))
            await asyncio.sleep(0.5)
            assert not destroying.done()
            os.killpg(pid, signal.SIGKILL)
            await destroying
            assert _folders(key) == 0
            assert not runner_root.exists()
        finally:
            await provider.close()


async def test_the_leftover_fixture_reaps_the_cgroups_of_the_runners_it_kills() -> None:
    """``stop_leftovers`` SIGKILLs the runners a test (a fleet with a shared registry,
    whose workers leave their sandboxes alive by design) left under its runtime
    directory: their job-pool cgroups go too, not only the processes. Each fleet test
    module left a dozen empty ``sandcell/<key>`` subtrees before."""
    with traversable_dir("reap-") as root:
        provider = LocalProvider(LocalSettings(runtime_dir=root / "rt"))
        handle, _, key, pid = await _one_job_ran(provider, root)
        try:
            assert _pool_cgroups(key)
            await handle.runner.close()
            killed = stop_leftovers(root / "rt")
            assert pid in {process.pid for process in killed}
            assert _folders(key) == 0
        finally:
            await provider.destroy(handle.sandbox_id)
            await provider.close()


def test_a_reaper_that_cannot_run_does_not_keep_the_root() -> None:
    """Only the reaper's "a subtree is still there" keeps a root for the sweeper's next
    round. An interpreter without the runner package exits 1 with a traceback, as any
    crash does: no later round would do better, so the root goes."""
    with traversable_dir("reap-") as root:
        (root / "workspaces").mkdir()
        assert (
            subprocess.run(
                ["/usr/bin/python3", "-I", "-c", "import sandcell_runner"], capture_output=True
            ).returncode
            == 1
        ), "the system interpreter must lack sandcell_runner for this test"
        assert reap_runner_cgroups("/usr/bin/python3", root) is True
        assert reap_runner_cgroups(sys.executable, root) is True  # nothing of it was there


async def test_a_root_kept_for_its_cgroups_forgets_the_runners_pid() -> None:
    """A destroy that must keep a gone runner's root (its cgroups are still there: here
    the test holds their lease, as a live runner would) drops the runner's state: no
    later round signals the pid it named, which may be another process's by then.
    The root is still a dead sandbox, and the next destroy removes cgroups and root."""
    with traversable_dir("reap-") as root:
        provider = LocalProvider(LocalSettings(runtime_dir=root / "rt"))
        try:
            handle, runner_root, key, pid = await _one_job_ran(provider, root)
            assert _folders(key) > 0
            os.killpg(pid, signal.SIGKILL)
            await handle.runner.close()
            deadline = time.monotonic() + 60  # a bound on a loaded machine, not a timing
            while psutil.pid_exists(pid) and time.monotonic() < deadline:
                await asyncio.sleep(0.02)  # until the provider has reaped it
            assert not psutil.pid_exists(pid)
            lease = InstanceLease(key)
            assert lease.held
            try:
                await provider.destroy(handle.sandbox_id)
                assert runner_root.is_dir()  # kept: its cgroups are what it names
                assert _folders(key) > 0
                assert not (runner_root / "sandbox.json").exists()
                assert handle.sandbox_id in await provider.dead_sandboxes()
            finally:
                lease.release()
            await provider.destroy(handle.sandbox_id)
            assert _folders(key) == 0
            assert not runner_root.exists()
        finally:
            await provider.close()
