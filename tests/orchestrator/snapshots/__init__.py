"""Snapshot store tests: one contract suite for every backend, plus each backend's own.

Helpers shared by the test modules live here; fixtures live in ``conftest.py``.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import AsyncIterator

from sandcell_orchestrator.snapshots import SnapshotInfo, SnapshotStore
from sandcell_protocol import checkpoint_key, runtime_session_id

MIB = 1 << 20


class StreamBrokeError(Exception):
    """What a producer stream raises half-way in the failure tests."""


def new_key() -> str:
    """A fresh, real checkpoint key."""
    return checkpoint_key(runtime_session_id("tenant", "user", uuid.uuid4().hex), 1)


def payload(size: int, *, seed: int = 0) -> bytes:
    """Deterministic random bytes (incompressible, like a real .tar.gz)."""
    return random.Random(seed).randbytes(size)


async def stream_of(data: bytes, *, chunk_bytes: int = 300_001) -> AsyncIterator[bytes]:
    """``data`` in chunks whose size divides no part size, so parts never align."""
    for start in range(0, len(data), chunk_bytes):
        yield data[start : start + chunk_bytes]


async def failing_stream(data: bytes, *, fail_after: int) -> AsyncIterator[bytes]:
    """Yields about ``fail_after`` bytes of ``data``, then raises ``StreamBrokeError``."""
    async for chunk in stream_of(data[:fail_after]):
        yield chunk
    raise StreamBrokeError("the producer died mid-stream")


async def read_all(store: SnapshotStore, key: str, *, max_bytes: int) -> tuple[SnapshotInfo, bytes]:
    """Get a snapshot whole: its recorded info and its (verified) body."""
    async with store.get(key, max_bytes=max_bytes) as snapshot:
        body = b"".join([chunk async for chunk in snapshot.chunks])
        return snapshot.info, body
