"""Small objects written and read whole: a turn's result, a saved answer, an input.

A ``SnapshotStore`` streams, which a checkpoint needs; these objects are bytes
already in memory (capped by ``max_bytes``), so their callers want one call each
way rather than a stream to make or drain.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from .base import SnapshotInfo, SnapshotStore

__all__ = ["put_whole", "read_whole"]


async def put_whole(store: SnapshotStore, key: str, data: bytes, *, max_bytes: int) -> SnapshotInfo:
    """Store ``data`` under ``key`` (atomically, as ``SnapshotStore.put``)."""
    return await store.put(key, _one(data), max_bytes=max_bytes)


async def read_whole(store: SnapshotStore, key: str, *, max_bytes: int) -> bytes:
    """The object under ``key``, its size and sha256 checked by the store (the errors of
    ``SnapshotStore.get``: ``SnapshotNotFoundError`` when missing)."""
    async with store.get(key, max_bytes=max_bytes) as snapshot:
        return b"".join([chunk async for chunk in snapshot.chunks])


async def _one(data: bytes) -> AsyncIterator[bytes]:
    yield data
