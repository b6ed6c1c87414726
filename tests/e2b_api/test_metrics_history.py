"""``MetricsHistory`` on a directory store: merged, bounded, per tenant, dropped."""

from __future__ import annotations

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
