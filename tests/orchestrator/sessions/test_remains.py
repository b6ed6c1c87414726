"""The sweeper removes sandboxes whose runner is gone and that no record points at (a
worker killed between launching a sandbox and recording it, a record lost with a wiped
Redis), and leaves a live one, a recorded one and one too young to have started."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

from sandcell_orchestrator.config import Budgets
from sandcell_orchestrator.providers.base import SandboxSpec
from sandcell_orchestrator.providers.local import LocalProvider
from sandcell_orchestrator.registry import InProcessRegistry
from sandcell_orchestrator.sessions.manager import SandboxManager
from sandcell_orchestrator.snapshots import SnapshotStore
from sandcell_orchestrator.testing import sandbox_processes
from sandcell_protocol import runtime_session_id


async def test_dead_unrecorded_sandboxes_are_removed(
    local_provider: LocalProvider, dir_store: SnapshotStore, runtime_dir: Path
) -> None:
    """Two sandboxes launched without a record: the one whose runner was SIGKILLed goes
    (root and all), once older than a launch; the live one stays."""
    registry = InProcessRegistry()
    manager = SandboxManager(local_provider, registry, dir_store)
    # The sweeping worker's launch budget is short: the dead root is past it soon.
    sweeper = SandboxManager(
        local_provider, registry, dir_store, budgets=Budgets(launch_s=0.2, health_s=0.2)
    )
    dead = await manager.launch(SandboxSpec())
    alive = await manager.launch(SandboxSpec())
    roots = runtime_dir / "rt"
    root = roots / dead.sandbox_id
    pid = int(json.loads((root / "sandbox.json").read_text())["pid"])
    os.killpg(pid, signal.SIGKILL)
    while any(p.pid == pid for p in sandbox_processes(roots)):
        await asyncio.sleep(0.05)
    await dead.close()
    await asyncio.sleep(0.5)  # past the launch budget: not a sandbox still starting
    await sweeper.sweep(idle_s=3600)
    assert not root.exists()
    assert (roots / alive.sandbox_id).exists()
    assert sweeper.metrics.value("sandcell_remains_removed_total") == 1
    await manager.discard(alive)
    await manager.aclose(destroy_sandboxes=True)


async def test_a_live_session_sandbox_no_record_names_is_removed(
    local_provider: LocalProvider, dir_store: SnapshotStore, runtime_dir: Path
) -> None:
    """A session's live sandbox whose record went with a wiped Redis serves no one (the
    next holder launches its own) and would run as long as its worker: the sweeper
    removes it once past a launch, as it does a dead one. The recorded session's live
    sandbox and a live one of no session (a stateless run's) stay."""
    orphaned_id = runtime_session_id("tenant-a", "alice", "orphaned")
    recorded_id = runtime_session_id("tenant-a", "alice", "recorded")
    before = InProcessRegistry()
    manager = SandboxManager(local_provider, before, dir_store)
    orphaned = await manager.acquire(orphaned_id, SandboxSpec(), owner="tenant-a")
    stateless = await manager.launch(SandboxSpec())
    after = InProcessRegistry()  # the wiped Redis: no record of the first session
    survivor = SandboxManager(local_provider, after, dir_store)
    kept = await survivor.acquire(recorded_id, SandboxSpec(), owner="tenant-a")
    sweeper = SandboxManager(
        local_provider, after, dir_store, budgets=Budgets(launch_s=0.2, health_s=0.2)
    )
    await asyncio.sleep(0.5)  # past the launch budget: not a sandbox still starting
    await sweeper.sweep(idle_s=3600)
    roots = runtime_dir / "rt"
    assert not (roots / orphaned.sandbox_id).exists()
    assert (roots / kept.sandbox_id).exists()
    assert (roots / stateless.sandbox_id).exists()
    assert sweeper.metrics.value("sandcell_remains_removed_total") == 1
    await orphaned.close()
    await kept.close()
    await manager.discard(stateless)
    await survivor.destroy(recorded_id)
    await manager.aclose(destroy_sandboxes=True)
    await survivor.aclose(destroy_sandboxes=True)
