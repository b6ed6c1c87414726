"""Routes of a session-enabled runner: checkpoint, restore, files, release, inputs."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import re
import stat
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from sandcell_protocol import (
    FileEntry,
    FileListing,
    InputProbe,
    InputProbeResult,
    InputUploadResult,
    ProtocolError,
    RestoreResult,
    SurfacedOutput,
    headers,
    routes,
    validate_workspace_path,
)

from ..checkpoint.compression import choose_encoding, sniff_encoding
from ..checkpoint.export import ArchiveLimits, stream_checkpoint
from ..checkpoint.restore import restore_checkpoint
from ..checkpoint.selection import WorkspaceSelection
from ..errors import (
    ArchiveRejectedError,
    BadRequestError,
    InvalidPathError,
    NotFoundError,
)
from ..workspace import fsops
from ..workspace.session import SessionState

if TYPE_CHECKING:
    from .app import RunnerApp

_SHA256_RE = re.compile(r"[0-9a-f]{64}")


def _entry(name: str, st: os.stat_result, target: str | None = None) -> FileEntry:
    if stat.S_ISDIR(st.st_mode):
        kind = "dir"
    elif stat.S_ISREG(st.st_mode):
        kind = "file"
    elif stat.S_ISLNK(st.st_mode):
        kind = "symlink"
    else:
        kind = "other"
    return FileEntry(
        name=name,
        kind=kind,  # type: ignore[arg-type]
        size=st.st_size,
        mtime_ns=st.st_mtime_ns,
        mode=stat.S_IMODE(st.st_mode),
        symlink_target=target,
    )


def _list_dir(root: os.PathLike[str], relpath: str) -> FileListing:
    parts = relpath.split("/") if relpath else []
    with fsops.open_dir(root, parts) as dir_fd, os.scandir(dir_fd) as scan:  # type: ignore[arg-type]
        entries = []
        for item in scan:
            st = item.stat(follow_symlinks=False)
            target = os.readlink(item.name, dir_fd=dir_fd) if stat.S_ISLNK(st.st_mode) else None
            entries.append(_entry(item.name, st, target))
    return FileListing(path=relpath, entries=sorted(entries, key=lambda e: e.name))


class SessionRoutes:
    """Handlers bound to a ``RunnerApp``."""

    def __init__(self, app: RunnerApp) -> None:
        self.app = app
        self.service = app.service
        self.sessions = app.service.sessions

    def _session_id(self, request: Request) -> str:
        self.sessions.require_enabled()
        session_id = self.sessions.check_header(request.headers.get(headers.RUNTIME_SESSION_ID))
        if session_id is None:
            raise BadRequestError(f"{headers.RUNTIME_SESSION_ID} header is required")
        return session_id

    def _limits(self) -> ArchiveLimits:
        settings = self.service.settings
        return ArchiveLimits(
            max_bytes=settings.checkpoint_max_bytes, max_members=settings.checkpoint_max_members
        )

    # -- checkpoint / restore -----------------------------------------------------

    async def get_checkpoint(self, request: Request) -> Response:
        session_id = self._session_id(request)
        encoding = choose_encoding(request.headers.get("accept-encoding"))
        selection = WorkspaceSelection.parse(
            request.query_params.getlist("include"), request.query_params.getlist("exclude")
        )
        stack = contextlib.AsyncExitStack()
        state: SessionState = await stack.enter_async_context(self.sessions.locked(session_id))
        try:
            chunks = stream_checkpoint(
                state.workspace,
                state.metadata(),
                encoding=encoding,
                limits=self._limits(),
                selection=selection,
            )
            # Pull the first chunk before answering: export's size checks fail here,
            # and then the caller gets a 4xx, not a truncated 200.
            first = await anext(aiter(chunks), b"")
        except BaseException:
            await stack.aclose()
            raise

        async def body() -> AsyncIterator[bytes]:
            try:
                yield first
                async for chunk in chunks:
                    yield chunk
            finally:
                await chunks.aclose()  # type: ignore[attr-defined]
                await stack.aclose()

        media = routes.ZSTD if encoding == "zstd" else routes.GZIP
        return StreamingResponse(body(), media_type=media)

    async def post_restore(self, request: Request) -> Response:
        session_id = self._session_id(request)
        expected = request.headers.get(headers.CHECKPOINT_SHA256)
        if expected is not None and not _SHA256_RE.fullmatch(expected):
            raise BadRequestError(f"{headers.CHECKPOINT_SHA256} must be 64 lowercase hex digits")
        async with self.sessions.locked(session_id) as state:
            stream = request.stream()
            first = b""
            async for chunk in stream:
                first += chunk
                if len(first) >= 4:
                    break
            encoding = sniff_encoding(first)

            async def chunks() -> AsyncIterator[bytes]:
                yield first
                async for chunk in stream:
                    yield chunk

            staging = await self.sessions.new_staging(state)
            try:
                meta = await restore_checkpoint(
                    chunks(),
                    staging,
                    uid=state.uid,
                    gid=state.uid,
                    encoding=encoding,
                    limits=self._limits(),
                    expected_sha256=expected,
                )
            except BaseException:
                await self.sessions.discard_staging(state, staging)
                raise
            if meta.session_id != session_id:
                await self.sessions.discard_staging(state, staging)
                raise ArchiveRejectedError("checkpoint belongs to another runtime session")
            await self.sessions.swap_in(state, staging)
            state.adopt(meta)
            entries = await asyncio.to_thread(fsops.scan, state.workspace)
        files = [e for e in entries if e.kind == "file"]
        return self.app.json(
            RestoreResult(session_id=session_id, files=len(files), bytes=sum(e.size for e in files))
        )

    async def delete_session(self, request: Request) -> Response:
        self.sessions.require_enabled()
        session_id = self.sessions.check_header(request.headers.get(headers.RUNTIME_SESSION_ID))
        await self.sessions.release(session_id)
        return Response(status_code=204)

    # -- files ----------------------------------------------------------------

    def _path(self, request: Request) -> str:
        raw = request.path_params.get("path", "")
        if raw in ("", "/"):
            return ""
        try:
            return validate_workspace_path(raw)
        except ProtocolError as exc:
            raise InvalidPathError(f"invalid path: {exc}") from None

    async def get_file(self, request: Request) -> Response:
        session_id = self._session_id(request)
        relpath = self._path(request)
        async with self.sessions.locked(session_id) as state:
            try:
                if relpath == "":
                    listing = await asyncio.to_thread(_list_dir, state.workspace, "")
                    return self.app.json(listing)
                *parents, name = relpath.split("/")
                st = await asyncio.to_thread(_lstat_at, state.workspace, parents, name)
                if stat.S_ISDIR(st.st_mode):
                    listing = await asyncio.to_thread(_list_dir, state.workspace, relpath)
                    return self.app.json(listing)
                data = await asyncio.to_thread(
                    fsops.read_file,
                    state.workspace,
                    relpath,
                    max_bytes=self.service.settings.max_body_bytes,
                )
            except FileNotFoundError:
                raise NotFoundError(f"no such file: {relpath}") from None
            except fsops.UnsafePathError as exc:
                raise InvalidPathError(str(exc.strerror or exc)) from None
        return Response(data, media_type="application/octet-stream")

    async def put_file(self, request: Request) -> Response:
        session_id = self._session_id(request)
        relpath = self._path(request)
        if not relpath:
            raise InvalidPathError("a file path is required")
        mode = _parse_mode(request.query_params.get("mode"))
        data = await self.app.read_body(request)
        async with self.sessions.locked(session_id) as state:
            try:
                st = await asyncio.to_thread(
                    fsops.write_file,
                    state.workspace,
                    relpath,
                    data,
                    mode=mode,
                    uid=state.uid,
                    gid=state.uid,
                )
            except fsops.UnsafePathError as exc:
                raise InvalidPathError(str(exc.strerror or exc)) from None
            except OSError as exc:
                raise BadRequestError(f"cannot write {relpath}: {exc.strerror}") from None
            state.surfaced[relpath] = SurfacedOutput(
                name=relpath,
                size=st.st_size,
                mtime_ns=st.st_mtime_ns,
                sha256=hashlib.sha256(data).hexdigest(),
            )
        return self.app.json(_entry(relpath.rsplit("/", 1)[-1], st))

    async def delete_file(self, request: Request) -> Response:
        session_id = self._session_id(request)
        relpath = self._path(request)
        if not relpath:
            raise InvalidPathError("a path is required")
        async with self.sessions.locked(session_id) as state:
            try:
                removed = await asyncio.to_thread(fsops.remove_path, state.workspace, relpath)
            except fsops.UnsafePathError as exc:
                raise InvalidPathError(str(exc.strerror or exc)) from None
        if not removed:
            raise NotFoundError(f"no such file: {relpath}")
        return Response(status_code=204)

    # -- inputs ---------------------------------------------------------------

    def _optional_bind(self, request: Request) -> str | None:
        return self.sessions.check_header(request.headers.get(headers.RUNTIME_SESSION_ID))

    async def post_probe(self, request: Request) -> Response:
        session_id = self._optional_bind(request)
        if session_id is not None:
            await self.sessions.bind(session_id)
        probe = await self.app.read_message(request, InputProbe)
        for ref in probe.refs:
            try:
                validate_workspace_path(ref.name)
            except ProtocolError as exc:
                raise InvalidPathError(f"invalid file name {ref.name[:200]!r}: {exc}") from None
        missing = await asyncio.to_thread(self.service.inputs.missing, list(probe.refs))
        return self.app.json(InputProbeResult(missing=missing))

    async def post_inputs(self, request: Request) -> Response:
        session_id = self._optional_bind(request)
        if session_id is not None:
            await self.sessions.bind(session_id)
        content_type = request.headers.get("content-type", "")
        stored = await self.service.inputs.ingest(
            request.stream(),
            content_type,
            max_total_bytes=self.service.settings.input_max_object_bytes,
        )
        return self.app.json(InputUploadResult(stored=stored))


def _lstat_at(root: os.PathLike[str], parents: list[str], name: str) -> os.stat_result:
    with fsops.open_dir(root, parents) as dir_fd:  # type: ignore[arg-type]
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)


def _parse_mode(raw: str | None) -> int:
    if raw is None:
        return 0o644
    try:
        mode = int(raw, 8)
    except ValueError:
        raise BadRequestError("mode must be an octal number such as 0644") from None
    if mode & ~0o777:
        raise BadRequestError("mode may only carry permission bits (no setuid/setgid/sticky)")
    return mode


__all__ = ["SessionRoutes"]
