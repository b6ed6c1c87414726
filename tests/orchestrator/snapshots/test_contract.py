"""The SnapshotStore contract, run against every backend (the ``store`` fixture)."""

from __future__ import annotations

import functools
import hashlib
import time
import uuid
from collections.abc import AsyncIterator, Callable

import anyio
import pytest

from sandcell_orchestrator.errors import CheckpointError
from sandcell_orchestrator.snapshots import (
    SnapshotInfo,
    SnapshotNotFoundError,
    SnapshotStore,
    SnapshotTooLargeError,
    validate_snapshot_key,
)
from sandcell_protocol import (
    checkpoint_key,
    checkpoint_prefix,
    legacy_checkpoint_key,
    runtime_session_id,
)
from tests.orchestrator.snapshots import (
    MIB,
    StreamBrokeError,
    failing_stream,
    new_key,
    payload,
    read_all,
    stream_of,
)

CAP = 64 * MIB


async def test_round_trip_of_a_multi_part_stream(store: SnapshotStore) -> None:
    """12 MiB in unaligned chunks comes back byte for byte, with its size and sha256."""
    key = new_key()
    data = payload(12 * MIB, seed=1)

    info = await store.put(key, stream_of(data), max_bytes=CAP)

    expected = SnapshotInfo(key=key, size=len(data), sha256=hashlib.sha256(data).hexdigest())
    assert info == expected
    got_info, body = await read_all(store, key, max_bytes=CAP)
    assert got_info == expected
    assert body == data


async def test_put_replaces_the_previous_object(store: SnapshotStore) -> None:
    """A second put under a key wins."""
    key = new_key()
    await store.put(key, stream_of(payload(MIB, seed=1)), max_bytes=CAP)
    second = payload(3 * MIB, seed=2)

    await store.put(key, stream_of(second), max_bytes=CAP)

    assert (await read_all(store, key, max_bytes=CAP))[1] == second


async def test_empty_stream_is_an_empty_object(store: SnapshotStore) -> None:
    """Zero bytes is a valid snapshot, with the sha256 of nothing."""
    key = new_key()

    info = await store.put(key, stream_of(b""), max_bytes=CAP)

    assert info.size == 0
    assert info.sha256 == hashlib.sha256(b"").hexdigest()
    assert await read_all(store, key, max_bytes=0) == (info, b"")


async def test_a_stream_exactly_at_the_cap_is_stored(store: SnapshotStore) -> None:
    """The cap is inclusive."""
    key = new_key()
    data = payload(MIB + 7, seed=3)

    info = await store.put(key, stream_of(data), max_bytes=len(data))

    assert info.size == len(data)
    assert (await read_all(store, key, max_bytes=len(data)))[1] == data


async def test_get_of_a_missing_key_is_not_found(store: SnapshotStore) -> None:
    """A missing snapshot is SnapshotNotFoundError, a CheckpointError that is not retryable."""
    with pytest.raises(SnapshotNotFoundError) as caught:
        async with store.get(new_key(), max_bytes=CAP):
            pytest.fail("entered a missing snapshot")
    assert isinstance(caught.value, CheckpointError)
    assert caught.value.retryable is False


async def test_over_cap_put_fails_and_keeps_the_previous_object(
    store: SnapshotStore, leftovers: Callable[[], list[str]]
) -> None:
    """Passing max_bytes mid-stream stores nothing (``SnapshotTooLargeError``, which
    callers tell from a failing store); the old object stays readable."""
    key = new_key()
    previous = payload(MIB, seed=4)
    await store.put(key, stream_of(previous), max_bytes=CAP)

    fresh = new_key()

    with pytest.raises(SnapshotTooLargeError, match="cap"):
        await store.put(key, stream_of(payload(12 * MIB, seed=5)), max_bytes=8 * MIB)
    with pytest.raises(SnapshotTooLargeError, match="cap"):
        await store.put(fresh, stream_of(payload(12 * MIB, seed=5)), max_bytes=8 * MIB)

    assert (await read_all(store, key, max_bytes=CAP))[1] == previous
    assert await store.exists(fresh) is False
    assert leftovers() == []


async def test_over_cap_get_fails_before_any_body_is_read(store: SnapshotStore) -> None:
    """The size is checked on entering; the body is never yielded."""
    key = new_key()
    await store.put(key, stream_of(payload(2 * MIB, seed=6)), max_bytes=CAP)
    bytes_read = 0

    async def download() -> None:
        nonlocal bytes_read
        async with store.get(key, max_bytes=2 * MIB - 1) as snapshot:
            async for chunk in snapshot.chunks:
                bytes_read += len(chunk)

    with pytest.raises(CheckpointError, match="over the cap"):
        await download()

    assert bytes_read == 0


async def test_stream_failing_mid_way_keeps_the_previous_object(
    store: SnapshotStore, leftovers: Callable[[], list[str]]
) -> None:
    """The producer's own error propagates unchanged, after parts were already sent."""
    key = new_key()
    previous = payload(MIB, seed=7)
    await store.put(key, stream_of(previous), max_bytes=CAP)

    with pytest.raises(StreamBrokeError):
        await store.put(key, failing_stream(payload(12 * MIB), fail_after=11 * MIB), max_bytes=CAP)

    assert (await read_all(store, key, max_bytes=CAP))[1] == previous
    assert leftovers() == []


async def test_cancelled_put_keeps_the_previous_object(
    store: SnapshotStore, leftovers: Callable[[], list[str]]
) -> None:
    """Cancelling a put half-way (its producer stalled) stores nothing and cleans up."""
    key = new_key()
    previous = payload(MIB, seed=8)
    await store.put(key, stream_of(previous), max_bytes=CAP)
    sent = anyio.Event()

    async def stalling() -> AsyncIterator[bytes]:
        async for chunk in stream_of(payload(7 * MIB, seed=9)):
            yield chunk
        sent.set()
        await anyio.sleep_forever()

    async with anyio.create_task_group() as group:
        group.start_soon(functools.partial(store.put, key, stalling(), max_bytes=CAP))
        await sent.wait()
        await anyio.sleep(0.2)  # let the first part reach the store
        group.cancel_scope.cancel()

    assert (await read_all(store, key, max_bytes=CAP))[1] == previous
    assert leftovers() == []


async def test_delete_is_idempotent_and_exists_follows(store: SnapshotStore) -> None:
    """exists tracks put and delete; deleting twice (or never-stored keys) is fine."""
    key = new_key()
    assert await store.exists(key) is False
    await store.put(key, stream_of(b"state"), max_bytes=CAP)
    assert await store.exists(key) is True

    await store.delete(key)
    await store.delete(key)
    await store.delete(new_key())

    assert await store.exists(key) is False
    with pytest.raises(SnapshotNotFoundError):
        async with store.get(key, max_bytes=CAP):
            pass


async def test_a_consumer_may_stop_reading_early(store: SnapshotStore) -> None:
    """Leaving the context after one chunk releases the body without error or warning."""
    key = new_key()
    await store.put(key, stream_of(payload(4 * MIB, seed=10)), max_bytes=CAP)

    async with store.get(key, max_bytes=CAP) as snapshot:
        first = await snapshot.chunks.__anext__()

    assert first
    assert (await read_all(store, key, max_bytes=CAP))[0].size == 4 * MIB


INVALID_KEYS = [
    "",
    "/checkpoints/x.tar.gz",
    "../x",
    "checkpoints/../../etc/passwd",
    "checkpoints//x",
    "checkpoints/./x",
    "checkpoints/",
    ".hidden",
    "checkpoints/.staging",
    "nul\x00byte",
    "back\\slash",
    "white space",
    "ünïcode",
    "a" * 1025,
]


@pytest.mark.parametrize("key", INVALID_KEYS, ids=repr)
async def test_invalid_keys_are_rejected_by_every_method(store: SnapshotStore, key: str) -> None:
    """A bad key is a CheckpointError before any filesystem or URL is touched."""
    with pytest.raises(CheckpointError, match="snapshot key"):
        await store.put(key, stream_of(b"x"), max_bytes=CAP)
    with pytest.raises(CheckpointError, match="snapshot key"):
        async with store.get(key, max_bytes=CAP):
            pass
    with pytest.raises(CheckpointError, match="snapshot key"):
        await store.exists(key)
    with pytest.raises(CheckpointError, match="snapshot key"):
        await store.delete(key)


async def test_list_shows_the_objects_under_a_prefix_by_key(store: SnapshotStore) -> None:
    """A string prefix, as S3 reads it: a session's generations and its old key, sorted,
    with sizes and write times; another session's objects do not show."""
    session = runtime_session_id("tenant", "user", uuid.uuid4().hex)
    other = runtime_session_id("tenant", "user", uuid.uuid4().hex)
    keys = [checkpoint_key(session, g) for g in (10, 2, 1)] + [legacy_checkpoint_key(session)]
    before_s = time.time() - 5
    for index, key in enumerate(keys):
        await store.put(key, stream_of(b"x" * (index + 1)), max_bytes=CAP)
    await store.put(checkpoint_key(other, 1), stream_of(b"y"), max_bytes=CAP)

    under = await store.list(checkpoint_prefix(session))
    assert [entry.key for entry in under] == sorted(keys[:3])
    assert {entry.key: entry.size for entry in under} == {keys[0]: 1, keys[1]: 2, keys[2]: 3}
    assert all(before_s <= entry.modified_at_s <= time.time() + 5 for entry in under)
    both = await store.list(checkpoint_prefix(session).rstrip("/"))
    assert [entry.key for entry in both] == sorted(keys)
    assert await store.list(f"checkpoints/{runtime_session_id('t', 'u', 'none')}/") == []


async def test_list_never_shows_a_deleted_or_half_written_object(store: SnapshotStore) -> None:
    """What ``delete`` removed is gone from listings; a failed put leaves nothing listed."""
    session = runtime_session_id("tenant", "user", uuid.uuid4().hex)
    kept, dropped, broken = (checkpoint_key(session, g) for g in (1, 2, 3))
    await store.put(kept, stream_of(b"kept"), max_bytes=CAP)
    await store.put(dropped, stream_of(b"dropped"), max_bytes=CAP)
    await store.delete(dropped)
    with pytest.raises(StreamBrokeError):
        await store.put(broken, failing_stream(payload(2 * MIB), fail_after=MIB), max_bytes=CAP)
    assert [entry.key for entry in await store.list(checkpoint_prefix(session))] == [kept]


async def test_list_reads_one_page_after_a_marker(store: SnapshotStore) -> None:
    """``start_after`` and ``limit`` cut a page out of the listing, by key: the keys after
    the marker (which need not exist), at most ``limit`` of them; paging by the last key
    seen reads every key once."""
    session = runtime_session_id("tenant", "user", uuid.uuid4().hex)
    keys = [checkpoint_key(session, g) for g in range(1, 8)]
    for key in keys:
        await store.put(key, stream_of(b"x"), max_bytes=CAP)
    prefix = checkpoint_prefix(session)

    first = await store.list(prefix, limit=3)
    assert [entry.key for entry in first] == keys[:3]
    after = await store.list(prefix, start_after=keys[3], limit=2)
    assert [entry.key for entry in after] == keys[4:6]
    assert [e.key for e in await store.list(prefix, start_after=keys[5])] == keys[6:]
    assert [e.key for e in await store.list(prefix, start_after=prefix + "0")] == keys
    assert await store.list(prefix, start_after=keys[-1], limit=5) == []
    seen: list[str] = []
    marker: str | None = None
    while page := await store.list(prefix, start_after=marker, limit=3):
        seen += [entry.key for entry in page]
        marker = page[-1].key
    assert seen == keys


async def test_list_refuses_a_marker_outside_the_prefix_and_a_bad_limit(
    store: SnapshotStore,
) -> None:
    prefix = checkpoint_prefix(runtime_session_id("tenant", "user", uuid.uuid4().hex))
    with pytest.raises(CheckpointError, match="start_after"):
        await store.list(prefix, start_after="checkpoints/")
    for limit in (0, -1, True):
        with pytest.raises(ValueError, match="limit"):
            await store.list(prefix, limit=limit)


@pytest.mark.parametrize("prefix", ["", "/", "../x", "a//b", ".staging/", "/abs"])
async def test_list_refuses_a_bad_prefix(store: SnapshotStore, prefix: str) -> None:
    with pytest.raises(CheckpointError, match="snapshot"):
        await store.list(prefix)


def test_protocol_checkpoint_keys_are_valid_snapshot_keys() -> None:
    """What sandcell_protocol.checkpoint_key derives, the stores accept."""
    key = new_key()
    assert validate_snapshot_key(key) == key


async def test_a_closed_store_refuses_work_and_closes_twice(store: SnapshotStore) -> None:
    """close is idempotent; afterwards every call is a CheckpointError."""
    await store.close()
    await store.close()

    with pytest.raises(CheckpointError, match="closed"):
        await store.put(new_key(), stream_of(b"x"), max_bytes=CAP)
    with pytest.raises(CheckpointError, match="closed"):
        await store.exists(new_key())
