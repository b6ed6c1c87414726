"""DirectorySnapshotStore specifics: on-disk layout, temp files, tampering, symlinks."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import os
import stat
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from sandcell_orchestrator.errors import CheckpointError
from sandcell_orchestrator.snapshots import DirectorySnapshotStore, SnapshotNotFoundError, directory
from sandcell_orchestrator.snapshots.directory import SHA256_XATTR
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


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[DirectorySnapshotStore]:
    async with DirectorySnapshotStore(tmp_path / "snapshots") as backend:
        yield backend


def _all_files(root: Path) -> list[str]:
    return sorted(str(path.relative_to(root)) for path in root.rglob("*") if path.is_file())


async def test_object_is_a_private_file_with_its_sha256_in_an_xattr(
    store: DirectorySnapshotStore,
) -> None:
    """root/key holds the bytes; user.sandcell.sha256 holds the digest."""
    key = new_key()
    data = payload(3 * MIB, seed=1)

    info = await store.put(key, stream_of(data), max_bytes=CAP)

    path = store.root / key
    assert path.read_bytes() == data
    assert os.getxattr(path, SHA256_XATTR).decode() == info.sha256
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


async def test_failed_put_leaves_no_temp_file(store: DirectorySnapshotStore) -> None:
    """A stream that breaks leaves the directory as it was: no object, no temp file."""
    first, second = new_key(), new_key()
    await store.put(first, stream_of(b"previous"), max_bytes=CAP)

    with pytest.raises(StreamBrokeError):
        await store.put(first, failing_stream(payload(4 * MIB), fail_after=3 * MIB), max_bytes=CAP)
    with pytest.raises(StreamBrokeError):
        await store.put(second, failing_stream(payload(4 * MIB), fail_after=3 * MIB), max_bytes=CAP)
    with pytest.raises(CheckpointError, match="cap"):
        await store.put(second, stream_of(payload(2 * MIB)), max_bytes=MIB)

    assert _all_files(store.root) == [first]
    assert (store.root / first).read_bytes() == b"previous"


async def test_cancelled_put_leaves_no_temp_file(store: DirectorySnapshotStore) -> None:
    """Cancellation mid-write still removes the temp file (the cleanup is shielded)."""
    key = new_key()
    written = anyio.Event()

    async def stalling() -> AsyncIterator[bytes]:
        yield payload(2 * MIB)
        written.set()
        await anyio.sleep_forever()

    async with anyio.create_task_group() as group:
        group.start_soon(functools.partial(store.put, key, stalling(), max_bytes=CAP))
        await written.wait()
        await anyio.sleep(0.05)
        group.cancel_scope.cancel()

    assert _all_files(store.root) == []
    assert list(store.root.rglob(".*")) == []


async def test_tampered_file_fails_at_the_end_of_the_stream(
    store: DirectorySnapshotStore,
) -> None:
    """Bytes changed on disk (same size) no longer match the recorded sha256."""
    key = new_key()
    data = payload(2 * MIB, seed=2)
    await store.put(key, stream_of(data), max_bytes=CAP)
    with (store.root / key).open("r+b") as file:
        file.write(b"X")

    with pytest.raises(CheckpointError, match="sha256 does not match"):
        await read_all(store, key, max_bytes=CAP)


async def test_file_without_a_recorded_sha256_is_refused(store: DirectorySnapshotStore) -> None:
    """A file dropped in by hand is not trusted."""
    key = new_key()
    path = store.root / key
    path.parent.mkdir(parents=True)
    path.write_bytes(b"foreign")

    with pytest.raises(CheckpointError, match="no recorded sha256"):
        await read_all(store, key, max_bytes=CAP)


async def test_symlinks_are_not_followed(store: DirectorySnapshotStore, tmp_path: Path) -> None:
    """A symlink planted under a key is neither read nor reported as a snapshot."""
    outside = tmp_path / "outside"
    outside.write_bytes(b"secret host file")
    os.setxattr(outside, SHA256_XATTR, hashlib.sha256(b"secret host file").hexdigest().encode())
    key = new_key()
    link = store.root / key
    link.parent.mkdir(parents=True)
    link.symlink_to(outside)

    assert await store.exists(key) is False
    with pytest.raises(CheckpointError) as caught:
        await read_all(store, key, max_bytes=CAP)
    assert not isinstance(caught.value, SnapshotNotFoundError)
    assert str(tmp_path) not in str(caught.value)


async def test_a_directory_under_a_key_is_not_a_snapshot(store: DirectorySnapshotStore) -> None:
    """exists is False and get refuses when the key names a directory."""
    key = new_key()
    (store.root / key).mkdir(parents=True)

    assert await store.exists(key) is False
    with pytest.raises(CheckpointError, match="not a regular file"):
        await read_all(store, key, max_bytes=CAP)


class _Held:
    """A blocking call held in its thread until ``release``; then the real one."""

    def __init__(self, real: Callable[..., Any]) -> None:
        self._real = real
        self.entered = threading.Event()
        self.release = threading.Event()
        self.running = False
        self.finished = threading.Event()

    def __call__(self, *args: Any) -> Any:
        self.running = True
        self.entered.set()
        self.release.wait(60)
        try:
            return self._real(*args)
        finally:
            self.running = False
            self.finished.set()


async def _cancel_natively_while(held: _Held, put: asyncio.Task[Any]) -> None:
    """``put.cancel()`` (as the checkpoint budget's asyncio.timeout does) while ``held``
    runs in its thread; then let the thread end and wait for both."""
    await asyncio.to_thread(held.entered.wait, 60)
    put.cancel()
    for _ in range(10):  # the cancellation reaches the put, and its cleanup runs
        await asyncio.sleep(0)
    held.release.set()
    await asyncio.to_thread(held.finished.wait, 60)
    with pytest.raises(asyncio.CancelledError):
        await put


async def test_a_put_cancelled_natively_while_its_temp_file_is_made_leaves_none(
    store: DirectorySnapshotStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A native cancellation passes anyio's thread wait: the temp file the thread made
    after it was never removed (a hidden name that nothing lists or collects)."""
    held = _Held(directory._TempWriter.create)
    monkeypatch.setattr(directory._TempWriter, "create", held)
    put = asyncio.create_task(store.put(new_key(), stream_of(b"data"), max_bytes=CAP))
    await _cancel_natively_while(held, put)
    assert [p.name for p in store.root.rglob("*") if p.is_file()] == []


async def test_a_put_cancelled_natively_while_it_writes_closes_its_file_after_the_write(
    store: DirectorySnapshotStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cancelled put's discard closed the file while the write still ran in its
    thread (a descriptor closed under it, whose number the next open may get)."""
    held = _Held(directory._TempWriter.write)

    def write(writer: Any, chunks: list[bytes]) -> None:
        held(writer, chunks)

    monkeypatch.setattr(directory._TempWriter, "write", write)
    closed_under_a_write: list[bool] = []
    real_discard = directory._TempWriter.discard

    def discard(writer: Any) -> None:
        closed_under_a_write.append(held.running)
        real_discard(writer)

    monkeypatch.setattr(directory._TempWriter, "discard", discard)
    put = asyncio.create_task(store.put(new_key(), stream_of(payload(MIB)), max_bytes=CAP))
    await _cancel_natively_while(held, put)
    assert closed_under_a_write == [False]
    assert [p.name for p in store.root.rglob("*") if p.is_file()] == []
