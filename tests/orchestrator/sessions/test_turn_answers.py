"""A committed keyed turn's answer kept by key in the snapshot store (``answer-<key>``):
found by its session and key only, never taken for a checkpoint, collected like a
superseded checkpoint once past the grace period, and deleted with the session.
Real stores: the directory store and moto's S3."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator

from sandcell_orchestrator.sessions.persistence import Persistence, answer_key
from sandcell_orchestrator.snapshots import SnapshotStore
from sandcell_protocol import checkpoint_key, runtime_session_id

SESSION = runtime_session_id("tenant-a", "u", "answers")
OTHER = runtime_session_id("tenant-b", "u", "answers")
TURN = hashlib.sha256(b"v1/exec\0tenant-a\0k").hexdigest()


async def _put(persistence: Persistence, key: str, body: bytes) -> None:
    async def one() -> AsyncIterator[bytes]:
        yield body

    await persistence.store.put(key, one(), max_bytes=1 << 20)


async def test_an_answer_is_found_by_session_and_key_only(store: SnapshotStore) -> None:
    persistence = Persistence(store)
    await persistence.save_answer(SESSION, turn_key=TURN, body=b'{"stdout":"1"}')
    assert await persistence.answer(SESSION, TURN) == b'{"stdout":"1"}'
    assert await persistence.answer(OTHER, TURN) is None
    assert await persistence.answer(SESSION, "0" * 64) is None
    assert answer_key(SESSION, TURN).startswith(f"checkpoints/{SESSION}/")


async def test_an_answer_is_no_checkpoint_and_is_collected_past_the_grace(
    store: SnapshotStore,
) -> None:
    """Listed (so that collection sees it) but never restorable: ``latest`` is the one
    checkpoint. Kept within the grace period, gone after it; the checkpoint the record
    points at stays."""
    now = [0.0]
    persistence = Persistence(store, grace_s=60, wall_clock=lambda: now[0])
    checkpoint = checkpoint_key(SESSION, 3)
    await _put(persistence, checkpoint, b"archive")
    await persistence.save_answer(SESSION, turn_key=TURN, body=b"result")
    stored = await persistence.stored(SESSION)
    assert [item.restorable for item in stored].count(False) == 1
    latest = Persistence.latest(stored)
    assert latest is not None
    assert latest.key == checkpoint
    written = max(item.modified_at_s for item in stored)
    now[0] = written + 30
    assert await persistence.collect(SESSION, stored, keep=checkpoint, below_generation=4) == 0
    assert await persistence.answer(SESSION, TURN) == b"result"
    now[0] = written + 61
    assert await persistence.collect(SESSION, stored, keep=checkpoint, below_generation=4) == 1
    assert await persistence.answer(SESSION, TURN) is None
    assert [item.key for item in await persistence.stored(SESSION)] == [checkpoint]


async def test_answers_go_with_the_session(store: SnapshotStore) -> None:
    persistence = Persistence(store)
    await persistence.save_answer(SESSION, turn_key=TURN, body=b"result")
    await persistence.save_answer(OTHER, turn_key=TURN, body=b"theirs")
    await persistence.delete_all(SESSION)
    assert await persistence.answer(SESSION, TURN) is None
    assert await persistence.answer(OTHER, TURN) == b"theirs"
