"""The provider's lifecycle against the emulator: real boto3, real runner processes."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import anyio
import httpx
import pytest

from sandcell_orchestrator.emulator import MicrovmEmulator, VmState
from sandcell_orchestrator.errors import (
    RunnerRequestError,
    SandboxNotFoundError,
    SandboxUnavailableError,
)
from sandcell_orchestrator.handle import SandboxHandle
from sandcell_orchestrator.providers.base import NativeSuspend, SandboxProvider, SandboxSpec
from sandcell_orchestrator.providers.lambda_microvm import LambdaMicrovmProvider
from sandcell_orchestrator.registry import InProcessRegistry
from sandcell_orchestrator.runner.client import RunnerClient
from sandcell_orchestrator.sessions.manager import SandboxManager, sandbox_session_key
from sandcell_orchestrator.snapshots import DirectorySnapshotStore
from sandcell_protocol import ExecuteRequest, RunStatus

from .conftest import (
    ProviderFactory,
    process_state,
    proxy_get,
    runner_pid,
    state_once_stopped,
    vm_id_of,
)


def py(code: str) -> ExecuteRequest:
    return ExecuteRequest(language="python", code=code, timeout_ms=20_000)


async def test_provider_satisfies_the_seam(provider: LambdaMicrovmProvider) -> None:
    """The provider is a SandboxProvider with native pause/resume."""
    assert isinstance(provider, SandboxProvider)
    assert isinstance(provider, NativeSuspend)
    assert provider.name == "lambda-microvm"
    assert provider.capabilities.pause_resume is True


async def test_multi_turn_session_on_one_vm(
    provider: LambdaMicrovmProvider,
    emulator: MicrovmEmulator,
    handles: list[SandboxHandle],
    session_id: str,
) -> None:
    """Two executes in one runtime session on one VM: the second sees the first's file."""
    handle = await provider.create(SandboxSpec())
    handles.append(handle)
    first = await handle.runner.execute(
        py("open('state.txt', 'w').write('turn one'); print(6 * 7)"), session_id=session_id
    )
    assert first.status is RunStatus.OK
    assert first.stdout == "42\n"
    second = await handle.runner.execute(
        py("print(open('state.txt').read())"), session_id=session_id
    )
    assert second.stdout == "turn one\n"
    assert [c.operation for c in emulator.calls].count("RunMicrovm") == 1
    assert len(emulator.fleet.vms) == 1
    assert provider.metrics.launches_ok == 1


async def test_suspend_and_resume_keep_the_process_and_its_files(
    provider: LambdaMicrovmProvider,
    emulator: MicrovmEmulator,
    handles: list[SandboxHandle],
    session_id: str,
) -> None:
    """suspend = SuspendMicrovm freezes the runner; resume thaws the same process."""
    handle = await provider.create(SandboxSpec())
    handles.append(handle)
    vm_id = vm_id_of(handle)
    await handle.runner.execute(py("open('kept.txt', 'w').write('before')"), session_id=session_id)
    pid = runner_pid(emulator, vm_id)

    await provider.suspend(handle.sandbox_id)

    assert emulator.fleet.vms[vm_id].state is VmState.SUSPENDED
    assert state_once_stopped(pid) == "T"
    resumed = await provider.resume(handle.sandbox_id, SandboxSpec())
    handles.append(resumed)
    assert resumed.sandbox_id == handle.sandbox_id
    assert runner_pid(emulator, vm_id) == pid
    assert process_state(pid) != "T"
    again = await resumed.runner.execute(
        py("print(open('kept.txt').read())"), session_id=session_id
    )
    assert again.stdout == "before\n"
    assert (provider.metrics.suspends, provider.metrics.resumes) == (1, 1)
    assert emulator.fleet.vms[vm_id].state is VmState.RUNNING


async def test_traffic_resumes_a_vm_the_idle_policy_suspended(
    provider_factory: ProviderFactory,
    emulator: MicrovmEmulator,
    handles: list[SandboxHandle],
    session_id: str,
) -> None:
    """Idle past SANDCELL_IDLE_TIMEOUT_S: suspended; traffic wakes it; retention ends it."""
    provider = provider_factory(idle_timeout_s=120, retention_s=600)
    handle = await provider.create(SandboxSpec())
    handles.append(handle)
    vm = emulator.fleet.vms[vm_id_of(handle)]
    await handle.runner.execute(py("open('f', 'w').write('x')"), session_id=session_id)
    # Idle counts from the end of the last proxied request, as the emulator sees it.
    await _wait_for(lambda: vm.in_flight == 0)
    emulator.clock.advance(121)
    await _wait_for(lambda: vm.state is VmState.SUSPENDED)
    assert state_once_stopped(runner_pid(emulator, vm.microvm_id)) == "T"
    result = await handle.runner.execute(py("print(open('f').read())"), session_id=session_id)
    assert result.stdout == "x\n"
    assert vm.state is VmState.RUNNING
    await _wait_for(lambda: vm.in_flight == 0)
    emulator.clock.advance(121)
    await _wait_for(lambda: vm.state is VmState.SUSPENDED)
    emulator.clock.advance(601)
    await _wait_for(lambda: vm.state is VmState.TERMINATED)
    with pytest.raises(SandboxNotFoundError):
        await provider.connect(handle.sandbox_id)


async def test_destroy_is_idempotent(
    provider: LambdaMicrovmProvider, emulator: MicrovmEmulator, handles: list[SandboxHandle]
) -> None:
    """TerminateMicrovm kills the runner; destroying again, or an unknown VM, is quiet."""
    handle = await provider.create(SandboxSpec())
    handles.append(handle)
    vm = emulator.fleet.vms[vm_id_of(handle)]
    process = vm.process
    assert process is not None

    await provider.destroy(handle.sandbox_id)
    await provider.destroy(handle.sandbox_id)
    await provider.destroy("mvm-0000000000000000~00")

    assert vm.state is VmState.TERMINATED
    assert process.poll() is not None
    assert not vm.root.exists()
    with pytest.raises(SandboxNotFoundError):
        await provider.connect(handle.sandbox_id)
    with pytest.raises(SandboxNotFoundError):
        await provider.resume(handle.sandbox_id, SandboxSpec())


async def test_a_second_worker_with_the_key_reaches_the_vm(
    provider_factory: ProviderFactory, handles: list[SandboxHandle], session_id: str
) -> None:
    """The sandbox id carries the nonce, the key derives the token: no token is stored."""
    first = provider_factory()
    second = provider_factory()
    handle = await first.create(SandboxSpec())
    handles.append(handle)
    await handle.runner.execute(py("open('shared', 'w').write('one vm')"), session_id=session_id)

    other = await second.connect(handle.sandbox_id)
    handles.append(other)
    result = await other.runner.execute(py("print(open('shared').read())"), session_id=session_id)
    assert result.stdout == "one vm\n"


async def test_the_runner_holds_its_own_token(
    provider: LambdaMicrovmProvider, handles: list[SandboxHandle]
) -> None:
    """Proxy auth alone is not enough: the runner refuses a wrong bearer, without a re-mint."""
    handle = await provider.create(SandboxSpec())
    handles.append(handle)
    await handle.runner.health()
    mints = provider.metrics.token_mints
    assert handle.endpoint is not None
    impostor = RunnerClient(
        handle.endpoint,
        token="not-the-runner-token-0123456789",
        auth=handle.runner.connection.http.auth,
    )
    try:
        with pytest.raises(RunnerRequestError) as caught:
            await impostor.execute(py("print(1)"))
    finally:
        await impostor.close()
    assert caught.value.code == "unauthorized"
    assert provider.metrics.token_mints == mints


async def test_the_proxy_demands_a_token_for_that_vm(
    provider: LambdaMicrovmProvider, handles: list[SandboxHandle]
) -> None:
    """No X-aws-proxy-auth: 401; another VM's token: 403; nothing reaches the runner."""
    one = await provider.create(SandboxSpec())
    two = await provider.create(SandboxSpec())
    handles.extend([one, two])
    assert one.endpoint is not None
    assert proxy_get(one.endpoint, "/health").status_code == 401
    token_of_two = (await provider._tokens[vm_id_of(two)].current()).headers
    assert proxy_get(one.endpoint, "/health", **token_of_two).status_code == 403
    token_of_one = (await provider._tokens[vm_id_of(one)].current()).headers
    assert proxy_get(one.endpoint, "/health", **token_of_one).status_code == 200


async def test_a_vm_killed_between_turns_is_gone(
    provider: LambdaMicrovmProvider,
    emulator_url: str,
    handles: list[SandboxHandle],
    session_id: str,
) -> None:
    """After a crash the next turn fails retryably and connect reports the VM gone."""
    handle = await provider.create(SandboxSpec())
    handles.append(handle)
    await handle.runner.execute(py("print(1)"), session_id=session_id)
    async with httpx.AsyncClient(trust_env=False) as admin:
        killed = await admin.post(f"{emulator_url}/_emulator/vms/{vm_id_of(handle)}/kill")
    assert killed.json()["state"] == "TERMINATED"

    with pytest.raises(SandboxUnavailableError) as caught:
        await handle.runner.execute(py("print(2)"), session_id=session_id)
    assert caught.value.retryable
    with pytest.raises(SandboxNotFoundError):
        await provider.connect(handle.sandbox_id)


async def test_resume_refuses_what_it_did_not_make(provider: LambdaMicrovmProvider) -> None:
    """Another provider's sandbox id names no MicroVM."""
    with pytest.raises(SandboxNotFoundError):
        await provider.resume("c1", SandboxSpec())
    with pytest.raises(SandboxNotFoundError):
        await provider.suspend("no-separator")
    with pytest.raises(SandboxNotFoundError):
        await provider.connect("no-separator")


async def _wait_for(condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
    # Generous: on a loaded machine the provider's idle loop can lag the emulator's clock
    # by seconds (seen at 10 s); the condition, not the wait, is what the test asserts.
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await anyio.sleep(0.02)


async def test_a_live_checkpoint_goes_to_the_store_and_the_vm_keeps_running(
    provider: LambdaMicrovmProvider, emulator: MicrovmEmulator, tmp_path: Path
) -> None:
    """``SandboxManager.save`` pulls the workspace from the runner into the snapshot store
    on a provider that suspends natively too: the VM keeps running, the row points at it."""
    async with DirectorySnapshotStore(tmp_path / "snapshots") as store:
        manager = SandboxManager(provider, InProcessRegistry(), store)
        session_id = sandbox_session_key("apps-live")
        handle = await manager.acquire(session_id, SandboxSpec(), owner="apps")
        try:
            await handle.files.write("app.py", "print('live')")
            saved = await manager.save(session_id, handle)
            assert emulator.fleet.vms[vm_id_of(handle)].state is VmState.RUNNING
            record = await manager.record(session_id)
            assert record is not None
            assert (record.state, record.checkpoint_key) == ("active", saved.key)
            assert await store.exists(saved.key)
        finally:
            await handle.close()
            await manager.destroy(session_id)
