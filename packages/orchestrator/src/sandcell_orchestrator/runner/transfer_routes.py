"""``RunnerClient``'s transfer routes: checkpoints out and in, pushed inputs, session files.

A base class of ``RunnerClient`` (``client.py``), as ``AppRoutes`` is, so its
callers keep one client with one method per route; each method sends through the
client's ``RunnerConnection``. What these routes move (``CheckpointStream``,
``InputPayload``) and the helpers they share are in ``transfers.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterable, AsyncIterator, Sequence

import anyio
import anyio.to_thread

from sandcell_protocol import (
    FileEntry,
    FileListing,
    FileRef,
    InputProbe,
    InputProbeResult,
    InputUploadResult,
    ProtocolError,
    RestoreResult,
    encode,
    headers,
    input_cache_key,
    routes,
)

from ..errors import RunnerRequestError
from .connection import RunnerConnection
from .errors import refused_before_sending
from .transfers import (
    HASH_INLINE_MAX_BYTES,
    OCTET_STREAM,
    CheckpointEncoding,
    CheckpointStream,
    InputPayload,
    checkpoint_encoding,
    file_route,
    is_json,
    manifest,
)

__all__ = ["TransferRoutes"]


class TransferRoutes:
    """The checkpoint, input and file routes of one runner (``RunnerClient``'s part)."""

    _conn: RunnerConnection

    # -- checkpoint / restore ---------------------------------------------------

    @contextlib.asynccontextmanager
    async def checkpoint(
        self,
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
        response = await self._conn.request(
            "GET",
            routes.SESSION_CHECKPOINT,
            session_id=session_id,
            extra_headers={"Accept-Encoding": encoding},
            stream=True,
            params=params or None,
        )
        try:
            arrived = checkpoint_encoding(response)
            yield CheckpointStream(
                response, encoding=arrived, mapper=lambda: self._conn.mapping(response.request)
            )
        finally:
            await response.aclose()

    async def restore(
        self,
        chunks: AsyncIterable[bytes],
        *,
        session_id: str,
        sha256: str | None = None,
        timeout_s: float | None = None,
        taken_of: str | None = None,
    ) -> RestoreResult:
        """``POST /v1/session/restore``, streaming ``chunks`` (the runner sniffs gzip/zstd).

        With ``sha256`` the runner rejects a body whose digest differs; with ``taken_of``
        the body is a checkpoint of that session (not of ``session_id``'s own).
        """
        extra = {"Content-Type": OCTET_STREAM}
        if sha256 is not None:
            extra[headers.CHECKPOINT_SHA256] = sha256
        if taken_of is not None:
            extra[headers.CHECKPOINT_FROM] = taken_of
        response = await self._conn.request(
            "POST",
            routes.SESSION_RESTORE,
            session_id=session_id,
            content=chunks,
            extra_headers=extra,
            read_timeout_s=timeout_s,
        )
        return self._conn.decode(response, RestoreResult)

    # -- inputs ---------------------------------------------------------------

    async def probe_inputs(
        self, refs: Sequence[FileRef], *, session_id: str | None = None
    ) -> list[FileRef]:
        """``POST /v1/inputs/probe``: the refs whose objects the runner's cache lacks."""
        probe = InputProbe(refs=list(refs))
        response = await self._conn.request(
            "POST", routes.INPUTS_PROBE, session_id=session_id, message=probe
        )
        return self._conn.decode(response, InputProbeResult).missing

    async def push_inputs(
        self, objects: Sequence[InputPayload], *, session_id: str | None = None
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
        total = sum(len(item.data) for item in unique.values())
        # A runner that states its upload cap refuses a push past it (payload_too_large)
        # once it has read the manifest: refused here instead, before hashing and
        # sending bytes it would drop. The body holds at least every object's bytes.
        await self._conn.ensure_compatible()
        stated = self._conn.stated
        if stated is not None and total > stated.input_max_object_bytes:
            raise refused_before_sending(
                "payload_too_large",
                f"inputs of {total} bytes are over the sandbox's"
                f" {stated.input_max_object_bytes} byte upload cap",
            )
        if total > HASH_INLINE_MAX_BYTES:
            listed = await anyio.to_thread.run_sync(manifest, unique)
        else:
            listed = manifest(unique)
        response = await self._conn.request(
            "POST",
            routes.INPUTS,
            session_id=session_id,
            # httpx writes data fields before file parts: the manifest goes first.
            data={"manifest": encode(listed).decode()},
            files=[("object", (key, item.data, OCTET_STREAM)) for key, item in unique.items()],
        )
        return self._conn.decode(response, InputUploadResult).stored

    # -- session files ----------------------------------------------------------

    async def read_file(self, path: str, *, session_id: str) -> bytes:
        """``GET /v1/session/files/{path}``: a regular file's bytes."""
        response = await self._conn.request(
            "GET", file_route(path), session_id=session_id, max_bytes=lambda caps: caps.file_bytes
        )
        if is_json(response):
            raise RunnerRequestError(
                f"GET {path}: is a directory", code="invalid_path", public_detail="is a directory"
            )
        return response.content

    async def list_files(self, path: str = "", *, session_id: str) -> FileListing:
        """``GET /v1/session/files/{dir}``: the direct entries of a directory ("" = root)."""
        route = file_route(path, allow_root=True)
        response = await self._conn.request(
            "GET", route, session_id=session_id, max_bytes=lambda caps: caps.fs_bytes
        )
        if not is_json(response):
            raise RunnerRequestError(
                f"GET {path}: not a directory", code="invalid_path", public_detail="not a directory"
            )
        return self._conn.decode(response, FileListing)

    async def write_file(
        self, path: str, data: bytes, *, session_id: str, mode: int | None = None
    ) -> FileEntry:
        """``PUT /v1/session/files/{path}`` with the raw bytes; ``mode``: permission bits."""
        params: dict[str, str] = {}
        if mode is not None:
            if not 0 <= mode <= 0o777:
                raise refused_before_sending(
                    "bad_request", f"mode {mode:#o}: only permission bits 0..0o777"
                )
            params["mode"] = f"{mode:04o}"
        response = await self._conn.request(
            "PUT",
            file_route(path),
            session_id=session_id,
            content=data,
            params=params,
            extra_headers={"Content-Type": OCTET_STREAM},
        )
        return self._conn.decode(response, FileEntry)

    async def delete_file(self, path: str, *, session_id: str) -> None:
        """``DELETE /v1/session/files/{path}``; ``not_found`` if absent."""
        await self._conn.request("DELETE", file_route(path), session_id=session_id)
