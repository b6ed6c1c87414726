"""``RunnerTransfers``: the bytes a ``RunnerClient`` moves into and out of a runner.

Owns the checkpoint and restore routes (with ``CheckpointStream``, the archive
as it arrives), the input-cache routes (probe which objects are missing, push
them) and the session workspace-file routes (read, list, write, delete).

A mixin of ``RunnerClient``: it sends through the client's ``_request`` /
``_decode`` plumbing and holds no state, token or header of its own.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import AsyncIterable, AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal
from urllib.parse import quote

import anyio
import anyio.to_thread
import httpx

from sandcell_protocol import (
    FileEntry,
    FileListing,
    FileRef,
    InputManifest,
    InputObject,
    InputProbe,
    InputProbeResult,
    InputUploadResult,
    ProtocolError,
    RestoreResult,
    encode,
    headers,
    input_cache_key,
    routes,
    validate_workspace_path,
)

from ..errors import RunnerRequestError, SandboxUnavailableError
from .core import RunnerCore
from .errors import refused_before_sending

__all__ = ["CheckpointEncoding", "CheckpointStream", "InputPayload", "RunnerTransfers"]

CheckpointEncoding = Literal["zstd", "gzip"]

JSON = "application/json"
OCTET_STREAM = "application/octet-stream"
_HASH_INLINE_MAX_BYTES = 1 << 20
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


def _file_route(path: str, *, allow_root: bool = False) -> str:
    if allow_root and path in ("", ".", "/"):
        return routes.SESSION_FILES_PREFIX
    try:
        normalized = validate_workspace_path(path)
    except ProtocolError as exc:
        raise refused_before_sending("invalid_path", str(exc)) from None
    return routes.SESSION_FILES_PREFIX + "/".join(
        quote(part, safe="") for part in normalized.split("/")
    )


class RunnerTransfers:
    """Checkpoint, restore, input-cache and session-file routes; a mixin of ``RunnerClient``."""

    # -- checkpoint / restore ---------------------------------------------------

    @contextlib.asynccontextmanager
    async def checkpoint(
        self: RunnerCore,
        *,
        session_id: str,
        encoding: CheckpointEncoding = "zstd",
        include: Sequence[str] = (),
        exclude: Sequence[str] = (),
    ) -> AsyncIterator[CheckpointStream]:
        """``GET /v1/session/checkpoint``: yields the compressed archive as sent.

        ``encoding`` is a preference; the yielded stream's ``encoding`` says which arrived.
        ``include`` / ``exclude`` are workspace globs (a ``PersistentWorkspace``).
        """
        params = [("include", p) for p in include] + [("exclude", p) for p in exclude]
        response = await self._request(
            "GET",
            routes.SESSION_CHECKPOINT,
            session_id=session_id,
            extra_headers={"Accept-Encoding": encoding},
            stream=True,
            params=params or None,
        )
        try:
            arrived = _checkpoint_encoding(response)
            yield CheckpointStream(
                response, encoding=arrived, mapper=lambda: self._mapping(response.request)
            )
        finally:
            await response.aclose()

    async def restore(
        self: RunnerCore,
        chunks: AsyncIterable[bytes],
        *,
        session_id: str,
        sha256: str | None = None,
        timeout_s: float | None = None,
    ) -> RestoreResult:
        """``POST /v1/session/restore``, streaming ``chunks`` (the runner sniffs gzip/zstd).

        With ``sha256`` the runner rejects a body whose digest differs.
        """
        extra = {"Content-Type": OCTET_STREAM}
        if sha256 is not None:
            extra[headers.CHECKPOINT_SHA256] = sha256
        response = await self._request(
            "POST",
            routes.SESSION_RESTORE,
            session_id=session_id,
            content=chunks,
            extra_headers=extra,
            read_timeout_s=timeout_s,
        )
        return self._decode(response, RestoreResult)

    # -- inputs ---------------------------------------------------------------

    async def probe_inputs(
        self: RunnerCore, refs: Sequence[FileRef], *, session_id: str | None = None
    ) -> list[FileRef]:
        """``POST /v1/inputs/probe``: the refs whose objects the runner's cache lacks."""
        probe = InputProbe(refs=list(refs))
        response = await self._request(
            "POST", routes.INPUTS_PROBE, session_id=session_id, message=probe
        )
        return self._decode(response, InputProbeResult).missing

    async def push_inputs(
        self: RunnerCore, objects: Sequence[InputPayload], *, session_id: str | None = None
    ) -> list[str]:
        """``POST /v1/inputs`` (multipart: manifest first, one part per object); stored keys."""
        unique: dict[str, InputPayload] = {}
        for item in objects:
            try:
                unique.setdefault(input_cache_key(item.storage_session, item.object_id), item)
            except ProtocolError as exc:
                raise refused_before_sending("bad_request", str(exc)) from None
        if not unique:
            return []
        if sum(len(item.data) for item in unique.values()) > _HASH_INLINE_MAX_BYTES:
            manifest = await anyio.to_thread.run_sync(_manifest, unique)
        else:
            manifest = _manifest(unique)
        response = await self._request(
            "POST",
            routes.INPUTS,
            session_id=session_id,
            # httpx writes data fields before file parts: the manifest goes first.
            data={"manifest": encode(manifest).decode()},
            files=[("object", (key, item.data, OCTET_STREAM)) for key, item in unique.items()],
        )
        return self._decode(response, InputUploadResult).stored

    # -- session files ----------------------------------------------------------

    async def read_file(self: RunnerCore, path: str, *, session_id: str) -> bytes:
        """``GET /v1/session/files/{path}``: a regular file's bytes."""
        response = await self._request("GET", _file_route(path), session_id=session_id)
        if _is_json(response):
            raise RunnerRequestError(f"GET {path}: is a directory", code="invalid_path")
        return response.content

    async def list_files(self: RunnerCore, path: str = "", *, session_id: str) -> FileListing:
        """``GET /v1/session/files/{dir}``: the direct entries of a directory ("" = root)."""
        route = _file_route(path, allow_root=True)
        response = await self._request("GET", route, session_id=session_id)
        if not _is_json(response):
            raise RunnerRequestError(f"GET {path}: not a directory", code="invalid_path")
        return self._decode(response, FileListing)

    async def write_file(
        self: RunnerCore, path: str, data: bytes, *, session_id: str, mode: int | None = None
    ) -> FileEntry:
        """``PUT /v1/session/files/{path}`` with the raw bytes; ``mode``: permission bits."""
        params: dict[str, str] = {}
        if mode is not None:
            if not 0 <= mode <= 0o777:
                raise refused_before_sending(
                    "bad_request", f"mode {mode:#o}: only permission bits 0..0o777"
                )
            params["mode"] = f"{mode:04o}"
        response = await self._request(
            "PUT",
            _file_route(path),
            session_id=session_id,
            content=data,
            params=params,
            extra_headers={"Content-Type": OCTET_STREAM},
        )
        return self._decode(response, FileEntry)

    async def delete_file(self: RunnerCore, path: str, *, session_id: str) -> None:
        """``DELETE /v1/session/files/{path}``; ``not_found`` if absent."""
        await self._request("DELETE", _file_route(path), session_id=session_id)


def _is_json(response: httpx.Response) -> bool:
    return str(response.headers.get("content-type", "")).startswith(JSON)


def _manifest(objects: Mapping[str, InputPayload]) -> InputManifest:
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


def _checkpoint_encoding(response: httpx.Response) -> CheckpointEncoding:
    media = response.headers.get("content-type", "").split(";")[0].strip().lower()
    content_encoding = response.headers.get("content-encoding", "").strip().lower()
    if media == routes.ZSTD or content_encoding == "zstd":
        return "zstd"
    if media == routes.GZIP or content_encoding == "gzip":
        return "gzip"
    raise SandboxUnavailableError(
        f"GET {routes.SESSION_CHECKPOINT}: not a checkpoint (content type {media[:64]!r})"
    )
