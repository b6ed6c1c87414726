"""``S3SnapshotStore``: snapshots as objects in an S3 or MinIO bucket, through ``minio``.

A put streams into a staging object under ``<prefix>/.staging/`` and then copies
it server-side onto the key with ``x-amz-meta-sha256``: S3 fixes an object's
metadata when its upload starts, and the digest is known only when the stream
ends. That copy is the single step that replaces the previous object, so a put
that fails or passes its cap leaves it intact. The upload itself, in bounded
memory, is ``s3_upload.py``'s; every foreign error becomes a ``CheckpointError``
in ``s3_errors.py``.

Operators: give the bucket a lifecycle rule that expires ``<prefix>/.staging/``
and aborts incomplete multipart uploads after a day, for puts cut off by a crash.
"""

from __future__ import annotations

import functools
import itertools
import logging
import secrets
from collections.abc import AsyncIterable, AsyncIterator, Callable
from contextlib import asynccontextmanager
from types import TracebackType
from typing import Self, TypeVar, cast

import anyio
import urllib3
from minio import Minio
from minio.commonconfig import ComposeSource
from minio.datatypes import Object

from ..errors import CheckpointError
from .base import (
    Snapshot,
    SnapshotEntry,
    SnapshotInfo,
    SnapshotNotFoundError,
    _is_sha256_hex,
    _validate_max_bytes,
    _validate_page,
    _validate_prefix,
    _VerifiedChunks,
)
from .keys import validate_snapshot_key
from .s3_errors import translate_error
from .s3_settings import S3Settings
from .s3_upload import upload_stream

__all__ = ["S3SnapshotStore"]

T = TypeVar("T")
_log = logging.getLogger(__name__)

SHA256_METADATA = "x-amz-meta-sha256"
_STAGING_DIR = ".staging"


class S3SnapshotStore:
    """A ``SnapshotStore`` in an S3 / MinIO bucket; minio's blocking calls run in threads.

    ``http_client`` is the transport seam (tests record requests with it); the store
    owns it either way and clears it on ``close``.
    """

    def __init__(
        self, settings: S3Settings, *, http_client: urllib3.PoolManager | None = None
    ) -> None:
        self._settings = settings
        self._http = http_client or _default_http_client(settings)
        self._client = Minio(
            settings.endpoint,
            access_key=settings.access_key,
            secret_key=settings.secret_key,
            secure=settings.secure,
            region=settings.region,
            http_client=self._http,
        )
        self._closed = False

    @property
    def settings(self) -> S3Settings:
        """The settings this store was built with (the secret key stays out of its repr)."""
        return self._settings

    def __repr__(self) -> str:
        s = self._settings
        return f"S3SnapshotStore(endpoint={s.url!r}, bucket={s.bucket!r}, prefix={s.prefix!r})"

    async def put(self, key: str, stream: AsyncIterable[bytes], *, max_bytes: int) -> SnapshotInfo:
        """Upload ``stream`` and publish it under ``key``; see ``SnapshotStore.put``."""
        name = self._object_name(key)
        _validate_max_bytes(max_bytes)
        staging = self._object_name(f"{_STAGING_DIR}/{secrets.token_hex(16)}", validate=False)
        uploaded = await upload_stream(
            self._client,
            self._settings.bucket,
            staging,
            stream,
            key=key,
            max_bytes=max_bytes,
            part_size_bytes=self._settings.part_size_bytes,
            translate=lambda exc: self._translate(exc, "put", key),
        )
        try:
            commit = functools.partial(self._commit, staging, name, uploaded.sha256)
            await self._run("put", key, commit)
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._remove_quietly, staging)
        return uploaded

    @asynccontextmanager
    async def get(self, key: str, *, max_bytes: int) -> AsyncIterator[Snapshot]:
        """HEAD the object and check its size, then stream it; see ``SnapshotStore.get``."""
        name = self._object_name(key)
        _validate_max_bytes(max_bytes)
        stat = await self._run(
            "get", key, functools.partial(self._client.stat_object, self._settings.bucket, name)
        )
        info = _info_from_stat(key, stat)
        if info.size > max_bytes:
            raise CheckpointError(
                f"snapshot get of {key!r}: {info.size} bytes is over the cap of {max_bytes}"
            )
        # If-Match pins the GET to the object we just sized and whose digest we hold.
        headers: dict[str, str | list[str] | tuple[str]] | None = (
            {"If-Match": f'"{stat.etag}"'} if stat.etag else None
        )
        fetch = functools.partial(
            self._client.get_object, self._settings.bucket, name, request_headers=headers
        )
        response = await self._run("get", key, fetch)
        try:
            yield Snapshot(
                info=info, chunks=_VerifiedChunks(self._reader(response, key), info=info)
            )
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(_close_response, response)

    async def delete(self, key: str) -> None:
        """Remove the object; S3 deletes are idempotent, so a missing one is fine."""
        name = self._object_name(key)
        remove = functools.partial(self._client.remove_object, self._settings.bucket, name)
        try:
            await self._run("delete", key, remove)
        except SnapshotNotFoundError:
            return

    async def exists(self, key: str) -> bool:
        """HEAD the object."""
        name = self._object_name(key)
        head = functools.partial(self._client.stat_object, self._settings.bucket, name)
        try:
            await self._run("exists", key, head)
        except SnapshotNotFoundError:
            return False
        return True

    async def list(
        self, prefix: str, *, start_after: str | None = None, limit: int | None = None
    ) -> list[SnapshotEntry]:
        """ListObjectsV2 under ``prefix``, by key; staging objects never show.

        Every page without ``limit``; with it, only the requests that ``limit`` keys
        need (S3 answers up to 1,000 a request, from ``start_after`` on).
        """
        _validate_prefix(prefix)
        _validate_page(prefix, start_after, limit)
        full = self._object_name(prefix, validate=False)
        after = None if start_after is None else self._object_name(start_after, validate=False)
        strip = len(self._settings.prefix) + 1 if self._settings.prefix else 0

        def listing() -> list[SnapshotEntry]:
            objects = self._client.list_objects(
                self._settings.bucket, prefix=full, recursive=True, start_after=after
            )
            entries = (
                SnapshotEntry(
                    (item.object_name or "")[strip:],
                    item.size or 0,
                    item.last_modified.timestamp() if item.last_modified else 0.0,
                )
                for item in objects
            )
            keys = (e for e in entries if e.key.startswith(prefix) and _is_key(e.key))
            # minio's iterator asks for the next page only when it is read that far.
            return list(itertools.islice(keys, limit))

        found = await self._run("list", prefix, listing)
        return sorted(found, key=lambda entry: entry.key)

    async def close(self) -> None:
        """Close pooled connections; idempotent."""
        if not self._closed:
            self._closed = True
            await anyio.to_thread.run_sync(self._http.clear)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def _object_name(self, key: str, *, validate: bool = True) -> str:
        if validate:
            validate_snapshot_key(key)
        if self._closed:
            raise CheckpointError("snapshot store is closed")
        prefix = self._settings.prefix
        return f"{prefix}/{key}" if prefix else key

    async def _run(self, operation: str, key: str, call: Callable[[], T]) -> T:
        def mapped() -> T:
            try:
                return call()
            except CheckpointError:
                raise
            except Exception as exc:
                raise self._translate(exc, operation, key) from exc

        return await anyio.to_thread.run_sync(mapped)

    def _translate(self, exc: BaseException, operation: str, key: str) -> CheckpointError:
        return translate_error(exc, operation=operation, key=key, endpoint=self._settings.url)

    def _commit(self, staging: str, name: str, sha256: str) -> None:
        # compose_object is a plain CopyObject up to 5 GiB and a multipart copy above.
        self._client.compose_object(
            self._settings.bucket,
            name,
            [ComposeSource(self._settings.bucket, staging)],
            metadata={SHA256_METADATA: sha256},
        )

    def _remove_quietly(self, staging: str) -> None:
        try:
            self._client.remove_object(self._settings.bucket, staging)
        except Exception as exc:  # the lifecycle rule collects it later
            _log.warning(
                "could not remove staging object %s at %s: %s",
                staging,
                self._settings.url,
                type(exc).__name__,
            )

    def _reader(self, response: urllib3.BaseHTTPResponse, key: str) -> Callable[[int], bytes]:
        def read(size: int) -> bytes:
            try:
                return response.read(size, decode_content=False)
            except Exception as exc:
                raise self._translate(exc, "get", key) from exc

        return read


def _is_key(key: str) -> bool:
    try:
        validate_snapshot_key(key)
    except CheckpointError:
        return False
    return True


def _info_from_stat(key: str, stat: Object) -> SnapshotInfo:
    recorded: str | None = None
    for name, value in (stat.metadata or {}).items():
        if name.lower() == SHA256_METADATA and isinstance(value, str):
            recorded = value
    if not _is_sha256_hex(recorded) or stat.size is None:
        raise CheckpointError(f"snapshot {key!r} has no recorded sha256 or size")
    return SnapshotInfo(key=key, size=stat.size, sha256=cast(str, recorded))


def _close_response(response: urllib3.BaseHTTPResponse) -> None:
    response.close()
    response.release_conn()


def _default_http_client(settings: S3Settings) -> urllib3.PoolManager:
    return urllib3.PoolManager(
        timeout=urllib3.Timeout(connect=settings.connect_timeout_s, read=settings.read_timeout_s),
        maxsize=8,
        cert_reqs="CERT_REQUIRED",
        # A few quick retries for blips; a real outage surfaces as a retryable
        # SnapshotUnavailableError for the caller's own policy.
        retries=urllib3.Retry(
            total=2,
            backoff_factor=0.2,
            status_forcelist=(500, 502, 503, 504),
            raise_on_status=False,
        ),
    )
