"""SandboxManager over the local provider: acquire, suspend (checkpoint, destroy, mark), resume."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from sandcell_orchestrator.config import Budgets
from sandcell_orchestrator.errors import CheckpointError, RegistryError, SandboxNotFoundError
from sandcell_orchestrator.providers.base import NativeSuspend, SandboxProvider, SandboxSpec
from sandcell_orchestrator.providers.local import LocalProvider, LocalSettings
from sandcell_orchestrator.registry import IdempotentAnswer, InProcessRegistry, Lease, SessionRecord
from sandcell_orchestrator.sessions.manager import SandboxManager, sandbox_session_key
from sandcell_orchestrator.sessions.persistence import (
    Persistence,
    PersistentWorkspace,
    turn_result_key,
)
from sandcell_orchestrator.snapshots import DirectorySnapshotStore, SnapshotStore
from sandcell_protocol import checkpoint_key, runtime_session_id
from tests.fixtures.paths import traversable_dir
from tests.orchestrator.sessions.conftest import runner_pids


@pytest.fixture
async def env() -> AsyncIterator[tuple[LocalProvider, SnapshotStore, Path]]:
    with traversable_dir("mgr-") as root:
        async with DirectorySnapshotStore(root / "snapshots") as store:
            provider = LocalProvider(LocalSettings(runtime_dir=root / "rt"))
            try:
                yield provider, store, root
            finally:
                await provider.close()
                for child in (root / "rt").iterdir():
                    await provider.destroy(child.name)


async def test_acquire_suspend_resume_destroy(
    env: tuple[LocalProvider, SnapshotStore, Path],
) -> None:
    provider, store, root = env
    manager = SandboxManager(provider, InProcessRegistry(), store)
    session_id = sandbox_session_key("alice-sandbox")
    handle = await manager.acquire(session_id, SandboxSpec(), owner="alice")
    assert handle.session_id == session_id
    await handle.files.write("notes/todo.txt", "ship it")
    await handle.commands.run("mkdir -p empty && chmod 700 empty")
    first_id = handle.sandbox_id
    assert await manager.suspend(session_id)
    await handle.close()
    record = await manager.record(session_id)
    assert record is not None
    assert record.state == "suspended"
    assert record.checkpoint_key is not None
    assert await store.exists(record.checkpoint_key)
    assert runner_pids(root) == []  # checkpoint, then destroy
    with pytest.raises(SandboxNotFoundError):
        await manager.connect(session_id)
    assert not await manager.suspend(session_id)  # nothing active to suspend

    attached = await manager.resume(session_id, SandboxSpec())
    assert attached.launched  # a new sandbox, restored (not resumed in place)
    resumed = attached.handle
    assert resumed.sandbox_id != first_id  # the provider id changes; the session does not
    assert await resumed.files.read("notes/todo.txt") == "ship it"
    listing = {entry.name: entry for entry in await resumed.files.list()}
    assert listing["empty"].kind == "dir"
    record = await manager.record(session_id)
    assert record is not None
    assert record.state == "active"
    assert record.sandbox_id == resumed.sandbox_id
    await resumed.close()

    assert await manager.destroy(session_id)
    assert await manager.record(session_id) is None
    assert await store.list("checkpoints/") == []
    assert runner_pids(root) == []
    assert not await manager.destroy(session_id)  # idempotent


class _BrokenRegistry(InProcessRegistry):
    async def put(
        self, lease: Lease, record: SessionRecord, *, answer: IdempotentAnswer | None = None
    ) -> None:
        raise RegistryError("registry down")


async def test_failed_registration_destroys_the_new_sandbox(
    env: tuple[LocalProvider, SnapshotStore, Path],
) -> None:
    provider, store, root = env
    manager = SandboxManager(provider, _BrokenRegistry(), store)
    with pytest.raises(RegistryError):
        await manager.acquire(sandbox_session_key("bob"), SandboxSpec(), owner="bob")
    assert runner_pids(root) == []
    assert list((root / "rt").iterdir()) == []


async def test_provider_contract_shape(env: tuple[LocalProvider, SnapshotStore, Path]) -> None:
    provider, _, _ = env
    assert isinstance(provider, SandboxProvider)
    assert provider.capabilities.pause_resume is False
    assert not isinstance(provider, NativeSuspend)
    await provider.destroy("local-0000000000000000")  # a missing sandbox is a no-op
    with pytest.raises(SandboxNotFoundError):
        await provider.connect("local-0000000000000000")


async def test_suspend_keeps_only_the_persistent_workspace(
    env: tuple[LocalProvider, SnapshotStore, Path],
) -> None:
    provider, store, _ = env
    manager = SandboxManager(provider, InProcessRegistry(), store)
    session_id = sandbox_session_key("carol")
    handle = await manager.acquire(session_id, SandboxSpec(), owner="carol")
    await handle.files.write("keep/notes.txt", "kept")
    await handle.files.write("cache/blob.bin", "dropped")
    await manager.suspend(session_id, workspace=PersistentWorkspace(exclude=("cache",)))
    await handle.close()
    resumed = (await manager.resume(session_id, SandboxSpec())).handle
    names = {entry.name for entry in await resumed.files.list()}
    assert names == {"keep"}
    await resumed.close()
    await manager.destroy(session_id)


async def test_live_checkpoint_then_replace_a_lost_sandbox(
    env: tuple[LocalProvider, SnapshotStore, Path],
) -> None:
    provider, store, root = env
    manager = SandboxManager(provider, InProcessRegistry(), store)
    session_id = sandbox_session_key("dave")
    handle = await manager.acquire(session_id, SandboxSpec(), owner="dave")
    with pytest.raises(CheckpointError):
        await manager.replace_lost(session_id, SandboxSpec())  # nothing saved yet
    assert runner_pids(root) != []  # and the refused replacement destroyed nothing

    await handle.files.write("work.txt", "turn 1")
    ref = await manager.save(session_id, handle)
    assert await store.exists(ref.key)
    record = await manager.record(session_id)
    assert record is not None
    assert (record.state, record.checkpoint_key) == ("active", ref.key)
    # The sandbox kept running through its checkpoint.
    await handle.files.write("work.txt", "turn 2, after the checkpoint")
    lost_id = handle.sandbox_id
    await handle.close()

    for pid in runner_pids(root):
        os.kill(pid, signal.SIGKILL)
    replaced = await manager.replace_lost(session_id, SandboxSpec())
    assert replaced.sandbox_id != lost_id
    assert await replaced.files.read("work.txt") == "turn 1"
    record = await manager.record(session_id)
    assert record is not None
    assert (record.state, record.sandbox_id) == ("active", replaced.sandbox_id)
    assert not (root / "rt" / lost_id).exists()  # the remains were destroyed
    await replaced.close()
    await manager.destroy(session_id)
    assert not await store.exists(ref.key)


async def _one_byte() -> AsyncIterator[bytes]:
    yield b"x"


async def test_a_hold_after_a_registry_wipe_never_takes_a_pre_wipe_generation(
    env: tuple[LocalProvider, SnapshotStore, Path],
) -> None:
    """The registry forgot the session (a wiped Redis) while a holder from before is
    mid-turn at a generation past the newest object: the new hold is far past both,
    so the two never write one checkpoint key; it still restores the newest object."""
    provider, store, _ = env
    session_id = runtime_session_id("tenant-a", "alice", "wiped")
    await store.put(checkpoint_key(session_id, 5), _one_byte(), max_bytes=8)
    before = InProcessRegistry()
    pre_wipe = await before.next_generation(session_id, above=5)
    stale_keys = {checkpoint_key(session_id, pre_wipe + n) for n in range(1000)}
    manager = SandboxManager(provider, InProcessRegistry(), store)
    async with manager.hold(session_id) as hold:
        assert hold.record is None
        assert hold.checkpoint_key == checkpoint_key(session_id, 5)
        assert checkpoint_key(session_id, hold.generation) not in stale_keys
        assert hold.generation > pre_wipe


async def test_holds_after_two_registry_wipes_never_share_a_generation(
    env: tuple[LocalProvider, SnapshotStore, Path],
) -> None:
    """Two wipes with nothing uploaded between them: the hold taken after the first (a
    worker stopped mid-turn, its upload still to come) and the one taken after the
    second list the same newest object. They must not share a generation, and so a
    checkpoint key (the stopped worker's upload would replace the newer holder's
    commit), and the later hold's is the higher one (its objects are the newest)."""
    provider, store, _ = env
    session_id = runtime_session_id("tenant-a", "alice", "wiped-twice")
    await store.put(checkpoint_key(session_id, 5), _one_byte(), max_bytes=8)
    # Half a second apart: a wipe (a Redis restarting empty) lies between the two.
    first = SandboxManager(provider, InProcessRegistry(), store, wall_clock=lambda: 1.8e9)
    second = SandboxManager(provider, InProcessRegistry(), store, wall_clock=lambda: 1.8e9 + 0.5)
    async with first.hold(session_id) as stopped, second.hold(session_id) as later:
        assert stopped.checkpoint_key == later.checkpoint_key
        assert later.generation > stopped.generation


async def test_a_hold_with_a_kept_counter_and_no_record_takes_the_next_generation(
    env: tuple[LocalProvider, SnapshotStore, Path],
) -> None:
    """No record but the counter kept (a new or deleted session, a lost record): the
    counter already fences, so the hold takes exactly the next generation."""
    provider, store, _ = env
    session_id = runtime_session_id("tenant-a", "alice", "kept")
    registry = InProcessRegistry()
    assert await registry.next_generation(session_id, above=40) == 41
    manager = SandboxManager(provider, registry, store)
    async with manager.hold(session_id) as hold:
        assert hold.record is None
        assert hold.generation == 42
    await store.put(checkpoint_key(session_id, 50), _one_byte(), max_bytes=8)
    async with manager.hold(session_id) as hold:
        assert hold.generation == 51
        assert hold.checkpoint_key == checkpoint_key(session_id, 50)


async def test_a_keyed_turns_result_goes_with_its_checkpoint(
    env: tuple[LocalProvider, SnapshotStore, Path],
) -> None:
    """A turn result saved next to a checkpoint is listed with it, collected with it once
    superseded (never without it: the result first), and deleted with the session,
    even one whose checkpoint is already gone; a result whose checkpoint never came is
    never the newest checkpoint, and is collected too."""
    _, store, _ = env
    session_id = runtime_session_id("tenant-a", "alice", "results")
    persistence = Persistence(store, grace_s=0.0)
    turn_key = "ab" * 32
    for generation in (3, 4):
        await store.put(checkpoint_key(session_id, generation), _one_byte(), max_bytes=8)
    await persistence.save_turn_result(
        checkpoint_key(session_id, 3), turn_key=turn_key, body=b"first"
    )
    await persistence.save_turn_result(
        checkpoint_key(session_id, 4), turn_key="cd" * 32, body=b"second"
    )
    # A result whose checkpoint never got stored (saved first, the upload then failed).
    await persistence.save_turn_result(checkpoint_key(session_id, 2), turn_key="ef" * 32, body=b"")
    stored = await persistence.stored(session_id)
    assert [(item.generation, item.turn_key, item.restorable) for item in stored] == [
        (2, "ef" * 32, False),
        (3, turn_key, True),
        (4, "cd" * 32, True),
    ]
    assert await persistence.turn_result(stored[1]) == b"first"
    latest = Persistence.latest(stored)
    assert latest is not None
    assert latest.generation == 4

    keep = checkpoint_key(session_id, 4)
    assert await persistence.collect(session_id, stored, keep=keep, below_generation=5) == 2
    left = [entry.key for entry in await store.list(f"checkpoints/{session_id}")]
    assert left == [keep, turn_result_key(keep, "cd" * 32)]

    await store.delete(keep)  # a result left without its checkpoint still goes
    await persistence.delete_all(session_id)
    assert await store.list(f"checkpoints/{session_id}") == []


class _Freezable:
    """A holder's view of the registry: once its process is stopped (SIGSTOP), its lease
    renewals 'succeed' without reaching the registry, so the lock expires under it."""

    def __init__(self, inner: InProcessRegistry) -> None:
        self._inner = inner
        self.frozen = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def renew(self, lease: Lease, *, ttl_ms: int) -> bool:
        return True if self.frozen.is_set() else await self._inner.renew(lease, ttl_ms=ttl_ms)


class _StoppingStore:
    """The store as that holder sees it: its process stops as a restore's read begins."""

    def __init__(self, inner: SnapshotStore, registry: _Freezable) -> None:
        self._inner = inner
        self._registry = registry

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @contextlib.asynccontextmanager
    async def get(self, key: str, *, max_bytes: int) -> AsyncIterator[Any]:
        self._registry.frozen.set()
        await asyncio.Event().wait()  # stopped: until cancelled
        yield None


async def test_a_holder_stopped_mid_restore_leaves_a_sandbox_nobody_reuses(
    env: tuple[LocalProvider, SnapshotStore, Path],
) -> None:
    """A holder stopped (SIGSTOP) while it restores a new sandbox, past its lock TTL:
    the next holder must not reuse that recorded sandbox, whose workspace is still
    empty (it ran turns on an empty workspace, seen in the chaos run), but replace it
    and restore the checkpoint itself."""
    provider, store, root = env
    registry = InProcessRegistry()
    budgets = Budgets(lock_ttl_s=1.5)
    manager = SandboxManager(provider, registry, store, budgets=budgets)
    session_id = runtime_session_id("tenant-a", "alice", "stopped-mid-restore")
    async with manager.hold(session_id) as hold:
        attached = await manager.attach(hold, SandboxSpec())
        await attached.handle.files.write("log", "t1\n")
        await manager.checkpoint(hold, attached)
        await manager.park(hold, attached)  # the next holder launches and restores

    freezable = _Freezable(registry)
    stopped = SandboxManager(
        provider,
        freezable,  # type: ignore[arg-type]
        _StoppingStore(store, freezable),  # type: ignore[arg-type]
        budgets=budgets,
    )

    async def stopped_holder() -> None:
        async with stopped.hold(session_id) as hold:
            await stopped.attach(hold, SandboxSpec())

    frozen = asyncio.create_task(stopped_holder())
    try:
        stop = asyncio.create_task(freezable.frozen.wait())
        await asyncio.wait({stop, frozen}, timeout=60, return_when=asyncio.FIRST_COMPLETED)
        assert freezable.frozen.is_set(), frozen.exception() if frozen.done() else "stuck"
        async with manager.hold(session_id, wait_ms=30_000) as hold:
            attached = await manager.attach(hold, SandboxSpec())
            assert await attached.handle.files.read("log") == "t1\n"
            assert attached.restored
    finally:
        frozen.cancel()
        with contextlib.suppress(BaseException):
            await frozen
    await manager.destroy(session_id)
    assert runner_pids(root) == []
