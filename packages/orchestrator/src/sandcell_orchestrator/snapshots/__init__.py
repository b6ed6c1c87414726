"""Where checkpoints live between turns: a local directory (embedded) or S3 / MinIO.

    store = open_snapshot_store(url, default_dir=..., env=os.environ)
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
import ipaddress
import re
from collections.abc import AsyncIterable, AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Protocol, Self
from urllib.parse import SplitResult, unquote, urlsplit

import anyio

from ..errors import CheckpointError, ConfigError

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

# One component of a key: no leading dot, so ``.``/``..`` and the stores' own
# hidden temp and staging names can never be addressed as a key.
_KEY_COMPONENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,254}")
_MAX_KEY_CHARS = 1024
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


_MIB = 1 << 20
_MIN_PART_BYTES = 5 * _MIB
_MAX_PART_BYTES = 5 * 1024 * _MIB
_MINIO_PORT = 9000
_AWS_ENDPOINT = "https://s3.amazonaws.com"
_ENDPOINT_VARS = ("SANDCELL_S3_ENDPOINT", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
_REGION_VARS = ("SANDCELL_S3_REGION", "AWS_REGION", "AWS_DEFAULT_REGION")
# Pairs, taken together: a key from one source never meets a secret from another.
_CREDENTIAL_VARS = (
    ("SANDCELL_S3_ACCESS_KEY", "SANDCELL_S3_SECRET_KEY"),
    ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"),
    ("MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD"),
)
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_REGION = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9])?")
_HOST = re.compile(r"[a-z0-9](?:[a-z0-9.-]*[a-z0-9])?")


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


def validate_snapshot_key(key: str) -> str:
    """Return ``key`` if it is a safe relative object key, else raise ``CheckpointError``.

    A key is ``/``-separated components of ``[A-Za-z0-9._-]`` that do not start
    with a dot (so no ``..``, no absolute path, no empty component, no NUL).
    """
    if not isinstance(key, str) or not key:
        raise CheckpointError("snapshot key: must be a non-empty string")
    if len(key) > _MAX_KEY_CHARS:
        raise CheckpointError(f"snapshot key: longer than {_MAX_KEY_CHARS} characters")
    if not all(_KEY_COMPONENT.fullmatch(part) for part in key.split("/")):
        raise CheckpointError(
            f"snapshot key {key[:80]!r}: components must match [A-Za-z0-9_][A-Za-z0-9._-]*"
        )
    return key


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


@dataclass(frozen=True, slots=True)
class S3Settings:
    """Where the bucket is and how to reach it; ``from_env`` builds it from the environment.

    ``endpoint`` is ``http(s)://host[:port]`` (the scheme decides ``secure``; no port
    means the scheme's) or a bare ``host[:port]`` (``secure`` as given; no port means
    MinIO's 9000). Construction normalizes it to ``host:port``. ``secret_key`` never
    appears in a repr, a log line or an error message. A put holds about three
    ``part_size_bytes`` in memory (minio copies a part while assembling it).
    """

    endpoint: str
    bucket: str
    prefix: str = ""
    access_key: str | None = None
    secret_key: str | None = field(default=None, repr=False)
    region: str = "us-east-1"
    secure: bool = True
    part_size_bytes: int = 5 * _MIB
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        endpoint, secure = _parse_endpoint(self.endpoint, secure=self.secure, name="endpoint")
        object.__setattr__(self, "endpoint", endpoint)
        object.__setattr__(self, "secure", secure)
        object.__setattr__(self, "prefix", _parse_prefix(self.prefix, name="prefix"))
        if not _BUCKET.fullmatch(self.bucket):
            raise ConfigError("bucket: must be an S3 bucket name (3-63 of a-z, 0-9, '.', '-')")
        if not _REGION.fullmatch(self.region):
            raise ConfigError("region: must be a region name like us-east-1")
        if (self.access_key is None) != (self.secret_key is None):
            raise ConfigError("access_key, secret_key: set both or neither")
        if not _MIN_PART_BYTES <= self.part_size_bytes <= _MAX_PART_BYTES:
            raise ConfigError("part_size_bytes: must be between 5 MiB and 5 GiB")
        if not (self.connect_timeout_s > 0 and self.read_timeout_s > 0):
            raise ConfigError("connect_timeout_s, read_timeout_s: must be positive")

    @property
    def url(self) -> str:
        """The endpoint as a URL, for messages."""
        return f"{'https' if self.secure else 'http'}://{self.endpoint}"

    @classmethod
    def from_env(cls, env: Mapping[str, str], url: str) -> S3Settings:
        """Settings for ``url`` (``s3://bucket/prefix``) from ``env``.

        Reads ``SANDCELL_S3_ENDPOINT`` (else ``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``,
        else AWS itself), the key pair ``SANDCELL_S3_ACCESS_KEY`` / ``SANDCELL_S3_SECRET_KEY``
        (else ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``, else ``MINIO_ROOT_USER`` /
        ``MINIO_ROOT_PASSWORD``) and ``SANDCELL_S3_REGION`` (else ``AWS_REGION``,
        ``AWS_DEFAULT_REGION``, else us-east-1). A bad value raises ``ConfigError``
        naming its variable; a secret's value is never echoed.
        """
        bucket, prefix = _parse_s3_url(url)
        endpoint_var, raw_endpoint = _first_set(env, *_ENDPOINT_VARS)
        endpoint, secure = _parse_endpoint(
            raw_endpoint or _AWS_ENDPOINT, secure=True, name=endpoint_var
        )
        region_var, region = _first_set(env, *_REGION_VARS)
        if region is not None and not _REGION.fullmatch(region):
            raise ConfigError(f"{region_var}: must be a region name like us-east-1")
        access_key, secret_key = _credentials(env)
        return cls(
            endpoint=endpoint,
            bucket=bucket,
            prefix=prefix,
            access_key=access_key,
            secret_key=secret_key,
            region=region or "us-east-1",
            secure=secure,
        )


def _parse_endpoint(value: str, *, secure: bool, name: str) -> tuple[str, bool]:
    text = value.strip()
    if not text:
        raise ConfigError(f"{name}: must not be empty")
    if "://" in text:
        parts = urlsplit(text)
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https"):
            raise ConfigError(f"{name}: the scheme must be http or https")
        secure = scheme == "https"
        default_port = 443 if secure else 80
    else:
        # "//" makes urlsplit read a bare "host:port" as a netloc, not as "scheme:path".
        parts = urlsplit("//" + text)
        default_port = _MINIO_PORT
    return _netloc(parts, default_port=default_port, name=name), secure


def _netloc(parts: SplitResult, *, default_port: int, name: str) -> str:
    if "@" in parts.netloc:
        raise ConfigError(f"{name}: must not carry credentials")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ConfigError(f"{name}: must be scheme://host[:port] or host[:port], with no path")
    try:
        port = parts.port
    except ValueError:
        raise ConfigError(f"{name}: the port must be a number from 1 to 65535") from None
    host = parts.hostname or ""
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ConfigError(f"{name}: invalid IPv6 address") from None
        host = f"[{host}]"
    elif not _HOST.fullmatch(host):
        raise ConfigError(f"{name}: invalid host name")
    if port == 0:
        raise ConfigError(f"{name}: the port must be a number from 1 to 65535")
    return f"{host}:{port or default_port}"


def _parse_s3_url(url: str) -> tuple[str, str]:
    parts = urlsplit(url.strip())
    if parts.scheme.lower() != "s3" or parts.query or parts.fragment:
        raise ConfigError("snapshot store URL: must be s3://bucket/prefix")
    if not _BUCKET.fullmatch(parts.netloc):
        raise ConfigError("snapshot store URL: the bucket must be an S3 bucket name")
    return parts.netloc, _parse_prefix(parts.path, name="snapshot store URL")


def _parse_prefix(value: str, *, name: str) -> str:
    prefix = value.strip("/")
    if prefix and not all(_KEY_COMPONENT.fullmatch(part) for part in prefix.split("/")):
        raise ConfigError(f"{name}: prefix components must match [A-Za-z0-9_][A-Za-z0-9._-]*")
    return prefix


def _first_set(env: Mapping[str, str], *names: str) -> tuple[str, str | None]:
    for name in names:
        value = env.get(name, "").strip()
        if value:
            return name, value
    return names[0], None


def _credentials(env: Mapping[str, str]) -> tuple[str, str]:
    for access_var, secret_var in _CREDENTIAL_VARS:
        access = env.get(access_var, "").strip()
        secret = env.get(secret_var, "").strip()
        if not access and not secret:
            continue
        if not access:
            raise ConfigError(f"{access_var}: not set, but {secret_var} is")
        if not secret:
            raise ConfigError(f"{secret_var}: not set, but {access_var} is")
        for var, value in ((access_var, access), (secret_var, secret)):
            if not value.isprintable() or any(c.isspace() for c in value):
                raise ConfigError(f"{var}: must not contain whitespace or control characters")
        return access, secret
    names = ", ".join(access for access, _ in _CREDENTIAL_VARS[1:])
    raise ConfigError(f"{_CREDENTIAL_VARS[0][0]}: not set (nor {names})")


def open_snapshot_store(
    url: str | None,
    *,
    default_dir: Path,
    env: Mapping[str, str] | None = None,
) -> SnapshotStore:
    """Build the store a URL names; nothing is contacted until the first call.

    ``None`` or ``""`` is a directory store at ``default_dir``; ``file:///abs/path``
    a directory store there; ``s3://bucket/prefix`` an S3 store configured from
    ``env`` (see ``S3Settings.from_env``). Anything else is a ``ConfigError``.
    """
    if not url:
        return DirectorySnapshotStore(default_dir)
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "file":
        return DirectorySnapshotStore(_file_url_path(url))
    if scheme == "s3":
        return S3SnapshotStore(S3Settings.from_env(env or {}, url))
    raise ConfigError("snapshot store URL: must be file:///absolute/path or s3://bucket/prefix")


def _file_url_path(url: str) -> Path:
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
        raise ConfigError("snapshot store URL: a file URL must look like file:///absolute/path")
    path = unquote(parts.path)
    if not path.startswith("/") or "\x00" in path:
        raise ConfigError("snapshot store URL: a file URL needs an absolute path")
    return Path(path)


# The backends import the shared types above from this package, so they load last.
from .directory import DirectorySnapshotStore  # noqa: E402
from .s3 import S3SnapshotStore  # noqa: E402
