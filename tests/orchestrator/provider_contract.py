"""The provider contract: what every ``SandboxProvider`` must do, as plain async checks.

A backend's test module runs each check against its own provider:

    @pytest.mark.parametrize("check", CONTRACT, ids=lambda check: check.__name__)
    async def test_contract(check: ContractCheck, target: ContractTarget) -> None:
        await check(target)

``ContractTarget.make_provider`` returns a *new* provider instance over the same
backend each time it is called (``connect`` must work from a fresh instance, as
from another orchestrator process); the target closes what it made. The last two
checks run ``SandboxManager`` over the provider and the target's snapshot store:
suspend and resume are the manager's, whatever the backend can do natively.
Checks destroy every sandbox they create, also when they fail.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace

import pytest

from sandcell_orchestrator.errors import CheckpointError, SandboxNotFoundError
from sandcell_orchestrator.handle import SandboxHandle
from sandcell_orchestrator.providers.base import (
    SESSION_LABEL,
    NativeSuspend,
    SandboxProvider,
    SandboxSpec,
)
from sandcell_orchestrator.registry import InProcessRegistry
from sandcell_orchestrator.sessions.manager import SandboxManager
from sandcell_orchestrator.snapshots import SnapshotStore
from sandcell_protocol import ExecuteRequest, ExecuteResult, RunStatus, runtime_session_id


@dataclass
class ContractTarget:
    """One backend under test."""

    make_provider: Callable[[], SandboxProvider]
    store: SnapshotStore
    spec: SandboxSpec = field(default_factory=SandboxSpec)
    missing_sandbox_id: str = "0" * 64
    """An id the provider accepts in form but that names no sandbox."""
    _providers: list[SandboxProvider] = field(default_factory=list)

    def provider(self) -> SandboxProvider:
        made = self.make_provider()
        self._providers.append(made)
        return made

    def session_spec(self) -> SandboxSpec:
        """The base spec, labelled with a fresh runtime session (as the manager does)."""
        session = runtime_session_id("contract", "user", uuid.uuid4().hex)
        return replace(self.spec, labels={**self.spec.labels, SESSION_LABEL: session})

    async def close(self) -> None:
        for made in self._providers:
            await made.close()
        self._providers.clear()


ContractCheck = Callable[[ContractTarget], Awaitable[None]]


@contextlib.asynccontextmanager
async def _sandbox(
    provider: SandboxProvider, handle: SandboxHandle
) -> AsyncIterator[SandboxHandle]:
    """Close and destroy ``handle``'s sandbox on the way out, whatever happened."""
    try:
        yield handle
    finally:
        await handle.close()
        await provider.destroy(handle.sandbox_id)


async def _python(handle: SandboxHandle, code: str) -> ExecuteResult:
    result = await handle.runner.execute(
        ExecuteRequest(language="python", code=code, timeout_ms=20_000),
        session_id=handle.session_id,
    )
    assert result.status is RunStatus.OK, (result.status, result.stderr)
    return result


async def create_execute_destroy(target: ContractTarget) -> None:
    """create answers once the runner is healthy; a job runs; destroy makes it gone."""
    provider = target.provider()
    assert provider.capabilities.pause_resume in (True, False)
    spec = target.session_spec()
    handle = await provider.create(spec)
    async with _sandbox(provider, handle):
        assert handle.provider == provider.name
        assert handle.sandbox_id
        assert handle.session_id == spec.labels[SESSION_LABEL]
        result = await _python(handle, "print(6 * 7)")
        assert result.stdout == "42\n"
        assert result.exit_code == 0
    with pytest.raises(SandboxNotFoundError):
        await provider.connect(handle.sandbox_id)


async def session_state_survives_turns(target: ContractTarget) -> None:
    """Within one sandbox, a runtime session's workspace carries files between turns."""
    provider = target.provider()
    spec = target.session_spec()
    async with _sandbox(provider, await provider.create(spec)) as handle:
        assert handle.session_id == spec.labels[SESSION_LABEL]
        await _python(handle, "open('counter.txt', 'w').write('1')")
        await _python(
            handle,
            "n = int(open('counter.txt').read()); open('counter.txt', 'w').write(str(n + 1))",
        )
        result = await _python(handle, "print(open('counter.txt').read())")
        assert result.stdout == "2\n"


async def connect_from_a_new_provider(target: ContractTarget) -> None:
    """Another provider instance (another process, in production) reaches the same sandbox."""
    provider = target.provider()
    spec = target.session_spec()
    async with _sandbox(provider, await provider.create(spec)) as handle:
        await _python(handle, "open('note.txt', 'w').write('from the first')")
        other = await target.provider().connect(handle.sandbox_id)
        try:
            assert other.sandbox_id == handle.sandbox_id
            assert other.session_id == handle.session_id
            result = await _python(other, "print(open('note.txt').read())")
            assert result.stdout == "from the first\n"
        finally:
            await other.close()


async def suspend_resume_continues(target: ContractTarget) -> None:
    """Through the manager: suspend (native, or checkpoint → destroy) → resume: the
    session's files come back, in the same sandbox only if the provider suspends natively."""
    provider = target.provider()
    native = isinstance(provider, NativeSuspend)
    assert provider.capabilities.pause_resume == native
    manager = SandboxManager(provider, InProcessRegistry(), target.store)
    session_id = runtime_session_id("contract", "user", uuid.uuid4().hex)
    handle = await manager.acquire(session_id, target.spec, owner="contract")
    try:
        await _python(handle, "open('state.txt', 'w').write('turn 1')")
        await handle.close()
        assert await manager.suspend(session_id)
        record = await manager.record(session_id)
        assert record is not None
        assert record.state == "suspended"
        if not native:
            assert record.checkpoint_key is not None
            assert await target.store.exists(record.checkpoint_key)
            with pytest.raises(SandboxNotFoundError):
                await provider.connect(handle.sandbox_id)
        attached = await manager.resume(session_id, target.spec)
        resumed = attached.handle
        try:
            assert (resumed.sandbox_id == handle.sandbox_id) == native
            assert attached.launched != native  # resumed in place, or launched and restored
            assert resumed.session_id == session_id
            await _python(resumed, "open('state.txt', 'a').write(', turn 2')")
            result = await _python(resumed, "print(open('state.txt').read())")
            assert result.stdout == "turn 1, turn 2\n"
        finally:
            await resumed.close()
    finally:
        await manager.destroy(session_id)
    assert await target.store.list(f"checkpoints/{session_id}") == []


async def resume_of_a_missing_checkpoint_fails(target: ContractTarget) -> None:
    """A session whose checkpoint vanished is not resumed onto an empty workspace."""
    provider = target.provider()
    manager = SandboxManager(provider, InProcessRegistry(), target.store)
    session_id = runtime_session_id("contract", "user", uuid.uuid4().hex)
    handle = await manager.acquire(session_id, target.spec, owner="contract")
    try:
        await _python(handle, "open('state.txt', 'w').write('saved')")
        await manager.save(session_id, handle)
        await handle.close()
        assert await manager.suspend(session_id)
        record = await manager.record(session_id)
        assert record is not None
        assert record.checkpoint_key is not None
        await target.store.delete(record.checkpoint_key)
        # A native suspend keeps the sandbox: it has to be gone too for a restore.
        await provider.destroy(record.sandbox_id)
        with pytest.raises(CheckpointError):
            await manager.resume(session_id, target.spec)
        again = await manager.record(session_id)
        assert again is not None
        assert again.state == "suspended"  # nothing left running, still resumable
    finally:
        await manager.destroy(session_id)


async def destroy_is_idempotent(target: ContractTarget) -> None:
    """Destroying a sandbox twice, or one that never existed, returns quietly."""
    provider = target.provider()
    await provider.destroy(target.missing_sandbox_id)
    handle = await provider.create(target.session_spec())
    await handle.close()
    await provider.destroy(handle.sandbox_id)
    await provider.destroy(handle.sandbox_id)
    with pytest.raises(SandboxNotFoundError):
        await provider.connect(target.missing_sandbox_id)


CONTRACT: tuple[ContractCheck, ...] = (
    create_execute_destroy,
    session_state_survives_turns,
    connect_from_a_new_provider,
    suspend_resume_continues,
    resume_of_a_missing_checkpoint_fails,
    destroy_is_idempotent,
)
