"""A real ``Jail`` (nsjail, cgroups, spawn helper) under a traversable root, for the
jail tests that drive ``Jail.run`` directly, and the limits their jobs run with."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandcell_runner.config import _find_nsjail
from sandcell_runner.jail.cgroup_reaper import InstanceLease
from sandcell_runner.jail.cgroups import CgroupManager
from sandcell_runner.jail.nsjail import Jail
from sandcell_runner.jail.spawn_helper import SpawnHelper
from sandcell_runner.jail.spec import JobLimits, JobSpec
from tests.fixtures.paths import traversable_dir

LIMITS = JobLimits(
    timeout_ms=20_000,
    memory_bytes=256 << 20,
    pids=64,
    stdout_bytes=64 * 1024,
    stderr_bytes=64 * 1024,
    file_size_mib=16,
    open_files=64,
    tmp_mib=16,
)


SPAWN_METHODS = ("vfork", "fork")
"""The spawn helper's two ways to start a child (``_vfork.c``, and ``fork`` in Python)."""


def spawn_helper(method: str) -> SpawnHelper:
    """A helper that starts children by ``method``; fails if ``vfork`` is not built."""
    helper = SpawnHelper(vfork=method == "vfork")
    if helper.spawn_method != method:
        helper.close()
        pytest.fail(f"the spawn helper uses {helper.spawn_method}, not {method} (built?)")
    return helper


def helper_method(helper_pid: int) -> str:
    """How a running helper starts children: whether it has the extension mapped."""
    with open(f"/proc/{helper_pid}/maps") as maps:
        return "vfork" if "/_vfork." in maps.read() else "fork"


@contextlib.contextmanager
def real_jail(prefix: str, *, method: str = "vfork") -> Iterator[tuple[Jail, CgroupManager, Path]]:
    with traversable_dir(prefix) as root:
        instance = f"test-{os.getpid()}-{root.name}"
        # Leased as a runner leases its own: an unleased subtree is an orphan to the
        # host-wide sweep (``reap_orphans``) a parallel test runs, which removed this
        # jail's pooled cgroup between two of its jobs (empty, so "nobody's").
        lease = InstanceLease(instance)
        if not lease.held:
            pytest.fail(f"cgroup lease of {instance} not taken (see the log)")
        cgroups = CgroupManager(instance)
        if not cgroups.available:
            lease.release()
            pytest.fail("this test needs writable cgroups (run as root, as CI does)")
        spawner = spawn_helper(method)
        jail = Jail(nsjail=_find_nsjail(None), cgroups=cgroups, spawner=spawner)
        try:
            yield jail, cgroups, root
        finally:
            spawner.close()
            cgroups.release_all()
            lease.release()


def shell_job(workspace: Path, job_dir: Path, script: str, *, uid: int) -> JobSpec:
    """``sh -c script`` as ``uid`` with ``LIMITS``, in two fresh directories it owns."""
    for directory in (workspace, job_dir):
        directory.mkdir()
        os.chown(directory, uid, uid)
    return JobSpec(
        argv=["/bin/sh", "-c", script],
        workspace=workspace,
        job_dir=job_dir,
        uid=uid,
        gid=uid,
        env={"PATH": "/usr/bin:/bin"},
        limits=LIMITS,
    )


async def release_fifo(fifo: Path) -> None:
    """Open ``fifo`` for writing once its reader is there, then close it (EOF)."""
    async with asyncio.timeout(30):
        while True:
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as exc:
                if exc.errno != errno.ENXIO:  # ENXIO: no reader yet
                    raise
                await asyncio.sleep(0.05)
                continue
            os.close(fd)
            return
