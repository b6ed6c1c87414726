"""Where checkpoints live between turns: a local directory (embedded) or S3 / MinIO.

    store = open_snapshot_store(url, default_dir=..., s3=settings.s3)
    info = await store.put(key, chunks, max_bytes=cap)          # SnapshotInfo
    async with store.get(key, max_bytes=cap) as snapshot:       # size checked here
        async for chunk in snapshot.chunks:                     # sha256 checked at the end
            ...

Errors (all ``CheckpointError``):

    CheckpointError                 put/get failed, key invalid, over the cap, corrupt body
    ├── SnapshotNotFoundError       no snapshot under that key
    └── SnapshotUnavailableError    retryable: the store cannot be reached right now
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import AsyncIterable, AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Protocol, Self
from urllib.parse import unquote, urlsplit

import anyio

from ..errors import CheckpointError, ConfigError
from ..extras import needs_extra
from .keys import validate_snapshot_key
from .s3_settings import S3Settings

if TYPE_CHECKING:
    from .s3 import S3SnapshotStore

__all__ = [
    "DirectorySnapshotStore",
    "S3Settings",
    "S3SnapshotStore",
    "Snapshot",
    "SnapshotInfo",
    "SnapshotNotFoundError",
    "SnapshotStore",
    "SnapshotUnavailableError",
    "open_snapshot_store",
    "validate_snapshot_key",
]

_READ_CHUNK_BYTES = 1 << 20

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


class SnapshotNotFoundError(CheckpointError):
    """No snapshot is stored under the key."""


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


def _enforce_cap(size: int, *, max_bytes: int, key: str) -> None:
    if size > max_bytes:
        raise CheckpointError(
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
        chunk = await anyio.to_thread.run_sync(self._read_and_hash)
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


def open_snapshot_store(
    url: str | None,
    *,
    default_dir: Path,
    s3: S3Settings | None = None,
    env: Mapping[str, str] | None = None,
) -> SnapshotStore:
    """Build the store a URL names; nothing is contacted until the first call.

    ``None`` or ``""`` is a directory store at ``default_dir``; ``file:///abs/path``
    a directory store there; ``s3://bucket/prefix`` an S3 store with ``s3`` (the
    settings read at start-up) or else configured from ``env`` (see
    ``S3Settings.from_env``). Anything else is a ``ConfigError``. The S3 store
    (and minio) is imported only here, when chosen.
    """
    if not url:
        return DirectorySnapshotStore(default_dir)
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "file":
        return DirectorySnapshotStore(_file_url_path(url))
    if scheme == "s3":
        settings = s3 if s3 is not None else S3Settings.from_env(env or {}, url)
        with needs_extra("s3", "an s3:// SANDCELL_SNAPSHOT_URL"):
            from .s3 import S3SnapshotStore

        return S3SnapshotStore(settings)
    raise ConfigError("snapshot store URL: must be file:///absolute/path or s3://bucket/prefix")


def _file_url_path(url: str) -> Path:
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
        raise ConfigError("snapshot store URL: a file URL must look like file:///absolute/path")
    path = unquote(parts.path)
    if not path.startswith("/") or "\x00" in path:
        raise ConfigError("snapshot store URL: a file URL needs an absolute path")
    return Path(path)


def __getattr__(name: str) -> object:
    # The S3 backend loads on first use: the embedded default must not import minio.
    if name == "S3SnapshotStore":
        from .s3 import S3SnapshotStore

        return S3SnapshotStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# The directory backend imports the shared types above from this package, so it loads last.
from .directory import DirectorySnapshotStore  # noqa: E402
