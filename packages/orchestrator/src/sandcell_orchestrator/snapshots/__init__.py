"""Where checkpoints live between turns: a local directory (embedded) or S3 / MinIO.

    store = open_snapshot_store(url, default_dir=..., s3=settings.s3)
    info = await store.put(key, chunks, max_bytes=cap)          # SnapshotInfo
    entries = await store.list("checkpoints/rt_…/")              # [SnapshotEntry], by key
    async with store.get(key, max_bytes=cap) as snapshot:       # size checked here
        async for chunk in snapshot.chunks:                     # sha256 checked at the end
            ...

Errors (all ``CheckpointError``):

    CheckpointError                 put/get failed, key invalid, over the cap, corrupt body
    ├── SnapshotNotFoundError       no snapshot under that key
    ├── SnapshotTooLargeError       a put's stream passed its max_bytes (nothing stored)
    └── SnapshotUnavailableError    retryable: the store cannot be reached right now
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlsplit

from ..errors import ConfigError
from ..extras import needs_extra
from .base import (
    Snapshot,
    SnapshotEntry,
    SnapshotInfo,
    SnapshotNotFoundError,
    SnapshotStore,
    SnapshotTooLargeError,
    SnapshotUnavailableError,
)
from .directory import DirectorySnapshotStore
from .keys import validate_snapshot_key
from .s3_settings import S3Settings

if TYPE_CHECKING:
    from .s3 import S3SnapshotStore

__all__ = [
    "DirectorySnapshotStore",
    "S3Settings",
    "S3SnapshotStore",
    "Snapshot",
    "SnapshotEntry",
    "SnapshotInfo",
    "SnapshotNotFoundError",
    "SnapshotStore",
    "SnapshotTooLargeError",
    "SnapshotUnavailableError",
    "open_snapshot_store",
    "validate_snapshot_key",
]


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
