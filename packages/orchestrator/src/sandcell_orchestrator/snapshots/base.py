"""What every snapshot store shares: the ``SnapshotStore`` protocol, its value types
and errors, and the checks and verified reader the backends use."""

from __future__ import annotations

import hashlib
import re
from collections.abc import AsyncIterable, AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol, Self

import anyio

from ..errors import CheckpointError
from ..to_the_end import to_the_end
from .keys import validate_snapshot_key

__all__ = [
    "Snapshot",
    "SnapshotEntry",
    "SnapshotInfo",
    "SnapshotNotFoundError",
    "SnapshotStore",
    "SnapshotTooLargeError",
    "SnapshotUnavailableError",
]

_READ_CHUNK_BYTES = 1 << 20

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


class SnapshotNotFoundError(CheckpointError):
    """No snapshot is stored under the key."""


class SnapshotTooLargeError(CheckpointError):
    """A put's stream passed its ``max_bytes``: nothing was stored (what is too big is
    the caller's, e.g. a workspace, not a fault of the store)."""


class SnapshotUnavailableError(CheckpointError):
    """The store could not be reached or answered with a transient failure; retry later."""

    retryable = True


@dataclass(frozen=True, slots=True)
class SnapshotInfo:
    """What a store recorded about one object: its key, byte size and hex sha256."""

    key: str
    size: int
    sha256: str


@dataclass(frozen=True, slots=True)
class SnapshotEntry:
    """One object as a listing shows it: key, byte size, and when it was written.

    ``modified_at_s`` is wall-clock epoch seconds (the store's clock): collection
    windows are measured against it, and two hosts' monotonic clocks mean nothing
    to each other.
    """

    key: str
    size: int
    modified_at_s: float


@dataclass(frozen=True, slots=True)
class Snapshot:
    """An open snapshot: the recorded info, and the body as it streams.

    ``chunks`` raises ``CheckpointError`` at its end when the body's size or
    sha256 differs from ``info``; a consumer must not trust the bytes before that.
    """

    info: SnapshotInfo
    chunks: AsyncIterator[bytes]


class SnapshotStore(Protocol):
    """Stores checkpoint archives by key. Every method is safe to call from async code."""

    async def put(self, key: str, stream: AsyncIterable[bytes], *, max_bytes: int) -> SnapshotInfo:
        """Consume ``stream`` and store it under ``key``, replacing any previous object.

        The replacement is atomic: when the stream fails or passes ``max_bytes``
        (``CheckpointError``), the previous object stays as it was. An exception
        raised by ``stream`` itself propagates unchanged.
        """
        ...

    def get(self, key: str, *, max_bytes: int) -> AbstractAsyncContextManager[Snapshot]:
        """Open the snapshot under ``key``; entering checks its size before any body is read.

        Raises ``SnapshotNotFoundError`` when missing and ``CheckpointError`` when the
        recorded size passes ``max_bytes``.
        """
        ...

    async def delete(self, key: str) -> None:
        """Remove the snapshot under ``key``; a missing one is not an error."""
        ...

    async def exists(self, key: str) -> bool:
        """Whether a snapshot is stored under ``key``."""
        ...

    async def list(
        self, prefix: str, *, start_after: str | None = None, limit: int | None = None
    ) -> list[SnapshotEntry]:
        """The objects whose key starts with ``prefix`` (a string prefix, as S3 reads it),
        sorted by key. ``prefix`` must be a key or a key followed by ``/``.

        ``start_after`` (a key under ``prefix``) lists only keys after it, and ``limit``
        at most that many: one page, for a caller that must not read a whole prefix a
        time (S3 reads a page of up to 1,000 keys a request).
        """
        ...

    async def close(self) -> None:
        """Release connections; idempotent. The store is unusable afterwards."""
        ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


def _validate_max_bytes(max_bytes: int) -> int:
    """A cap is a non-negative int; anything else is a programming error."""
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
        raise ValueError("max_bytes must be a non-negative int")
    return max_bytes


def _validate_prefix(prefix: str) -> str:
    """A listing prefix is a valid key, optionally ending in ``/``."""
    if not isinstance(prefix, str) or not prefix.rstrip("/"):
        raise CheckpointError("snapshot prefix: must name at least one key component")
    validate_snapshot_key(prefix[:-1] if prefix.endswith("/") else prefix)
    return prefix


def _validate_page(prefix: str, start_after: str | None, limit: int | None) -> None:
    """A page's marker is a key under its prefix; its limit a positive int."""
    if start_after is not None and not start_after.startswith(prefix):
        raise CheckpointError("snapshot listing: start_after must start with the prefix")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError("limit must be a positive int")


def _enforce_cap(size: int, *, max_bytes: int, key: str) -> None:
    if size > max_bytes:
        raise SnapshotTooLargeError(
            f"snapshot put of {key!r}: stream passed its cap of {max_bytes} bytes"
        )


def _is_sha256_hex(value: str | None) -> bool:
    """True for 64 lowercase hex digits."""
    return value is not None and bool(_SHA256_HEX.fullmatch(value))


class _VerifiedChunks:
    """Async iterator over a blocking ``read(n)``, checking size and sha256 at the end.

    ``read`` runs in a worker thread and must raise ``CheckpointError`` itself; it
    returns ``b""`` at the end of the body.
    """

    def __init__(
        self,
        read: Callable[[int], bytes],
        *,
        info: SnapshotInfo,
        chunk_bytes: int = _READ_CHUNK_BYTES,
    ) -> None:
        self._read = read
        self._info = info
        self._chunk_bytes = chunk_bytes
        self._digest = hashlib.sha256()
        self._seen = 0
        self._done = False

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> bytes:
        if self._done:
            raise StopAsyncIteration
        # To its end: a native cancellation passes anyio's thread wait, and the
        # consumer's exit then closed the file (the response) under the read.
        chunk = await to_the_end(anyio.to_thread.run_sync(self._read_and_hash))
        if not chunk:
            self._done = True
            self._verify_end()
            raise StopAsyncIteration
        self._seen += len(chunk)
        if self._seen > self._info.size:
            self._done = True
            raise CheckpointError(
                f"snapshot {self._info.key!r}: body is longer than its recorded "
                f"{self._info.size} bytes"
            )
        return chunk

    def _read_and_hash(self) -> bytes:
        # Hashing here keeps the CPU work off the event loop (hashlib drops the GIL).
        chunk = self._read(self._chunk_bytes)
        self._digest.update(chunk)
        return chunk

    def _verify_end(self) -> None:
        if self._seen != self._info.size:
            raise CheckpointError(
                f"snapshot {self._info.key!r}: body has {self._seen} bytes, "
                f"recorded {self._info.size}"
            )
        if self._digest.hexdigest() != self._info.sha256:
            raise CheckpointError(f"snapshot {self._info.key!r}: sha256 does not match")
