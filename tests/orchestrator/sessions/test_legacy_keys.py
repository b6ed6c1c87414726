"""Checkpoints written under the old mutable keys are still restored.

Before generations, a session's checkpoint lived at ``checkpoints/<rt>.tar.gz``
and an app sandbox's at ``snapshots/<rt>.tar.gz`` (both zstd inside, whatever
the name said). A session saved that way comes back; its next checkpoint goes
under the generation keys, and the old object is collected once superseded.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from sandcell_orchestrator.providers.base import SandboxSpec
from sandcell_orchestrator.providers.local import LocalProvider
from sandcell_orchestrator.registry import InProcessRegistry, SessionRecord
from sandcell_orchestrator.sessions.execution import ExecutionService, Identity
from sandcell_orchestrator.sessions.manager import SandboxManager, sandbox_session_key
from sandcell_orchestrator.snapshots import SnapshotStore
from sandcell_protocol import (
    ExecuteRequest,
    checkpoint_prefix,
    legacy_checkpoint_key,
    parse_checkpoint_key,
    runtime_session_id,
)

ALICE = Identity("tenant-a", "alice")


def py(code: str) -> ExecuteRequest:
    return ExecuteRequest(language="python", code=code)


async def _body(store: SnapshotStore, key: str) -> bytes:
    async with store.get(key, max_bytes=1 << 30) as snapshot:
        return b"".join([chunk async for chunk in snapshot.chunks])


async def _chunks(data: bytes) -> AsyncIterator[bytes]:
    yield data


async def _checkpoint_bytes(
    provider: LocalProvider, store: SnapshotStore, code: str, hint: str
) -> bytes:
    """A real checkpoint archive of a session after ``code`` ran (then forgotten)."""
    service = ExecutionService(provider=provider, registry=InProcessRegistry(), store=store)
    await service.execute(py(code), ALICE, hint=hint)
    session_id = runtime_session_id(ALICE.namespace, ALICE.user_id, hint)
    key = await service.manager.current_checkpoint(session_id)
    assert key is not None
    data = await _body(store, key)
    await service.manager.destroy(session_id)
    await service.aclose(destroy_sandboxes=True)
    return data


async def test_a_session_saved_under_the_old_key_is_restored(
    local_provider: LocalProvider, dir_store: SnapshotStore
) -> None:
    """No record, only ``checkpoints/<rt>.tar.gz``: the turn restores it first, then
    checkpoints under a generation key; the old object goes once superseded."""
    archive = await _checkpoint_bytes(
        local_provider, dir_store, "open('notes.txt', 'w').write('from the old days')", "old"
    )
    session_id = runtime_session_id(ALICE.namespace, ALICE.user_id, "old")
    legacy = legacy_checkpoint_key(session_id)
    await dir_store.put(legacy, _chunks(archive), max_bytes=1 << 30)
    assert await dir_store.list(checkpoint_prefix(session_id)) == []

    manager = SandboxManager(local_provider, InProcessRegistry(), dir_store, checkpoint_grace_s=0)
    service = ExecutionService(manager=manager)
    result = await service.execute(
        py("print(open('notes.txt').read()); open('more.txt', 'w').write('new')"),
        ALICE,
        hint="old",
    )
    assert result.stdout == "from the old days\n"
    assert manager.metrics.value("sandcell_restores_total", outcome="ok") == 1
    record = await manager.record(session_id)
    assert record is not None
    assert record.checkpoint_key is not None
    assert parse_checkpoint_key(record.checkpoint_key) == (session_id, record.generation)
    assert not await dir_store.exists(legacy)  # superseded, past a grace of 0 s
    await service.aclose(destroy_sandboxes=True)


async def test_an_app_sandbox_saved_under_the_old_snapshots_key_is_resumed(
    local_provider: LocalProvider, dir_store: SnapshotStore
) -> None:
    """A suspended row pointing at ``snapshots/<rt>.tar.gz`` resumes from it."""
    session_id = sandbox_session_key("an-old-instance")
    maker = SandboxManager(local_provider, InProcessRegistry(), dir_store)
    made = await maker.acquire(session_id, SandboxSpec(), owner="apps")
    await made.files.write("app.py", "print(1)")
    archive = await _body(dir_store, (await maker.save(session_id, made)).key)
    await made.close()
    await maker.destroy(session_id)
    old_key = f"snapshots/{session_id}.tar.gz"
    await dir_store.put(old_key, _chunks(archive), max_bytes=1 << 30)
    registry = InProcessRegistry()
    lease = await registry.acquire_lock(session_id, ttl_ms=10_000)
    assert lease is not None
    now = time.time()
    await registry.put(
        lease,
        SessionRecord(
            session_id=session_id,
            provider="local",
            sandbox_id="local-0000000000000000",
            sandbox_uuid="an-old-instance",
            endpoint=None,
            generation=await registry.next_generation(session_id),
            checkpoint_key=old_key,
            state="suspended",
            created_at_s=now,
            updated_at_s=now,
        ),
    )
    await registry.release(lease)

    manager = SandboxManager(local_provider, registry, dir_store)
    handle = (await manager.resume(session_id, SandboxSpec())).handle
    try:
        assert await handle.files.read("app.py") == "print(1)"
    finally:
        await handle.close()
    assert await manager.destroy(session_id)
    assert not await dir_store.exists(old_key)  # destroy deletes the row's object too
