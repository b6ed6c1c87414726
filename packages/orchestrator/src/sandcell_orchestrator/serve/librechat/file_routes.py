"""The file routes of ``/librechat/v1``: upload, download, object info, listing, delete.

``FileRoutes`` works on the API's shared state (``api.py``): its ``auth``,
``settings``, ``files`` (the ``InputStore`` behind ``files.py``) and id
generator; every lookup is scoped to the caller's namespace, and a file that is
absent, another tenant's or another user's answers alike (``FileNotVisibleError``).
"""

from __future__ import annotations

import msgspec
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message, Receive

from sandcell_protocol import ProtocolError, validate_user_id
from sandcell_protocol.digits import is_ascii_digits

from ..errors import JSON_MEDIA_TYPE, PayloadTooLargeError, form_of
from ..headers import content_disposition
from .api import LibreChatApi
from .auth import Caller, LibreChatAuth
from .errors import FileNotVisibleError
from .files import FileMeta, LibreChatFiles, Viewer, visible
from .ids import require_nanoid
from .settings import LibreChatSettings
from .wire import FileEntry, ObjectInfo, UploadAnswer, UploadedFile

__all__ = ["MAX_BATCH_FILES", "FileRoutes"]

MAX_BATCH_FILES = 200
_KINDS = frozenset({"user", "agent", "skill"})


class FileRoutes:
    """The file routes on the API's shared state."""

    def __init__(self, api: LibreChatApi) -> None:
        self._api = api
        self.settings: LibreChatSettings = api.settings
        self.auth: LibreChatAuth = api.auth

    @property
    def files(self) -> LibreChatFiles:
        """Where files are kept (resolved on first use, as the API's services are)."""
        return self._api.files

    def new_id(self) -> str:
        """A fresh nanoid (the API's generator)."""
        return self._api.new_id()

    async def upload(self, request: Request) -> Response:
        return await self._upload(request, batch=False)

    async def upload_batch(self, request: Request) -> Response:
        return await self._upload(request, batch=True)

    async def _upload(self, request: Request, *, batch: bool) -> Response:
        caller = self.auth.caller(request)
        max_bytes = self.settings.max_upload_bytes
        declared = request.headers.get("content-length", "")
        if is_ascii_digits(declared) and int(declared) > max_bytes:
            raise _too_large(max_bytes)
        limit = MAX_BATCH_FILES if batch else 1
        # The body is parsed as it streams, and cut off at the cap: one that declares no
        # length (chunked) costs at most the cap, never its whole self, in spool or memory.
        capped = Request(request.scope, receive=_capped(request.receive, max_bytes))
        async with form_of(capped, max_files=limit, max_fields=16) as form:
            parts = [part for part in form.getlist("file") if isinstance(part, UploadFile)]
            if not parts:
                raise ProtocolError("upload: no file part")
            kind = _text(form.get("kind"))
            if kind is not None and kind not in _KINDS:
                raise ProtocolError("upload: kind must be user, agent or skill")
            resource_id = _text(form.get("id"))
            # Clients that send no kind are the legacy contract: it named the storage
            # session ``session_id``.
            legacy = kind is None
            entity_id = _text(form.get("entity_id"))
            if legacy and entity_id is not None:
                # An older LibreChat's agent file: kept as the agent's, so the agent's
                # other users (naming ``entity_id`` or ``kind=agent&id=``) see it too.
                kind, resource_id = "agent", validate_user_id(entity_id, field="entity_id")
            version = _text(form.get("version"))
            # Bounded: past 4300 digits int() raises, and no version is that long.
            if version is not None and not is_ascii_digits(version, max_length=18):
                raise ProtocolError("upload: version must be a whole number")
            read_only = (_text(form.get("read_only")) or "").lower() in ("true", "1")
            user = caller.token_user or request.headers.get("user-id") or None
            if user is not None:
                validate_user_id(user, field="User-Id")
            storage_session_id = self.new_id()
            uploaded: list[UploadedFile] = []
            total = 0
            for part in parts:
                data = await part.read()
                total += len(data)
                if total > max_bytes:
                    raise _too_large(max_bytes)
                filename = part.filename or "file"
                file_id = self.new_id()
                await self.files.put(
                    caller.namespace,
                    storage_session_id,
                    file_id,
                    data,
                    filename=filename,
                    user_id=user,
                    kind=kind or "user",
                    resource_id=resource_id,
                    version=int(version) if version is not None else None,
                    read_only=read_only,
                )
                uploaded.append(
                    UploadedFile(
                        fileId=file_id, filename=filename, status="success" if batch else None
                    )
                )
        answer = UploadAnswer(
            message="success",
            files=uploaded,
            storage_session_id=None if legacy else storage_session_id,
            session_id=storage_session_id if legacy else None,
            succeeded=len(uploaded) if batch else None,
            failed=0 if batch else None,
        )
        return Response(msgspec.json.encode(answer), media_type=JSON_MEDIA_TYPE)

    async def _visible_meta(self, request: Request, caller: Caller) -> tuple[str, str, FileMeta]:
        session_id = require_nanoid("session_id", request.path_params["session_id"])
        file_id = require_nanoid("fileId", request.path_params["file_id"])
        meta = await self.files.meta(caller.namespace, session_id, file_id)
        if meta is None or not visible(meta, _viewer(request, caller)):
            raise FileNotVisibleError
        return session_id, file_id, meta

    async def download(self, request: Request) -> Response:
        caller = self.auth.caller(request)
        session_id, file_id, meta = await self._visible_meta(request, caller)
        data = await self.files.read(caller.namespace, session_id, file_id)
        if data is None:
            raise FileNotVisibleError
        name = meta.filename.rsplit("/", 1)[-1].replace('"', "")
        return Response(
            data,
            media_type="application/octet-stream",
            headers={"Content-Disposition": content_disposition("attachment", name)},
        )

    async def object_info(self, request: Request) -> Response:
        caller = self.auth.caller(request)
        _, _, meta = await self._visible_meta(request, caller)
        info = ObjectInfo(lastModified=meta.modified_at, size=meta.size, etag=meta.sha256)
        return Response(msgspec.json.encode(info), media_type=JSON_MEDIA_TYPE)

    async def list_files(self, request: Request) -> Response:
        caller = self.auth.caller(request)
        session_id = require_nanoid("session_id", request.path_params["session_id"])
        full = request.query_params.get("detail", "summary") == "full"
        viewer = _viewer(request, caller)
        entries = [
            FileEntry(
                name=f"{session_id}/{file_id}",
                id=file_id,
                storage_session_id=session_id,
                metadata={"original-filename": meta.filename},
                size=meta.size if full else None,
                # In the summary too: an older LibreChat reads it there and re-uploads
                # a file whose listing has none (or one more than 23 hours old).
                lastModified=meta.modified_at,
                etag=meta.sha256 if full else None,
            )
            for file_id, meta in await self.files.list(caller.namespace, session_id)
            if visible(meta, viewer)
        ]
        return Response(msgspec.json.encode(entries), media_type=JSON_MEDIA_TYPE)

    async def delete_file(self, request: Request) -> Response:
        caller = self.auth.caller(request)
        try:
            session_id, file_id, _ = await self._visible_meta(request, caller)
        except FileNotVisibleError:
            # Gone, never there, or not the caller's: all look alike, and all are done.
            return Response(status_code=204)
        await self.files.delete(caller.namespace, session_id, file_id)
        return Response(status_code=204)


def _viewer(request: Request, caller: Caller) -> Viewer:
    kind = request.query_params.get("kind") or None
    resource = request.query_params.get("id") or None
    user = caller.token_user
    if user is None:
        user = resource if kind == "user" else request.headers.get("user-id") or None
    vouched = caller.token_user is not None
    entity = request.query_params.get("entity_id") or None
    return Viewer(user_id=user, kind=kind, resource_id=resource, vouched=vouched, entity_id=entity)


def _too_large(max_bytes: int) -> PayloadTooLargeError:
    """The 413 of an upload past the cap, in words an operator can act on."""
    return PayloadTooLargeError(
        f"the upload is larger than {max_bytes} bytes, the limit "
        "SANDCELL_LIBRECHAT_MAX_UPLOAD_BYTES sets"
    )


def _capped(receive: Receive, max_bytes: int) -> Receive:
    """``receive`` that raises ``_too_large`` once the body passes ``max_bytes``."""
    seen = 0

    async def capped() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > max_bytes:
                raise _too_large(max_bytes)
        return message

    return capped


def _text(value: object) -> str | None:
    return value if isinstance(value, str) and value != "" else None
