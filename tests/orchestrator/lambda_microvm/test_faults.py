"""Launch and traffic failures, injected in the emulator: what is retried, what is not."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from pathlib import Path
from typing import Any

import psutil
import pytest

from sandcell_orchestrator.emulator import Faults, MicrovmEmulator, VmState
from sandcell_orchestrator.errors import SandboxUnavailableError
from sandcell_orchestrator.handle import SandboxHandle
from sandcell_orchestrator.providers.base import SandboxSpec
from sandcell_orchestrator.providers.lambda_microvm import LambdaMicrovmProvider
from sandcell_protocol import ExecuteRequest
from tests.fixtures.cancelling import cancel_twice

from .conftest import ProviderFactory


def operations(emulator: MicrovmEmulator, name: str) -> list[str | None]:
    """The client tokens (or VM ids) of every recorded call to ``name``."""
    return [c.client_token or c.microvm_id for c in emulator.calls if c.operation == name]


async def test_boot_death_is_retried_once_with_a_new_client_token(
    provider: LambdaMicrovmProvider,
    emulator: MicrovmEmulator,
    faults: Faults,
    handles: list[SandboxHandle],
) -> None:
    """The first VM dies while PENDING; one replacement launch, with a fresh clientToken."""
    faults.boot_death_on_launch = {1}
    handle = await provider.create(SandboxSpec())
    handles.append(handle)

    tokens = operations(emulator, "RunMicrovm")
    assert len(tokens) == 2
    assert len(set(tokens)) == 2
    assert all(tokens)
    states = sorted(vm.state for vm in emulator.fleet.vms.values())
    assert states == [VmState.RUNNING, VmState.TERMINATED]
    assert provider.metrics.launches_retried == 1
    assert provider.metrics.launches_ok == 0
    assert (await handle.runner.health()).status == "ok"


async def test_a_second_boot_death_is_not_retried_again(
    provider: LambdaMicrovmProvider, emulator: MicrovmEmulator, faults: Faults
) -> None:
    """Exactly one retry: two deaths raise a retryable error after two launches."""
    faults.boot_death_on_launch = {1, 2}
    with pytest.raises(SandboxUnavailableError) as caught:
        await provider.create(SandboxSpec())
    assert caught.value.retryable
    assert len(operations(emulator, "RunMicrovm")) == 2
    assert provider.metrics.launches_failed == 1


async def test_throttled_launch_is_not_retried(
    provider: LambdaMicrovmProvider, emulator: MicrovmEmulator, faults: Faults
) -> None:
    """ThrottlingException on RunMicrovm: one call, a retryable error, a counted throttle."""
    faults.throttle = {"RunMicrovm": 5}
    with pytest.raises(SandboxUnavailableError) as caught:
        await provider.create(SandboxSpec())
    assert caught.value.retryable
    assert "ThrottlingException" in str(caught.value)
    assert len(emulator.calls) == 1
    assert emulator.calls[0].throttled
    assert provider.metrics.throttles == 1
    assert provider.metrics.launches_failed == 1
    assert not emulator.fleet.vms


async def test_throttled_status_poll_terminates_the_launched_vm(
    provider: LambdaMicrovmProvider, emulator: MicrovmEmulator, faults: Faults
) -> None:
    """A throttle after RunMicrovm surfaces, and the VM it launched is not left behind."""
    faults.boot_delay_s = 0.3
    faults.throttle = {"GetMicrovm": 1}
    with pytest.raises(SandboxUnavailableError):
        await provider.create(SandboxSpec())
    assert len(operations(emulator, "RunMicrovm")) == 1
    assert len(operations(emulator, "TerminateMicrovm")) == 1
    assert [vm.state for vm in emulator.fleet.vms.values()] == [VmState.TERMINATED]


async def test_boot_deadline_is_retryable_and_cleans_up(
    provider_factory: ProviderFactory, emulator: MicrovmEmulator, faults: Faults
) -> None:
    """A VM still PENDING at SANDCELL_MICROVM_BOOT_TIMEOUT_S: terminated, no second launch."""
    provider = provider_factory(boot_timeout_s=0.5)
    faults.boot_delay_s = 3.0
    with pytest.raises(SandboxUnavailableError) as caught:
        await provider.create(SandboxSpec())
    assert "not RUNNING" in str(caught.value)
    assert len(operations(emulator, "RunMicrovm")) == 1
    assert [vm.state for vm in emulator.fleet.vms.values()] == [VmState.TERMINATED]


async def test_an_expired_proxy_token_is_reminted(
    provider: LambdaMicrovmProvider,
    emulator: MicrovmEmulator,
    handles: list[SandboxHandle],
) -> None:
    """The proxy refuses an expired token (403); the auth re-mints once and resends."""
    handle = await provider.create(SandboxSpec())
    handles.append(handle)
    assert provider.metrics.token_mints == 1
    # Past the hour on the emulator's clock; the provider's clock still trusts its token.
    emulator.clock.advance(3601)

    result = await handle.runner.execute(ExecuteRequest(language="python", code="print('ok')"))

    assert result.stdout == "ok\n"
    assert provider.metrics.token_mints == 2
    assert len(operations(emulator, "CreateMicrovmAuthToken")) == 2


async def test_a_token_near_expiry_is_replaced_before_use(
    provider_factory: ProviderFactory,
    emulator: MicrovmEmulator,
    handles: list[SandboxHandle],
) -> None:
    """The provider's own clock re-mints ahead of expiry, so no request is refused."""
    now = [1000.0]
    provider = provider_factory(clock=lambda: now[0], token_minutes=10)
    handle = await provider.create(SandboxSpec())
    handles.append(handle)
    now[0] += 10 * 60 - 30  # inside the re-mint margin
    await handle.runner.health()
    assert provider.metrics.token_mints == 2


async def test_a_long_readiness_poll_survives_token_expiry(
    provider: LambdaMicrovmProvider,
    emulator: MicrovmEmulator,
    faults: Faults,
    handles: list[SandboxHandle],
) -> None:
    """RUNNING long before the runner listens, tokens expiring meanwhile: still ready."""
    faults.listener_delay_s = 2.0
    faults.token_lifetime_s = 0.4
    handle = await provider.create(SandboxSpec())
    handles.append(handle)
    assert provider.metrics.token_mints >= 3
    assert provider.metrics.launches_ok == 1
    assert len(operations(emulator, "RunMicrovm")) == 1


async def test_a_vm_dying_while_its_runner_starts_is_replaced(
    provider: LambdaMicrovmProvider,
    emulator: MicrovmEmulator,
    faults: Faults,
    handles: list[SandboxHandle],
) -> None:
    """RUNNING, then TERMINATED before /health answered: counts as a boot death."""
    faults.listener_delay_s = 1.5
    faults.runner_exits_on_launch = {1}
    handle = await provider.create(SandboxSpec())
    handles.append(handle)
    assert provider.metrics.launches_retried == 1
    assert len(operations(emulator, "RunMicrovm")) == 2


async def test_the_tps_budget_spaces_control_plane_calls(
    provider_factory: ProviderFactory, emulator: MicrovmEmulator, handles: list[SandboxHandle]
) -> None:
    """With SANDCELL_MICROVM_TPS=2, launches are paced instead of bursting."""
    provider = provider_factory(tps=2.0)
    started = emulator.clock()
    for _ in range(3):
        handles.append(await provider.create(SandboxSpec()))
    # Three RunMicrovm at 2/s with a burst of 2: the third waits ~0.5 s.
    assert emulator.clock() - started >= 0.45
    assert not any(call.throttled for call in emulator.calls)


async def test_a_launch_cancelled_again_while_it_terminates_its_vm_terminates_it(
    provider: LambdaMicrovmProvider, emulator: MicrovmEmulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled while its VM boots, the launch terminates it: under an anyio shield
    only, a second native cancellation stopped the TerminateMicrovm and the VM ran on
    until its idle policy ended it. The terminate is held until the second one came;
    the emulator's spawn of the VM's runner until the terminate is over (a runner
    spawned after it used to run on, orphaned)."""
    booting, terminating, go_on = asyncio.Event(), asyncio.Event(), asyncio.Event()
    terminated, booted = threading.Event(), threading.Event()
    real_terminate = provider._api.terminate
    real_spawn = emulator.fleet._spawn
    real_boot = emulator.fleet._boot

    async def never_attached(*_: Any, **__: Any) -> SandboxHandle:
        booting.set()
        await asyncio.Event().wait()
        raise AssertionError("never attached")

    async def held_terminate(vm_id: str) -> None:
        terminating.set()
        await go_on.wait()
        await real_terminate(vm_id)
        terminated.set()

    def held_spawn(vm: Any) -> Any:
        terminated.wait(60)
        return real_spawn(vm)

    async def watched_boot(*args: Any) -> None:
        try:
            await real_boot(*args)
        finally:
            booted.set()

    monkeypatch.setattr(provider, "_attach", never_attached)
    monkeypatch.setattr(provider._api, "terminate", held_terminate)
    monkeypatch.setattr(emulator.fleet, "_spawn", held_spawn)
    monkeypatch.setattr(emulator.fleet, "_boot", watched_boot)
    create = asyncio.create_task(provider.create(SandboxSpec()))
    try:
        await cancel_twice(create, first=booting, cleaning=terminating, go_on=go_on)
    finally:
        go_on.set()
        terminated.set()
    assert len(operations(emulator, "RunMicrovm")) == 1
    assert [vm.state for vm in emulator.fleet.vms.values()] == [VmState.TERMINATED]
    assert await asyncio.to_thread(booted.wait, 60)
    (vm,) = emulator.fleet.vms.values()
    left = _runners_in(vm.root)
    for pid in left:
        os.killpg(pid, signal.SIGKILL)  # the test's own, whatever it asserts
    assert left == [], "the runner spawned after the terminate ran on"


def _runners_in(root: Path) -> list[int]:
    found = []
    for process in psutil.process_iter(["pid", "environ"]):
        try:
            workspace = (process.info["environ"] or {}).get("SANDCELL_WORKSPACE_ROOT", "")
            if workspace.startswith(f"{root}/") and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process.info["pid"])
        except psutil.Error:
            continue
    return found
