"""Per-job cgroups: memory and pids limits, and the OOM counter that names a memory kill.

The runner creates one cgroup per job and moves nsjail into it before exec, so the
whole process tree (nsjail, the job, its children) is accounted there. Reading the
cgroup's own OOM counter after the job ends is the only reliable way to tell an
out-of-memory SIGKILL from a timeout SIGKILL (both are exit 137; nsjail's log does
not say). nsjail's own cgroup options are left unused for that reason: nsjail
deletes its cgroup when the job exits, taking the counter with it.

cgroup v1 (this machine: memory, pids, cpu controllers) and v2 are supported; when
neither is writable (an unprivileged developer laptop) ``CgroupManager.available``
is False and the runner falls back to rlimits and says so in ``/health``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
from pathlib import Path

from .job_cgroup import JobCgroup, JobCgroupStats, apply_limits, keyed_value, read_pids

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
V1_CONTROLLERS = ("memory", "pids")
V1_OPTIONAL = ("cpu",)
"""Used when mounted: the session's CPU quota sits on the instance's cpu cgroup."""
V1_ALL = V1_CONTROLLERS + V1_OPTIONAL
CPU_PERIOD_US = 100_000


class CgroupManager:
    """Creates job cgroups under ``sandcell/<instance>`` in each controller."""

    def __init__(
        self, instance: str, *, root: Path = CGROUP_ROOT, cpu_millicores: int | None = None
    ) -> None:
        self._instance = instance
        self._root = root
        self._cpu_millicores = cpu_millicores
        self.cpu_limited = False
        """Whether every job and process of this runner shares the CPU quota."""
        self._pool: dict[str, JobCgroup] = {}
        self.version = 0
        self._parents: list[Path] = []
        self.reason = ""
        try:
            self._setup()
        except OSError as exc:
            self.version = 0
            self._parents = []
            self.reason = f"cgroups unavailable: {exc.strerror or exc}"

    @property
    def available(self) -> bool:
        return self.version != 0

    def _setup(self) -> None:
        if all((self._root / c / "cgroup.procs").exists() for c in V1_CONTROLLERS):
            controllers = list(V1_CONTROLLERS)
            cpu = (
                self._cpu_millicores is not None and (self._root / "cpu" / "cgroup.procs").exists()
            )
            parents = [self._root / c / "sandcell" / self._instance for c in controllers]
            for parent in parents:
                parent.mkdir(parents=True, exist_ok=True)
            if cpu:
                cpu = self._optional_parent(self._root / "cpu" / "sandcell" / self._instance)
                if cpu:
                    parents.append(self._root / "cpu" / "sandcell" / self._instance)
            self._parents = parents
            self.version = 1
            if cpu and self._cpu_millicores is not None:
                # One quota on the instance: its job and process cgroups are children,
                # and a v1 child never gets more than its parent's quota.
                cpu_parent = parents[-1]
                (cpu_parent / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
                quota = self._cpu_millicores * CPU_PERIOD_US // 1000
                (cpu_parent / "cpu.cfs_quota_us").write_text(str(quota))
                self.cpu_limited = True
            return
        if (self._root / "cgroup.controllers").exists():
            self._setup_v2()
            return
        raise OSError(errno.ENOENT, "no cgroup v1 memory+pids or v2 hierarchy found")

    def _setup_v2(self) -> None:
        # v2's "no internal processes" rule: enable controllers on the path from the
        # root down to our parent, whose children are only job cgroups.
        parent = self._root / "sandcell" / self._instance
        parent.mkdir(parents=True, exist_ok=True)
        wanted = "+memory +pids"
        if self._cpu_millicores is not None and "cpu" in (
            (self._root / "cgroup.controllers").read_text().split()
        ):
            wanted += " +cpu"
        for node in (self._root, self._root / "sandcell", parent):
            (node / "cgroup.subtree_control").write_text(wanted)
        self._parents = [parent]
        self.version = 2
        if "+cpu" in wanted and self._cpu_millicores is not None:
            quota = self._cpu_millicores * CPU_PERIOD_US // 1000
            (parent / "cpu.max").write_text(f"{quota} {CPU_PERIOD_US}")
            self.cpu_limited = True

    @staticmethod
    def _optional_parent(parent: Path) -> bool:
        """Make a parent in an optional controller; False where it is not writable.

        A container engine may leave the cpu controller read-only while memory and
        pids are writable: the runner then runs without the CPU quota (``/health``
        says so) instead of without any cgroup.
        """
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            log.warning("cpu cgroup not writable (%s): no session CPU quota", exc.strerror)
            return False
        return True

    def instance_dir(self, controller: str = "memory") -> Path | None:
        """The instance's own cgroup directory (``sandcell/<instance>``): the one
        directory on v2, ``controller``'s on v1; None without cgroups or that controller."""
        if self.version == 2:
            return self._parents[0] if self._parents else None
        return next((p for p in self._parents if p.parent.parent.name == controller), None)

    def reap_leftovers(self) -> int:
        """Kill and remove job cgroups a previous runner with this instance left behind."""
        count = 0
        for parent in self._parents:
            for child in parent.iterdir() if parent.exists() else ():
                if child.is_dir() and child.name.startswith("job-"):
                    JobCgroup([child], version=self.version).destroy()
                    count += 1
        return count

    def acquire(self, key: str, *, memory_bytes: int, pids: int) -> JobCgroup:
        """A reusable cgroup ``job-pool-<key>`` (one per job slot), limits set for the next job.

        Reusing beats create + rmdir per job: removing a memory cgroup queues kernel
        work that holds the cgroup mutex, and the next job's attach waited ~7 ms on
        it after a Python job. Callers must never run two jobs under one key at once.
        """
        cgroup = self._pool.get(key)
        if cgroup is None:
            cgroup = self.create(f"pool-{key}", memory_bytes=memory_bytes, pids=pids)
            self._pool[key] = cgroup
        cgroup.begin(memory_bytes=memory_bytes, pids=pids)
        return cgroup

    def pooled(self, key: str, *, memory_bytes: int, pids: int) -> JobCgroup | None:
        """The pooled cgroup for ``key`` if it exists and already has these limits.

        Then ``acquire`` would only reset counters, which the event loop can do
        inline; None means ``acquire`` has real work (mkdir, limit writes) for a thread.
        """
        cgroup = self._pool.get(key)
        if cgroup is None or not cgroup.has_limits(memory_bytes=memory_bytes, pids=pids):
            return None
        return cgroup

    def retire(self, key: str) -> None:
        """Destroy ``key``'s pooled cgroup, and close its descriptors, for good: its slot
        is not used again (a cancelled job's, once no thread of it is left running on it)."""
        cgroup = self._pool.pop(key, None)
        if cgroup is not None:
            cgroup.destroy()

    def release_all(self) -> None:
        """Destroy pooled cgroups and this runner's parent (at shutdown)."""
        pooled, self._pool = self._pool, {}
        for cgroup in pooled.values():
            cgroup.destroy()
        for parent in self._parents:
            # Empty unless a launched process is still being torn down; leave it then.
            with contextlib.suppress(OSError):
                parent.rmdir()

    def create(self, name: str, *, memory_bytes: int, pids: int) -> JobCgroup:
        """Make ``job-<name>`` with the given limits (swap disabled)."""
        dirs: list[Path] = []
        if not all(parent.is_dir() for parent in self._parents):
            # Removed under us (a host-wide orphan sweep of an older runner version):
            # make it again rather than fail every job from now on.
            self._setup()
        try:
            for parent in self._parents:
                directory = parent / f"job-{name}"
                directory.mkdir()
                dirs.append(directory)
                apply_limits(directory, self.version, memory_bytes=memory_bytes, pids=pids)
        except OSError:
            JobCgroup(dirs, version=self.version).destroy()
            raise
        cgroup = JobCgroup(dirs, version=self.version)
        cgroup._limits = (memory_bytes, pids)
        return cgroup


__all__ = [
    "CGROUP_ROOT",
    "CPU_PERIOD_US",
    "V1_ALL",
    "V1_CONTROLLERS",
    "V1_OPTIONAL",
    "CgroupManager",
    "JobCgroup",
    "JobCgroupStats",
    "keyed_value",
    "read_pids",
]
