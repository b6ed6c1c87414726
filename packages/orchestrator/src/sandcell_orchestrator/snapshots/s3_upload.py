"""The S3 store's upload: a stream of unknown length into one object, in bounded memory.

minio's multipart ``put_object`` reads, in a worker thread, from a bounded channel
the event loop fills (``_StreamBridge``), one part at a time, so memory stays at a
few parts (see ``S3Settings``) whatever the stream's size. The bridge hashes what
it hands over, so the object's size and sha256 are known when the stream ends; a
stream that fails or passes its cap aborts the multipart upload, and nothing is
stored. Publishing the object under its key is ``s3.py``'s.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import AsyncIterable, Callable
from typing import BinaryIO, cast

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from minio import Minio

from ..errors import CheckpointError
from .base import SnapshotInfo, _enforce_cap

__all__ = ["upload_stream"]

# Chunks buffered between the event loop and the upload thread (on top of one part).
_CHANNEL_CHUNKS = 4


async def upload_stream(
    client: Minio,
    bucket: str,
    name: str,
    stream: AsyncIterable[bytes],
    *,
    key: str,
    max_bytes: int,
    part_size_bytes: int,
    translate: Callable[[BaseException], CheckpointError],
) -> SnapshotInfo:
    """Upload ``stream`` as the object ``name``; the ``SnapshotInfo`` of ``key`` it makes.

    ``translate`` maps the upload's own (minio) error; the stream's errors and
    ``SnapshotTooLargeError`` past ``max_bytes`` are raised as they are.
    """
    send, receive = anyio.create_memory_object_stream[bytes](max_buffer_size=_CHANNEL_CHUNKS)
    bridge = _StreamBridge(receive)
    upload = _UploadOutcome()
    feed_error: Exception | None = None
    put = functools.partial(
        client.put_object,
        bucket,
        name,
        cast(BinaryIO, bridge),  # minio only calls read(size)
        length=-1,
        part_size=part_size_bytes,
        # Parallel part uploads would queue parts in memory; one at a time bounds it.
        num_parallel_uploads=1,
    )
    # Neither side raises inside the group (an exception there would come out
    # wrapped in an ExceptionGroup); outcomes are recorded and raised after it.
    async with anyio.create_task_group() as group:
        group.start_soon(_upload, put, bridge, upload)
        fed = False
        try:
            await _feed(stream, send, key=key, max_bytes=max_bytes)
            fed = True
        except anyio.BrokenResourceError:
            pass  # the upload stopped reading; its own error is raised below
        except Exception as exc:
            feed_error = exc
        finally:
            if not fed:
                bridge.abort()
            send.close()
    if feed_error is not None:
        raise feed_error
    if upload.error is not None:
        raise translate(upload.error) from upload.error
    if not upload.done:
        raise CheckpointError(f"snapshot put of {key!r}: the upload ended early")
    return SnapshotInfo(key=key, size=bridge.size, sha256=bridge.sha256)


async def _upload(
    put: Callable[[], object], bridge: _StreamBridge, outcome: _UploadOutcome
) -> None:
    try:
        await anyio.to_thread.run_sync(put)
        outcome.done = True
    except _FeedAborted:
        pass  # the feeding side knows why, and raises that
    except Exception as exc:
        outcome.error = exc
    finally:
        bridge.close()


async def _feed(
    stream: AsyncIterable[bytes],
    send: MemoryObjectSendStream[bytes],
    *,
    key: str,
    max_bytes: int,
) -> None:
    size = 0
    async for chunk in stream:
        if not chunk:
            continue
        size += len(chunk)
        _enforce_cap(size, max_bytes=max_bytes, key=key)
        await send.send(chunk)


class _FeedAborted(Exception):
    """Raised inside minio's read loop so that it aborts the multipart upload."""


class _UploadOutcome:
    def __init__(self) -> None:
        self.done = False
        self.error: Exception | None = None


class _StreamBridge:
    """A blocking, file-like view of the chunks the event loop sends.

    ``read`` runs in minio's upload thread and pulls from the channel through
    ``anyio.from_thread``; ``abort`` and ``close`` run on the event loop. Hashing
    here keeps that CPU work off the loop.
    """

    def __init__(self, receive: MemoryObjectReceiveStream[bytes]) -> None:
        self._receive = receive
        self._pending = memoryview(b"")
        self._aborted = False
        self._digest = hashlib.sha256()
        self.size = 0

    @property
    def sha256(self) -> str:
        return self._digest.hexdigest()

    def abort(self) -> None:
        self._aborted = True

    def close(self) -> None:
        # Wakes a sender blocked on a full channel with BrokenResourceError.
        self._receive.close()

    async def _receive_shielded(self) -> bytes:
        # A cancelled put would otherwise cancel this receive too, and the
        # cancellation (a BaseException) would slip past minio's abort handler.
        # Shielded, it ends the way every failed feed does: abort() and EndOfStream.
        with anyio.CancelScope(shield=True):
            chunk = await self._receive.receive()
        # Returned outside the scope: mypy reads CancelScope.__exit__ as able to swallow.
        return chunk  # noqa: RET504

    def read(self, size: int = -1) -> bytes:
        if size < 0:
            raise ValueError("read() needs a size: the stream has no end to read to")
        pieces: list[memoryview] = []
        wanted = size
        while wanted > 0:
            if self._aborted:
                raise _FeedAborted
            if not self._pending:
                try:
                    chunk = anyio.from_thread.run(self._receive_shielded)
                except anyio.EndOfStream:
                    # An abort closes the channel too; it must not read as a clean end.
                    if self._aborted:
                        raise _FeedAborted from None
                    break
                self._digest.update(chunk)
                self.size += len(chunk)
                self._pending = memoryview(chunk)
            piece = self._pending[:wanted]
            self._pending = self._pending[len(piece) :]
            pieces.append(piece)
            wanted -= len(piece)
        return b"".join(pieces)
