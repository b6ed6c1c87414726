"""``MetricsHistory`` on a directory store: merged, bounded, per tenant, dropped."""

from __future__ import annotations

import os
import time
from pathlib import Path

from sandcell_orchestrator.e2b.history import MAX_SAMPLES, MetricsHistory, in_range
from sandcell_orchestrator.snapshots.directory import DirectorySnapshotStore
from sandcell_protocol.sandbox_messages import MetricsQuery, MetricsSample


def _sample(at_s: float) -> MetricsSample:
    return MetricsSample(
        at_s=at_s,
        cpu_count=1,
        cpu_used_pct=0.0,
        mem_used_bytes=0,
        mem_cache_bytes=0,
        mem_total_bytes=1,
        disk_used_bytes=0,
        disk_total_bytes=1,
    )


async def test_kept_samples_merge_stay_bounded_and_go_with_a_drop(tmp_path: Path) -> None:
    history = MetricsHistory(DirectorySnapshotStore(tmp_path))
    sandbox = "s" * 20
    await history.keep("tenant-a", sandbox, [_sample(1.0), _sample(2.0)])
    # A MicroVM suspended in place keeps its ring: a sample kept twice is one.
    await history.keep("tenant-a", sandbox, [_sample(2.0), _sample(3.5)])
    kept = await history.read("tenant-a", sandbox)
    assert [s.at_s for s in kept] == [1.0, 2.0, 3.5]
    assert await history.read("tenant-b", sandbox) == []
    assert [s.at_s for s in in_range(kept, MetricsQuery(start_s=2, end_s=3))] == [2.0, 3.5]
    await history.keep("tenant-a", sandbox, [_sample(10.0 + i) for i in range(MAX_SAMPLES)])
    kept = await history.read("tenant-a", sandbox)
    assert len(kept) == MAX_SAMPLES
    assert kept[0].at_s == 10.0
    await history.drop("tenant-a", sandbox)
    assert await history.read("tenant-a", sandbox) == []


async def test_retired_samples_are_bounded_in_count_and_time(tmp_path: Path) -> None:
    """A kill retires a sandbox's samples under its tenant's prefix; a tenant keeps the
    newest ``max_killed`` of them, none older than the retention answers, and a reap
    deletes what is past either bound."""
    store = DirectorySnapshotStore(tmp_path)
    clock = [time.time()]
    history = MetricsHistory(store, max_killed=2, retain_killed_s=100, wall_clock=lambda: clock[0])
    ids = [c * 20 for c in "abc"]
    for i, sandbox in enumerate(ids):
        await history.keep("tenant-a", sandbox, [_sample(clock[0] - 10 + i)])
        await history.retire("tenant-a", sandbox, [_sample(clock[0] + i)])
        # Distinct write times, as kills at different moments: the order is the store's.
        written = clock[0] + i
        os.utime(tmp_path / history.killed_key("tenant-a", sandbox), (written, written))
    await history.reap_killed("tenant-a")
    assert await history.read_killed("tenant-a", ids[0]) == []  # past the count
    kept = await history.read_killed("tenant-a", ids[2])
    assert [s.at_s for s in kept] == [clock[0] - 8, clock[0] + 2]
    assert await history.read_killed("tenant-b", ids[2]) == []
    clock[0] += 150  # past the retention: answered by nobody, then reaped
    assert await history.read_killed("tenant-a", ids[2]) == []
    assert await history.reap_killed("tenant-a") == 2
    assert await store.list("e2b-metrics-killed/") == []


async def test_the_sweep_reaps_every_tenants_expired_samples(tmp_path: Path) -> None:
    """A tenant that kills no more sandboxes has its retired samples deleted past the
    retention too (``reap_expired``, paged through the whole killed prefix)."""
    store = DirectorySnapshotStore(tmp_path)
    clock = [time.time()]
    history = MetricsHistory(store, retain_killed_s=100, wall_clock=lambda: clock[0])
    old = [(tenant, c * 20) for tenant, c in (("tenant-a", "a"), ("tenant-b", "b"))]
    for tenant, sandbox in [*old, ("tenant-a", "c" * 20)]:
        await history.retire(tenant, sandbox, [_sample(clock[0])])
    for tenant, sandbox in old:  # written long ago, and no kill of theirs since
        written = clock[0] - 150
        os.utime(tmp_path / history.killed_key(tenant, sandbox), (written, written))
    assert await history.reap_expired() == 2
    assert [e.key for e in await store.list("e2b-metrics-killed/")] == [
        history.killed_key("tenant-a", "c" * 20)
    ]
