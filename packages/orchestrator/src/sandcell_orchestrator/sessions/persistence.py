"""Object-store snapshots for providers without native suspend (local, docker)."""

from __future__ import annotations

from ..handle import SandboxHandle
from ..providers.base import ObjectSnapshot, PersistentWorkspace, sandbox_session_id
from ..snapshots import SnapshotStore


async def persist_to_store(
    handle: SandboxHandle,
    store: SnapshotStore,
    *,
    key: str,
    max_bytes: int,
    workspace: PersistentWorkspace | None = None,
) -> ObjectSnapshot:
    """Stream the sandbox's session checkpoint (what ``workspace`` keeps) into ``store``."""
    session_id = handle.session_id or sandbox_session_id(handle.sandbox_id)
    selection = workspace or PersistentWorkspace()
    async with handle.runner.checkpoint(
        session_id=session_id, include=selection.include, exclude=selection.exclude
    ) as chunks:
        info = await store.put(key, chunks, max_bytes=max_bytes)
    return ObjectSnapshot(key=info.key, sha256=info.sha256, size=info.size)


async def restore_from_store(
    handle: SandboxHandle, store: SnapshotStore, ref: ObjectSnapshot, *, max_bytes: int
) -> None:
    """Restore ``ref`` into the sandbox's session (the digest is checked by the runner)."""
    async with store.get(ref.key, max_bytes=max_bytes) as snapshot:
        await handle.runner.restore(
            snapshot.chunks,
            session_id=handle.session_id or sandbox_session_id(handle.sandbox_id),
            sha256=ref.sha256 or snapshot.info.sha256,
        )
