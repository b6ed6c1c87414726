"""LibreChat's files on the process's ``InputStore``: uploads and the outputs of runs.

A file is the object ``(scoped storage_session_id, file id)``, which is exactly
what an exec's ``files[]`` ref names, so uploads are primed like any input, and
a sidecar object ``<file id>.meta`` (a nanoid has no dot, so no file is ever
named so) holding ``FileMeta``. Every lookup is scoped to the caller's
namespace first; who within the namespace may see a file is ``visible``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from datetime import UTC, datetime

import msgspec

from sandcell_protocol import scoped_storage_session

from ...sessions.inputs import InputStore

__all__ = ["FileKind", "FileMeta", "LibreChatFiles", "Viewer", "visible"]

FileKind = str
"""``user`` (private to its user), ``agent`` or ``skill`` (shared per resource)."""
SHARED_KINDS = frozenset({"agent", "skill"})
_META_SUFFIX = ".meta"


class FileMeta(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What is kept beside a file's bytes."""

    filename: str
    user_id: str | None
    """Who uploaded or produced it (``None``: a caller that named no user)."""
    kind: FileKind = "user"
    resource_id: str | None = None
    version: int | None = None
    read_only: bool = False
    size: int
    sha256: str
    modified_at: str
    """ISO 8601, UTC, to the millisecond: ``2026-01-02T03:04:05.678Z``, as a JavaScript
    ``Date`` serializes (LibreChat's server reads it back with ``new Date(...)``)."""


class Viewer(msgspec.Struct, frozen=True, kw_only=True):
    """Who asks to see a file: the caller's user and the query's ``kind``/``id``."""

    user_id: str | None
    kind: str | None = None
    resource_id: str | None = None
    vouched: bool = False
    """The user is a verified token's (not one an API-key caller named)."""
    entity_id: str | None = None
    """An older LibreChat's ``?entity_id=`` (an agent's id): names that agent's files
    as ``kind=agent&id=`` does, beside whatever else the viewer may see."""


def visible(meta: FileMeta, viewer: Viewer) -> bool:
    """Whether ``viewer`` (already inside the file's namespace) may see the file.

    A shared kind is visible to whoever names its resource (LibreChat sends
    ``kind``/``id`` for agent and skill files) and to its uploader; a user file only
    to its user. A caller that names no user at all (a legacy client with only an
    API key) sees its namespace's files, as the legacy contract had it; and a file
    whose maker named no user (an API-key programmatic run: the client sends no user)
    is its namespace's, seen by any user an API-key caller names (that caller could name
    any), never by a token's user. An ``entity_id`` only adds its agent's files: it never
    hides what the viewer sees without it, and (the namespace coming first) never
    reaches another tenant's.
    """
    if (
        viewer.entity_id is not None
        and meta.kind == "agent"
        and meta.resource_id == viewer.entity_id
    ):
        return True
    if (
        meta.kind in SHARED_KINDS
        and viewer.kind == meta.kind
        and viewer.resource_id is not None
        and viewer.resource_id == meta.resource_id
    ):
        return True
    if viewer.user_id is None:
        return viewer.kind is None
    if meta.user_id is None:
        return not viewer.vouched
    return meta.user_id == viewer.user_id


class LibreChatFiles:
    """Files of one process, scoped per namespace, over an ``InputStore``."""

    def __init__(self, store: InputStore, *, clock: Callable[[], datetime] | None = None) -> None:
        self._store = store
        self._clock = clock or (lambda: datetime.now(UTC))

    async def put(
        self,
        namespace: str,
        storage_session_id: str,
        file_id: str,
        data: bytes,
        *,
        filename: str,
        user_id: str | None,
        kind: FileKind = "user",
        resource_id: str | None = None,
        version: int | None = None,
        read_only: bool = False,
    ) -> FileMeta:
        """Keep ``data`` and its ``FileMeta``; the bytes first, so a file with meta is whole."""
        scoped = scoped_storage_session(namespace, storage_session_id)
        meta = FileMeta(
            filename=filename,
            user_id=user_id,
            kind=kind,
            resource_id=resource_id,
            version=version,
            read_only=read_only,
            size=len(data),
            sha256=hashlib.sha256(data).hexdigest(),
            modified_at=self._clock().isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        )
        await self._store.write(scoped, file_id, data)
        await self._store.write(scoped, file_id + _META_SUFFIX, msgspec.json.encode(meta))
        return meta

    async def meta(self, namespace: str, storage_session_id: str, file_id: str) -> FileMeta | None:
        """The file's ``FileMeta``, or ``None`` when the namespace has no such file."""
        scoped = scoped_storage_session(namespace, storage_session_id)
        raw = await self._store.fetch(scoped, file_id + _META_SUFFIX)
        if raw is None:
            return None
        try:
            return msgspec.json.decode(raw, type=FileMeta)
        except msgspec.MsgspecError:
            return None

    async def read(self, namespace: str, storage_session_id: str, file_id: str) -> bytes | None:
        """The file's bytes, or ``None``."""
        scoped = scoped_storage_session(namespace, storage_session_id)
        return await self._store.fetch(scoped, file_id)

    async def list(self, namespace: str, storage_session_id: str) -> list[tuple[str, FileMeta]]:
        """``(file id, meta)`` of every file under the storage session, by id."""
        scoped = scoped_storage_session(namespace, storage_session_id)
        found = []
        for name in await self._store.names(scoped):
            if not name.endswith(_META_SUFFIX):
                continue
            file_id = name[: -len(_META_SUFFIX)]
            meta = await self.meta(namespace, storage_session_id, file_id)
            if meta is not None:
                found.append((file_id, meta))
        return found

    async def delete(self, namespace: str, storage_session_id: str, file_id: str) -> None:
        """Remove the file and its meta (meta first: a half-deleted file is simply gone)."""
        scoped = scoped_storage_session(namespace, storage_session_id)
        await self._store.remove(scoped, file_id + _META_SUFFIX)
        await self._store.remove(scoped, file_id)
