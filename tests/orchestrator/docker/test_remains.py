"""Docker remains: the sweeper removes this deployment's containers that serve no one
(a session's container no record names, a stopped one), and leaves a recorded one,
a stateless run's, another deployment's and any still young enough to be starting."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid

from sandcell_orchestrator.config import Budgets
from sandcell_orchestrator.providers.base import SandboxSpec
from sandcell_orchestrator.providers.docker import DockerProvider
from sandcell_orchestrator.registry import InProcessRegistry
from sandcell_orchestrator.sessions.manager import SandboxManager
from sandcell_orchestrator.sessions.sandboxes import labelled
from sandcell_orchestrator.snapshots import DirectorySnapshotStore
from sandcell_protocol import runtime_session_id

from .conftest import Engine, MakeProvider

SCOPE_LABEL = "sandcell.scope"


def _session(name: str) -> str:
    return runtime_session_id("docker", "remains", f"{name}-{uuid.uuid4().hex[:8]}")


async def _stopped(engine: Engine, container_id: str) -> None:
    async with engine.client() as client:
        (await client.post(f"/containers/{container_id}/kill", params={"signal": "KILL"}))
    while True:
        info = await engine.inspect(container_id)
        if info is None or not info["State"]["Running"]:
            return
        await asyncio.sleep(0.1)


async def test_unrecorded_containers_of_this_deployment_are_removed(
    engine: Engine,
    make_provider: MakeProvider,
    store: DirectorySnapshotStore,
    spec: SandboxSpec,
) -> None:
    scope = f"test-{uuid.uuid4().hex[:12]}"
    provider = make_provider(scope=scope)
    registry = InProcessRegistry()
    manager = SandboxManager(provider, registry, store)
    # A worker killed between launch and record write leaves a running session container.
    orphan = await manager.launch(labelled(spec, _session("orphan")))
    recorded = await manager.acquire(_session("recorded"), spec, owner="t")
    stopped = await manager.launch(labelled(spec, _session("stopped")))
    await _stopped(engine, stopped.sandbox_id)
    stateless = await manager.launch(spec)
    foreign = await make_provider(scope=f"{scope}-other").create(
        labelled(spec, _session("foreign"))
    )
    handles = (orphan, recorded, stopped, stateless, foreign)
    for handle in handles:
        info = await engine.inspect(handle.sandbox_id)
        assert info is not None
        assert info["Config"]["Labels"][SCOPE_LABEL] in (scope, f"{scope}-other")

    # A sweeper whose launches may take an hour removes nothing: all may be starting.
    patient = SandboxManager(provider, registry, store, budgets=Budgets(launch_s=3600))
    await patient.sweep(idle_s=3600)
    for handle in handles:
        assert await engine.inspect(handle.sandbox_id) is not None
    assert patient.metrics.value("sandcell_remains_removed_total") == 0

    await asyncio.sleep(2.5)  # every container past a 0.4 s launch (ages are whole seconds)
    eager = SandboxManager(provider, registry, store, budgets=Budgets(launch_s=0.2, health_s=0.2))
    await eager.sweep(idle_s=3600)
    assert await engine.inspect(orphan.sandbox_id) is None
    assert await engine.inspect(stopped.sandbox_id) is None
    for kept in (recorded, stateless, foreign):
        assert await engine.inspect(kept.sandbox_id) is not None
    assert eager.metrics.value("sandcell_remains_removed_total") == 2
    for handle in handles:
        await handle.close()
    for handle in (recorded, stateless, foreign):
        await provider.destroy(handle.sandbox_id)


async def test_without_a_scope_nothing_is_listed(
    engine: Engine, provider: DockerProvider, spec: SandboxSpec
) -> None:
    """A registry of one process names no deployment: its provider lists no remains,
    not even its own stopped containers, and labels none with a scope, whatever the
    spec says."""
    claiming = dataclasses.replace(spec, labels={**spec.labels, SCOPE_LABEL: "x"})
    handle = await provider.create(labelled(claiming, _session("unscoped")))
    try:
        await _stopped(engine, handle.sandbox_id)
        info = await engine.inspect(handle.sandbox_id)
        assert info is not None
        assert SCOPE_LABEL not in info["Config"]["Labels"]
        assert await provider.dead_sandboxes() == {}
    finally:
        await handle.close()
        await provider.destroy(handle.sandbox_id)
