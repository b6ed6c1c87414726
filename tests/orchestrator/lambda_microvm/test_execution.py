"""ExecutionService on MicroVMs: warm sessions, relaunch + restore from S3, fencing, workers.

The emulator's VMs are real runners; checkpoints go to a real S3 endpoint (moto);
the two-worker test shares a real Redis registry between two providers.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import httpx
import pytest

from sandcell_orchestrator.emulator import MicrovmEmulator, VmState
from sandcell_orchestrator.errors import LockLostError, SandboxUnavailableError, SessionBusyError
from sandcell_orchestrator.providers.lambda_microvm import LambdaMicrovmProvider
from sandcell_orchestrator.registry import InProcessRegistry, RedisRegistry
from sandcell_orchestrator.sessions.execution import ExecutionService, Identity
from sandcell_orchestrator.snapshots import S3SnapshotStore, SnapshotStore
from sandcell_orchestrator.testing import GatedProvider, SilentRenewRegistry
from sandcell_protocol import ExecuteRequest, ExecuteResult, runtime_session_id
from tests.orchestrator.conftest import S3Server

from .conftest import ProviderFactory

ALICE = Identity("tenant-a", "alice")


def py(code: str) -> ExecuteRequest:
    return ExecuteRequest(language="python", code=code, timeout_ms=20_000)


def run_calls(emulator: MicrovmEmulator) -> int:
    return sum(1 for call in emulator.calls if call.operation == "RunMicrovm")


@pytest.fixture
async def s3_store(s3_server: S3Server) -> AsyncIterator[SnapshotStore]:
    async with S3SnapshotStore(s3_server.settings(f"mvm-{uuid.uuid4().hex}")) as store:
        yield store


@pytest.fixture
async def services() -> AsyncIterator[list[ExecutionService]]:
    made: list[ExecutionService] = []
    yield made
    for service in made:
        await service.aclose(destroy_sandboxes=True)


async def test_a_session_keeps_one_warm_microvm(
    provider: LambdaMicrovmProvider,
    emulator: MicrovmEmulator,
    s3_store: SnapshotStore,
    services: list[ExecutionService],
) -> None:
    """Three turns, one VM, files accumulate; each changing turn is checkpointed to S3."""
    service = ExecutionService(provider=provider, registry=InProcessRegistry(), store=s3_store)
    services.append(service)
    for i in range(3):
        result = await service.execute(
            py(f"open('t{i}', 'w').write('x'); import os; print(len(os.listdir()))"),
            ALICE,
            hint="warm",
        )
        assert result.stdout == f"{i + 1}\n"
    assert run_calls(emulator) == 1
    session_id = runtime_session_id(ALICE.namespace, ALICE.user_id, "warm")
    key = await service.manager.current_checkpoint(session_id)
    assert key is not None
    assert await s3_store.exists(key)


async def test_a_killed_vm_is_relaunched_and_restored_from_s3(
    provider: LambdaMicrovmProvider,
    emulator: MicrovmEmulator,
    emulator_url: str,
    s3_store: SnapshotStore,
    services: list[ExecutionService],
) -> None:
    """VM killed between turns: the next turn gets a new VM restored from its checkpoint."""
    service = ExecutionService(provider=provider, registry=InProcessRegistry(), store=s3_store)
    services.append(service)
    await service.execute(py("open('kept.txt', 'w').write('from vm one')"), ALICE, hint="k")
    (first,) = emulator.fleet.vms
    async with httpx.AsyncClient(trust_env=False) as admin:
        await admin.post(f"{emulator_url}/_emulator/vms/{first}/kill")

    result = await service.execute(py("print(open('kept.txt').read())"), ALICE, hint="k")

    assert result.stdout == "from vm one\n"
    assert run_calls(emulator) == 2
    assert emulator.fleet.vms[first].state is VmState.TERMINATED
    assert service.metrics.value("sandcell_restores_total", outcome="ok") == 1


async def test_a_suspended_session_resumes_on_its_next_turn(
    provider: LambdaMicrovmProvider,
    emulator: MicrovmEmulator,
    s3_store: SnapshotStore,
    services: list[ExecutionService],
) -> None:
    """The idle sweeper's suspend is native: same VM, same process, woken by traffic."""
    service = ExecutionService(provider=provider, registry=InProcessRegistry(), store=s3_store)
    services.append(service)
    await service.execute(py("open('f', 'w').write('warm')"), ALICE, hint="s")
    session_id = runtime_session_id(ALICE.namespace, ALICE.user_id, "s")
    (vm,) = emulator.fleet.vms.values()
    pid = vm.pid

    assert await service.suspend_session(session_id)
    assert vm.state is VmState.SUSPENDED
    result = await service.execute(py("print(open('f').read())"), ALICE, hint="s")

    assert result.stdout == "warm\n"
    assert vm.state is VmState.RUNNING
    assert vm.pid == pid
    assert run_calls(emulator) == 1
    assert provider.metrics.suspends == 1


async def _when_free(
    service: ExecutionService, request: ExecuteRequest, *, hint: str
) -> ExecuteResult:
    """Run ``request`` as soon as the session's lock is free (bounded)."""
    async with asyncio.timeout(120):
        while True:
            try:
                return await service.execute(request, ALICE, hint=hint)
            except SessionBusyError:
                await asyncio.sleep(0.1)


async def test_a_fenced_launch_terminates_its_orphan_vm(
    provider: LambdaMicrovmProvider,
    emulator: MicrovmEmulator,
    s3_store: SnapshotStore,
    services: list[ExecutionService],
) -> None:
    """The stale worker's lease expired mid-launch: its record write fails, its VM goes."""
    registry = InProcessRegistry()
    gated = GatedProvider(provider)
    stale = ExecutionService(
        provider=gated,  # type: ignore[arg-type]
        registry=SilentRenewRegistry(registry),  # type: ignore[arg-type]
        store=s3_store,
    )
    # Long enough that a loaded machine's stalls do not end the lease locally first.
    stale.manager.lock_ttl_ms = 2000
    fresh = ExecutionService(provider=provider, registry=registry, store=s3_store)
    services.append(fresh)
    stale_turn = asyncio.create_task(stale.execute(py("print('stale')"), ALICE, hint="f"))
    await gated.wait_created(stale_turn)
    # The fresh worker gets in once the stale lease has expired in the registry.
    assert (await _when_free(fresh, py("print('fresh')"), hint="f")).stdout == "fresh\n"
    gated.gate.set()
    with pytest.raises(LockLostError):
        await stale_turn

    orphan = gated.created[0].rpartition("~")[0]
    assert emulator.fleet.vms[orphan].state is VmState.TERMINATED
    live = [vm for vm in emulator.fleet.vms.values() if vm.state is VmState.RUNNING]
    assert len(live) == 1
    await stale.aclose(destroy_sandboxes=False)


async def test_two_workers_one_session_one_vm(
    provider_factory: ProviderFactory,
    emulator: MicrovmEmulator,
    s3_store: SnapshotStore,
    redis_url: str,
) -> None:
    """Two workers (own providers, one Redis registry): one busy, then both use one VM."""
    prefix = f"mvm-{uuid.uuid4().hex}:"
    registries = [RedisRegistry.from_url(redis_url, prefix=prefix) for _ in range(2)]
    worker_a, worker_b = (
        ExecutionService(provider=provider_factory(), registry=registry, store=s3_store)
        for registry in registries
    )
    try:
        slow = asyncio.create_task(
            worker_a.execute(py("import time; time.sleep(2); print('a')"), ALICE, hint="two")
        )
        await asyncio.sleep(0.8)
        with pytest.raises(SessionBusyError):
            await worker_b.execute(py("print('b')"), ALICE, hint="two")
        assert (await slow).stdout == "a\n"
        # Worker B reaches worker A's VM: the key derives the runner token from the id.
        result = await worker_b.execute(py("print('b')"), ALICE, hint="two")
        assert result.stdout == "b\n"
        assert run_calls(emulator) == 1
    finally:
        # Workers first: closing one destroys its sandboxes through the registry.
        for worker in (worker_a, worker_b):
            await worker.aclose(destroy_sandboxes=True)
        for registry in registries:
            await registry.close()


async def test_a_throttled_launch_surfaces_as_retryable(
    provider: LambdaMicrovmProvider,
    emulator: MicrovmEmulator,
    s3_store: SnapshotStore,
    services: list[ExecutionService],
) -> None:
    """Through the execution path too: one RunMicrovm, a retryable error, then success."""
    service = ExecutionService(provider=provider, registry=InProcessRegistry(), store=s3_store)
    services.append(service)
    emulator.faults.throttle = {"RunMicrovm": 1}
    with pytest.raises(SandboxUnavailableError) as caught:
        await service.execute(py("print(1)"), ALICE, hint="t")
    assert caught.value.retryable
    assert (await service.execute(py("print(2)"), ALICE, hint="t")).stdout == "2\n"
    assert run_calls(emulator) == 2
