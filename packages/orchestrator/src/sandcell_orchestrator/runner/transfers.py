"""What ``RunnerClient``'s transfer routes move: checkpoints, inputs, workspace files.

``CheckpointStream`` (the archive as it arrives, hashed on the way through),
``InputPayload`` (one object pushed into the input cache) and the helpers those
routes share: the file-route builder, the input manifest, the checkpoint
encoding an answer carries.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal
from urllib.parse import quote

import httpx

from sandcell_protocol import (
    InputManifest,
    InputObject,
    ProtocolError,
    routes,
    validate_workspace_path,
)

from ..errors import SandboxUnavailableError
from .connection import JSON
from .errors import refused_before_sending

__all__ = [
    "HASH_INLINE_MAX_BYTES",
    "OCTET_STREAM",
    "CheckpointEncoding",
    "CheckpointStream",
    "InputPayload",
    "checkpoint_encoding",
    "file_route",
    "is_json",
    "manifest",
]

CheckpointEncoding = Literal["zstd", "gzip"]


OCTET_STREAM = "application/octet-stream"
HASH_INLINE_MAX_BYTES = 1 << 20
"""Hash bigger pushes in a worker thread so the event loop keeps serving."""


@dataclass(frozen=True, slots=True)
class InputPayload:
    """One input object to push into a runner's input cache."""

    storage_session: str
    object_id: str
    data: bytes
    read_only: bool = False

    def __repr__(self) -> str:
        # The bytes are user data: keep them out of reprs and logs.
        return (
            f"InputPayload(storage_session={self.storage_session!r}, "
            f"object_id={self.object_id!r}, size={len(self.data)}, read_only={self.read_only})"
        )


class CheckpointStream:
    """The compressed checkpoint bytes as the runner sent them, hashed on the way through.

    ``sha256`` and ``size_bytes`` describe what has been read so far; ``complete``
    turns true once the runner's stream ended cleanly.
    """

    def __init__(
        self,
        response: httpx.Response,
        *,
        encoding: CheckpointEncoding,
        mapper: Callable[[], contextlib.AbstractContextManager[None]],
    ) -> None:
        self.encoding: CheckpointEncoding = encoding
        self.size_bytes = 0
        self.complete = False
        self._chunks = response.aiter_raw()
        self._hash = hashlib.sha256()
        self._mapper = mapper

    def __repr__(self) -> str:
        return f"CheckpointStream(encoding={self.encoding!r}, size_bytes={self.size_bytes})"

    @property
    def sha256(self) -> str:
        """Hex sha256 of the bytes read so far (of the whole checkpoint once ``complete``)."""
        return self._hash.hexdigest()

    def __aiter__(self) -> CheckpointStream:
        return self

    async def __anext__(self) -> bytes:
        with self._mapper():
            try:
                chunk = await anext(self._chunks)
            except StopAsyncIteration:
                self.complete = True
                raise
        self._hash.update(chunk)
        self.size_bytes += len(chunk)
        return chunk


def file_route(path: str, *, allow_root: bool = False) -> str:
    if allow_root and path in ("", ".", "/"):
        return routes.SESSION_FILES_PREFIX
    try:
        normalized = validate_workspace_path(path)
    except ProtocolError as exc:
        raise refused_before_sending("invalid_path", str(exc)) from None
    return routes.SESSION_FILES_PREFIX + "/".join(
        quote(part, safe="") for part in normalized.split("/")
    )


def is_json(response: httpx.Response) -> bool:
    return str(response.headers.get("content-type", "")).startswith(JSON)


def manifest(objects: Mapping[str, InputPayload]) -> InputManifest:
    return InputManifest(
        objects={
            key: InputObject(
                size=len(item.data),
                sha256=hashlib.sha256(item.data).hexdigest(),
                read_only=item.read_only,
            )
            for key, item in objects.items()
        }
    )


def checkpoint_encoding(response: httpx.Response) -> CheckpointEncoding:
    media = response.headers.get("content-type", "").split(";")[0].strip().lower()
    content_encoding = response.headers.get("content-encoding", "").strip().lower()
    if media == routes.ZSTD or content_encoding == "zstd":
        return "zstd"
    if media == routes.GZIP or content_encoding == "gzip":
        return "gzip"
    raise SandboxUnavailableError(
        f"GET {routes.SESSION_CHECKPOINT}: not a checkpoint (content type {media[:64]!r})"
    )
