"""Code contexts on MicroVMs: a native suspend keeps the interpreter, so its variables
survive suspend and resume (the emulator's VMs are real runners, frozen by SIGSTOP)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from sandcell_orchestrator.emulator import MicrovmEmulator, VmState
from sandcell_orchestrator.providers.lambda_microvm import LambdaMicrovmProvider
from sandcell_orchestrator.registry import InProcessRegistry
from sandcell_orchestrator.sessions.execution import ExecutionService, Identity
from sandcell_orchestrator.snapshots import S3SnapshotStore, SnapshotStore
from sandcell_protocol import ExecuteRequest, runtime_session_id
from sandcell_protocol import contexts as cx
from tests.orchestrator.conftest import S3Server

ALICE = Identity("tenant-a", "alice")


@pytest.fixture
async def s3_store(s3_server: S3Server) -> AsyncIterator[SnapshotStore]:
    async with S3SnapshotStore(s3_server.settings(f"mvm-ctx-{uuid.uuid4().hex}")) as store:
        yield store


async def test_variables_survive_a_native_suspend_and_resume(
    provider: LambdaMicrovmProvider, emulator: MicrovmEmulator, s3_store: SnapshotStore
) -> None:
    service = ExecutionService(provider=provider, registry=InProcessRegistry(), store=s3_store)
    try:
        code = "x = 41\nopen('f', 'w').write('file')"
        first = await service.run_code(
            ExecuteRequest(language="python", code=code), ALICE, hint="nb"
        )
        assert first.status is cx.ContextStatus.OK
        session_id = runtime_session_id(ALICE.namespace, ALICE.user_id, "nb")
        (vm,) = emulator.fleet.vms.values()
        pid = vm.pid
        assert await service.suspend_session(session_id)
        assert vm.state is VmState.SUSPENDED
        again = await service.run_code(
            ExecuteRequest(language="python", code="x + 1"), ALICE, hint="nb"
        )
        assert [r.data for r in again.results] == [{"text/plain": "42"}]
        assert (vm.state, vm.pid) == (VmState.RUNNING, pid)
    finally:
        await service.aclose(destroy_sandboxes=True)
