"""The provider contract: what every ``SandboxProvider`` must do, as plain async checks.

A backend's test module runs each check against its own provider:

    @pytest.mark.parametrize("check", CONTRACT, ids=lambda check: check.__name__)
    async def test_contract(check: ContractCheck, target: ContractTarget) -> None:
        await check(target)

``ContractTarget.make_provider`` returns a *new* provider instance over the same
backend and snapshot store each time it is called (``connect`` must work from a
fresh instance, as from another orchestrator process); the target closes what it
made. Checks destroy every sandbox they create, also when they fail.
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
    ObjectSnapshot,
    PersistentWorkspace,
    SandboxProvider,
    SandboxSpec,
)
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


async def persist_destroy_resume_continues(target: ContractTarget) -> None:
    """persist → destroy → resume into a new sandbox: the session's files come back."""
    provider = target.provider()
    spec = target.session_spec()
    key = f"contract/{uuid.uuid4().hex}.tar"
    handle = await provider.create(spec)
    async with _sandbox(provider, handle):
        await _python(handle, "open('state.txt', 'w').write('turn 1')")
        ref = await provider.persist(handle, PersistentWorkspace(), key=key)
    try:
        if isinstance(ref, ObjectSnapshot):
            assert ref.key == key
            assert await target.store.exists(key)
            assert ref.size is not None
            assert ref.size > 0
            assert ref.sha256 is not None
            assert len(ref.sha256) == 64
        resumed = await target.provider().resume(ref, spec)
        async with _sandbox(provider, resumed):
            if not provider.capabilities.pause_resume:
                assert resumed.sandbox_id != handle.sandbox_id
            assert resumed.session_id == handle.session_id
            await _python(resumed, "open('state.txt', 'a').write(', turn 2')")
            result = await _python(resumed, "print(open('state.txt').read())")
            assert result.stdout == "turn 1, turn 2\n"
    finally:
        await provider.delete_snapshot(ref)
        await provider.delete_snapshot(ref)  # idempotent
    if isinstance(ref, ObjectSnapshot):
        assert not await target.store.exists(key)


async def resume_of_a_missing_snapshot_fails(target: ContractTarget) -> None:
    """A snapshot that is not in the store cannot be resumed (and nothing is left running)."""
    provider = target.provider()
    if provider.capabilities.pause_resume:
        return
    ref = ObjectSnapshot(key=f"contract/missing-{uuid.uuid4().hex}.tar")
    with pytest.raises(CheckpointError):
        await provider.resume(ref, target.session_spec())


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
    persist_destroy_resume_continues,
    resume_of_a_missing_snapshot_fails,
    destroy_is_idempotent,
)
