"""A run's ``files[]``: each ref checked and resolved to where its bytes are kept.

Shared by ``/exec`` and ``/exec/programmatic``. A ref's storage session, id and
name are validated before any sandbox is held, and the file is looked up in the
caller's namespace only: absent, another tenant's, or (for a token's user) one
that user may not download all answer the same ``InputMissingError``.
"""

from __future__ import annotations

from dataclasses import dataclass

from sandcell_protocol import FileRef, ProtocolError, validate_workspace_path

from ...errors import InputMissingError
from .auth import Caller
from .files import LibreChatFiles, Viewer, visible
from .ids import require_nanoid
from .wire import InFile

__all__ = ["ResolvedInput", "refs_of", "resolve_inputs"]


@dataclass(frozen=True, slots=True)
class ResolvedInput:
    """A ``files[]`` ref as resolved: the wire's, and where its bytes are."""

    wire: InFile
    storage: str
    read_only: bool


async def resolve_inputs(
    files: LibreChatFiles, caller: Caller, items: list[InFile] | None
) -> list[ResolvedInput]:
    """Every ref of ``items`` resolved, in order (the first bad one raises)."""
    return [await _resolve_input(files, caller, item) for item in items or []]


def refs_of(inputs: list[ResolvedInput]) -> list[FileRef]:
    """The runner's ``FileRef`` of each resolved input."""
    return [
        FileRef(
            storage_session=item.storage,
            object_id=item.wire.id,
            name=item.wire.name,
            read_only=item.read_only,
        )
        for item in inputs
    ]


async def _resolve_input(files: LibreChatFiles, caller: Caller, item: InFile) -> ResolvedInput:
    storage = item.storage
    if storage is None:
        raise ProtocolError("files[]: a ref needs storage_session_id (or session_id)")
    require_nanoid("files[].storage_session_id", storage)
    require_nanoid("files[].id", item.id)
    try:
        # Checked here, before a sandbox is held for the call, by the protocol's
        # one rule for workspace paths (the runner applies it again).
        validate_workspace_path(item.name)
    except ProtocolError as exc:
        raise ProtocolError(f"files[].name {item.name[:100]!r}: {exc}") from exc
    meta = await files.meta(caller.namespace, storage, item.id)
    viewer = Viewer(
        user_id=caller.token_user, kind=item.kind, resource_id=item.resource_id, vouched=True
    )
    if meta is None or (caller.token_user is not None and not visible(meta, viewer)):
        # Absent, another tenant's, or (for a token's user, whom the token vouches
        # for) one that user may not download: the same words either way.
        missing = f"input {item.id} (for {item.name}) not found"
        raise InputMissingError(missing, public_detail=missing)
    return ResolvedInput(wire=item, storage=storage, read_only=meta.read_only)
