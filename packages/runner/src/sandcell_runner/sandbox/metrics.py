"""``MetricsSampler``: the bound session's CPU, memory and disk, sampled every few seconds.

What E2B's ``get_metrics`` answers for a sandbox, owned by the runner that runs it:
every ``metrics_interval_s`` (E2B's 5 s by default) it reads its instance cgroup's
counters (every job and process of the session is in a child of it, so the parent's
memory and CPU figures are the session's) and the workspace's filesystem, and keeps
the last ``RING_SIZE`` samples (an hour at 5 s) in a ring: memory is bounded whatever
the sandbox's age. A new bound session starts an empty ring; a query finding none of
its session's takes the first sample then.

The sampling is the runner's own housekeeping, not a job's: it runs in the runner's
process, outside every jail and job cgroup, so none of it is charged to the session's
CPU quota or memory limit, and no job waits on it. A sample is a few small kernfs reads
and one ``statvfs`` (tens of microseconds), inline on the event loop, no thread hop.

CPU: the instance's cumulative CPU time where the hierarchy keeps one (cgroup v2,
v1 with ``cpu,cpuacct`` mounted together); on a v1 host whose ``cpuacct`` is mounted
apart (the runner places jobs only in memory, pids and cpu) it sums ``utime + stime``
of the processes in the job cgroups that are alive at both samples, so a process that
ends between two samples is missed for its last stretch (an undercount, never more).
That fallback reads at most ``MAX_PROC_READS`` processes a sample: a session may run
thousands (64 processes, each up to its pids limit), and their ``/proc`` reads, on the
event loop and charged to no job, took a third of a second a sample at 8,192; the ones
past it are not counted either.
"""

from __future__ import annotations

import asyncio
import collections
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

from sandcell_protocol.sandbox_messages import MetricsQuery, MetricsSample, SandboxMetrics

from ..config import MIB, RunnerSettings
from ..jail.instance_usage import InstanceCounters
from ..workspace.manager import WorkspaceManager
from ..workspace.session import SessionManager

__all__ = ["MAX_PROC_READS", "RING_SIZE", "MetricsSampler"]

RING_SIZE = 720
"""Samples kept: the last hour at the default interval (a fixed count, not a duration)."""
MAX_PROC_READS = 512
"""``/proc/<pid>/stat`` reads one sample of the fallback makes at most (about 20 ms)."""
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _proc_ticks(pid: int) -> tuple[tuple[int, int], int] | None:
    """((pid, start time), utime + stime in clock ticks) of a live process; None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return None
    # After the command name's closing parenthesis (the name itself may hold any byte).
    fields = text[text.rfind(b")") + 2 :].split()
    try:
        return (pid, int(fields[19])), int(fields[11]) + int(fields[12])
    except (IndexError, ValueError):
        return None


class MetricsSampler:
    """A bounded ring of the bound session's samples, and the loop that fills it."""

    def __init__(
        self,
        settings: RunnerSettings,
        *,
        cgroups: InstanceCounters,
        workspaces: WorkspaceManager,
        sessions: SessionManager,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval_s = settings.metrics_interval_s
        self._cgroups = cgroups
        self._workspaces = workspaces
        self._sessions = sessions
        self._clock = clock
        self._monotonic = monotonic
        self._mem_total = settings.limits.memory_mib * MIB
        if cgroups.cpu_limited:
            self._cpus = settings.cpu_millicores / 1000
        else:
            self._cpus = float(len(os.sched_getaffinity(0)))
        self._samples: collections.deque[MetricsSample] = collections.deque(maxlen=RING_SIZE)
        self._session: str | None = None
        self._last_cpu: tuple[float, int] | None = None
        """(monotonic time, cumulative CPU ns) at the sample before."""
        self._last_ticks: dict[tuple[int, int], int] = {}
        self._last_ticks_at: float | None = None

    def __repr__(self) -> str:
        return f"MetricsSampler(interval_s={self.interval_s}, samples={len(self._samples)})"

    async def run(self) -> None:
        """Sample every ``interval_s`` for as long as the runner serves."""
        while True:
            self.sample()
            await asyncio.sleep(self.interval_s)

    def sample(self) -> None:
        """Take one sample of the bound session (nothing when no session is bound)."""
        bound = self._sessions.bound
        session_id = bound.session_id if bound is not None else None
        if session_id != self._session:
            # Another sandbox now: the ring and the CPU baselines were the other one's.
            self._samples.clear()
            self._last_cpu = None
            self._last_ticks, self._last_ticks_at = {}, None
            self._session = session_id
        if bound is None:
            return
        now = self._monotonic()
        usage = self._cgroups.instance_usage()
        if usage is not None and usage.cpu_ns is not None:
            cpu_pct = self._cumulative_pct(now, usage.cpu_ns)
        else:
            cpu_pct = self._ticks_pct(now)
        used, cache = 0, 0
        if usage is not None:
            used = max(0, usage.memory_bytes - usage.inactive_file_bytes)
            cache = usage.cache_bytes
        disk_used, disk_total = self._disk(bound.workspace)
        self._samples.append(
            MetricsSample(
                at_s=self._clock(),
                cpu_count=max(1, math.ceil(self._cpus)),
                cpu_used_pct=cpu_pct,
                mem_used_bytes=used,
                mem_cache_bytes=cache,
                mem_total_bytes=self._mem_total,
                disk_used_bytes=disk_used,
                disk_total_bytes=disk_total,
            )
        )

    def _pct(self, cpu_s: float, wall_s: float) -> float:
        if wall_s <= 0:
            return 0.0
        return round(min(100.0, max(0.0, cpu_s / (wall_s * self._cpus) * 100)), 2)

    def _cumulative_pct(self, now: float, cpu_ns: int) -> float:
        last, self._last_cpu = self._last_cpu, (now, cpu_ns)
        if last is None:
            return 0.0
        return self._pct((cpu_ns - last[1]) / 1e9, now - last[0])

    def _ticks_pct(self, now: float) -> float:
        ticks: dict[tuple[int, int], int] = {}
        for pid in self._cgroups.instance_pids()[:MAX_PROC_READS]:
            found = _proc_ticks(pid)
            if found is not None:
                ticks[found[0]] = found[1]
        last, last_at = self._last_ticks, self._last_ticks_at
        self._last_ticks, self._last_ticks_at = ticks, now
        if last_at is None:
            return 0.0
        spent = sum(max(0, t - last[key]) for key, t in ticks.items() if key in last)
        return self._pct(spent * _TICK_S, now - last_at)

    def _disk(self, workspace: Path) -> tuple[int, int]:
        """(used, total) bytes of the workspace: its own filesystem where the quota is one
        (an image or a tmpfs); without a quota, the quota it would have and 0 used (a
        walk of the tree is no sampler's business)."""
        if not self._workspaces.quota_enforced:
            return 0, self._workspaces.quota_bytes
        try:
            st = os.statvfs(workspace)
        except OSError:
            return 0, self._workspaces.quota_bytes
        return (st.f_blocks - st.f_bfree) * st.f_frsize, st.f_blocks * st.f_frsize

    def _has(self, session_id: str) -> bool:
        return self._session == session_id and bool(self._samples)

    def query(self, session_id: str, query: MetricsQuery) -> SandboxMetrics:
        """The samples of ``session_id`` taken in ``[start_s, end_s]``, oldest first (none
        when the runner is bound to another session, or to none)."""
        bound = self._sessions.bound
        if bound is not None and bound.session_id == session_id and not self._has(session_id):
            # Asked before the loop's first sample of this session (a sandbox just made):
            # one now, as E2B samples a sandbox at its start.
            self.sample()
        samples: list[MetricsSample] = []
        if session_id == self._session:
            low = query.start_s if query.start_s is not None else -math.inf
            high = query.end_s if query.end_s is not None else math.inf
            # Whole seconds on the wire: a sample at 12.7 s belongs to second 12.
            samples = [s for s in self._samples if low <= math.floor(s.at_s) <= high]
        return SandboxMetrics(interval_s=self.interval_s, samples=samples)
