"""The wire of LibreChat's Code Interpreter API: request and answer shapes.

Requests are not ``forbid_unknown_fields``: ``@librechat/agents`` spreads its tool
factory's parameters (and the model's extra arguments) into the exec body, so a
field a later client adds must not break a drop-in backend. Every value that is
used is typed and checked; everything else is ignored. Answers are built from
frozen structs and carry exactly the contract's fields.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

__all__ = [
    "ExecAnswer",
    "ExecBody",
    "FileEntry",
    "InFile",
    "ModifiedFrom",
    "ObjectInfo",
    "OutFile",
    "UploadAnswer",
    "UploadedFile",
]

NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]


class InFile(msgspec.Struct, frozen=True, kw_only=True):
    """A ``files[]`` ref: current ``{id, resource_id, name, storage_session_id, kind,
    version?}`` or legacy ``{id, name, session_id}``."""

    id: str
    name: str
    storage_session_id: str | None = None
    session_id: str | None = None
    resource_id: str | None = None
    kind: str | None = None
    version: int | None = None

    @property
    def storage(self) -> str | None:
        """Where the bytes live: the current field, else the legacy one."""
        return self.storage_session_id if self.storage_session_id is not None else self.session_id


class ExecBody(msgspec.Struct, frozen=True, kw_only=True):
    """``POST /exec``."""

    lang: str
    code: str
    args: list[str] | None = None
    user_id: str | None = None
    files: list[InFile] | None = None
    runtime_session_hint: str | None = None
    timeout: NonNegativeInt | None = None
    """Milliseconds."""
    session_id: str | None = None
    LIBRECHAT_CODE_API_KEY: str | None = msgspec.field(default=None)
    """Legacy clients copy the API key into the body. Never logged or echoed."""

    def __repr__(self) -> str:
        return f"ExecBody(lang={self.lang!r}, files={len(self.files or [])})"


class ModifiedFrom(msgspec.Struct, frozen=True, kw_only=True):
    """The input an output replaces."""

    id: str
    storage_session_id: str


class OutFile(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One file of an exec answer."""

    id: str
    name: str
    storage_session_id: str
    path: str | None = None
    modified_from: ModifiedFrom | None = None
    inherited: bool | None = None


class ExecAnswer(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The answer to ``POST /exec``."""

    session_id: str
    stdout: str
    stderr: str
    files: list[OutFile]
    code: int | None = None
    signal: str | None = None
    status: str | None = None
    wall_time: float | None = None
    """Seconds."""
    runtime_session_id: str | None = None
    runtime_status: str | None = None
    """With ``runtime_session_id``: ``new`` (no session before this call) or ``reused``."""
    artifact_delivery: dict[str, object] | None = None
    deleted_files: list[str] | None = None
    """Input names the job removed (the client drops them from its session)."""


class UploadedFile(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One file of an upload answer (``status``/``error`` in batch answers only)."""

    fileId: str | None
    filename: str
    status: str | None = None
    error: str | None = None


class UploadAnswer(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """``POST /upload`` (``storage_session_id``; legacy clients get ``session_id``) and
    ``POST /upload/batch`` (adds ``succeeded``/``failed``)."""

    message: str
    files: list[UploadedFile]
    storage_session_id: str | None = None
    session_id: str | None = None
    succeeded: int | None = None
    failed: int | None = None


class FileEntry(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One entry of ``GET /files/{session_id}``."""

    name: str
    """``<session_id>/<file id>``: legacy clients read the id back from it."""
    id: str
    storage_session_id: str
    metadata: dict[str, str]
    size: int | None = None
    lastModified: str | None = None
    etag: str | None = None


class ObjectInfo(msgspec.Struct, frozen=True, kw_only=True):
    """``GET /sessions/{session_id}/objects/{fileId}``."""

    lastModified: str
    size: int
    etag: str
