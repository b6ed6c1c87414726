"""``MetricsSampler``: the bounded ring of a session's samples and the range it answers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from sandcell_protocol.sandbox_messages import MetricsQuery
from sandcell_runner.config import MIB, RunnerSettings
from sandcell_runner.jail.instance_usage import InstanceUsage
from sandcell_runner.sandbox import metrics
from sandcell_runner.sandbox.metrics import MAX_PROC_READS, RING_SIZE, MetricsSampler


@dataclass
class _Cgroups:
    cpu_limited: bool = True
    cpu_ns: int = 0
    memory_bytes: int = 100 * MIB

    def instance_usage(self) -> InstanceUsage:
        return InstanceUsage(
            memory_bytes=self.memory_bytes,
            cache_bytes=30 * MIB,
            inactive_file_bytes=20 * MIB,
            cpu_ns=self.cpu_ns,
        )

    def instance_pids(self) -> list[int]:
        return []


@dataclass
class _Workspaces:
    quota_enforced: bool = False
    quota_bytes: int = 1024 * MIB


@dataclass
class _State:
    session_id: str
    workspace: Path = Path("/nonexistent")


@dataclass
class _Sessions:
    bound: _State | None = None


@dataclass
class _Clock:
    now: float = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def _sampler(cgroups: _Cgroups, sessions: _Sessions, clock: _Clock) -> MetricsSampler:
    settings = RunnerSettings(cpu_millicores=2000, metrics_interval_s=5)
    return MetricsSampler(
        settings,
        cgroups=cgroups,  # type: ignore[arg-type]
        workspaces=_Workspaces(),  # type: ignore[arg-type]
        sessions=sessions,  # type: ignore[arg-type]
        clock=clock,
        monotonic=clock,
    )


def test_samples_hold_the_cgroup_figures_and_cpu_of_the_quota() -> None:
    cgroups, sessions, clock = _Cgroups(), _Sessions(_State("s1")), _Clock()
    sampler = _sampler(cgroups, sessions, clock)
    sampler.sample()
    clock.now += 5
    cgroups.cpu_ns += 5 * 10**9  # one CPU busy for 5 s, of a quota of two
    sampler.sample()
    first, second = sampler.query("s1", MetricsQuery()).samples
    assert first.cpu_used_pct == 0  # no sample before it
    assert second.cpu_used_pct == 50
    assert second.cpu_count == 2
    assert second.mem_used_bytes == 80 * MIB  # inactive file cache left out
    assert second.mem_cache_bytes == 30 * MIB
    assert second.mem_total_bytes == RunnerSettings().limits.memory_mib * MIB
    assert (second.disk_used_bytes, second.disk_total_bytes) == (0, 1024 * MIB)


def test_the_ring_is_bounded_and_answers_a_range_of_whole_seconds() -> None:
    cgroups, sessions, clock = _Cgroups(), _Sessions(_State("s1")), _Clock(now=100.5)
    sampler = _sampler(cgroups, sessions, clock)
    for _ in range(RING_SIZE + 10):
        sampler.sample()
        clock.now += 5
    samples = sampler.query("s1", MetricsQuery()).samples
    assert len(samples) == RING_SIZE
    assert samples[0].at_s == 100.5 + 10 * 5  # the oldest ten went
    picked = sampler.query("s1", MetricsQuery(start_s=200, end_s=210)).samples
    assert [s.at_s for s in picked] == [200.5, 205.5, 210.5]
    assert sampler.query("s1", MetricsQuery(start_s=10**9)).samples == []


def test_another_session_sees_no_samples_and_a_new_one_starts_empty() -> None:
    cgroups, sessions, clock = _Cgroups(), _Sessions(_State("s1")), _Clock()
    sampler = _sampler(cgroups, sessions, clock)
    sampler.sample()
    assert sampler.query("s2", MetricsQuery()).samples == []
    sessions.bound = None
    sampler.sample()
    assert sampler.query("s1", MetricsQuery()).samples == []
    sessions.bound = _State("s2")
    sampler.sample()
    assert len(sampler.query("s2", MetricsQuery()).samples) == 1


def test_a_query_before_the_first_sample_takes_one() -> None:
    cgroups, sessions, clock = _Cgroups(), _Sessions(_State("s1")), _Clock()
    sampler = _sampler(cgroups, sessions, clock)
    assert len(sampler.query("s1", MetricsQuery()).samples) == 1
    assert len(sampler.query("s1", MetricsQuery()).samples) == 1  # not one a query
    assert sampler.query("s2", MetricsQuery()).samples == []


def test_the_proc_fallback_reads_a_bounded_number_of_processes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without a CPU account (v1, cpuacct apart) a sample reads ``/proc`` per process:
    a session of thousands of them (64 processes, each up to its pids limit) is read
    ``MAX_PROC_READS`` at most; every one of 8,192 was read on the runner's loop."""
    read: list[int] = []

    def ticks(pid: int) -> tuple[tuple[int, int], int]:
        read.append(pid)
        return (pid, 1), 10

    monkeypatch.setattr(metrics, "_proc_ticks", ticks)
    cgroups = _Cgroups(cpu_limited=False)
    cgroups.instance_usage = lambda: None  # type: ignore[method-assign]
    cgroups.instance_pids = lambda: list(range(2, 8194))  # type: ignore[method-assign]
    sessions, clock = _Sessions(_State("s1")), _Clock()
    sampler = _sampler(cgroups, sessions, clock)
    sampler.sample()
    clock.now += 5
    sampler.sample()
    assert len(read) == 2 * MAX_PROC_READS
    assert len(sampler.query("s1", MetricsQuery()).samples) == 2
