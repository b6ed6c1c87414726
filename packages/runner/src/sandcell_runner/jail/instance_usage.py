"""``InstanceCounters``: what the runner's instance cgroup holds now, for its metrics.

Every job and process of the runner's session sits in a child of the instance's
cgroup (``sandcell/<instance>``), so that directory's hierarchical counters are the
session's. Read by the runner's own metrics sampler (``sandbox/metrics.py``), never on
a job's path: a few small kernfs reads, no walk of the children except for the pids
on a v1 host without a CPU account.
"""

from __future__ import annotations

from dataclasses import dataclass

from .cgroups import CgroupManager
from .job_cgroup import keyed_value, read_pids

__all__ = ["InstanceCounters", "InstanceUsage"]


@dataclass(frozen=True, slots=True)
class InstanceUsage:
    """What the runner's instance cgroup (every job and process of its session) holds now."""

    memory_bytes: int
    """Charged to the instance: its jobs' memory, tmpfs files and page cache."""
    cache_bytes: int
    """Of which page cache (file-backed, reclaimable)."""
    inactive_file_bytes: int
    """Of which inactive file cache: reclaimed first, left out of "used" as ``docker
    stats`` does."""
    cpu_ns: int | None
    """CPU time used by the instance so far (cumulative), None where the hierarchy keeps
    no CPU account for it (cgroup v1 with ``cpuacct`` mounted apart from ``cpu``)."""


class InstanceCounters:
    """The instance cgroup's memory and CPU counters, read from ``cgroups``' directories."""

    def __init__(self, cgroups: CgroupManager) -> None:
        self._cgroups = cgroups

    @property
    def cpu_limited(self) -> bool:
        """Whether the session's jobs share a CPU quota (its size is the CPU count)."""
        return self._cgroups.cpu_limited

    def instance_usage(self) -> InstanceUsage | None:
        """The instance's memory and CPU counters (None without cgroups, or unreadable)."""
        cgroups = self._cgroups
        try:
            if cgroups.version == 2:
                parent = cgroups.instance_dir()
                if parent is None:
                    return None
                stat = (parent / "memory.stat").read_text()
                cpu = keyed_value((parent / "cpu.stat").read_text(), "usage_usec") * 1000
                return InstanceUsage(
                    memory_bytes=int((parent / "memory.current").read_text()),
                    cache_bytes=keyed_value(stat, "file"),
                    inactive_file_bytes=keyed_value(stat, "inactive_file"),
                    cpu_ns=cpu,
                )
            memory = cgroups.instance_dir("memory")
            if memory is None:
                return None
            stat = (memory / "memory.stat").read_text()
            cpu_ns = None
            cpu_dir = cgroups.instance_dir("cpu")
            # ``cpu,cpuacct`` mounted together (most v1 hosts): the cpu parent keeps the account.
            if cpu_dir is not None and (cpu_dir / "cpuacct.usage").exists():
                cpu_ns = int((cpu_dir / "cpuacct.usage").read_text())
            return InstanceUsage(
                memory_bytes=int((memory / "memory.usage_in_bytes").read_text()),
                cache_bytes=keyed_value(stat, "total_cache"),
                inactive_file_bytes=keyed_value(stat, "total_inactive_file"),
                cpu_ns=cpu_ns,
            )
        except (OSError, ValueError):
            return None

    def instance_pids(self) -> list[int]:
        """The pids in the instance's job cgroups (v1 memory hierarchy): where there is no
        CPU account, the sampler reads their ``/proc/<pid>/stat`` instead."""
        cgroups = self._cgroups
        memory = cgroups.instance_dir("memory") if cgroups.version == 1 else None
        if memory is None:
            return []
        pids = read_pids(memory / "cgroup.procs")
        try:
            children = [c for c in memory.iterdir() if c.name.startswith("job-")]
        except OSError:
            return pids
        for child in children:
            pids += read_pids(child / "cgroup.procs")
        return pids
