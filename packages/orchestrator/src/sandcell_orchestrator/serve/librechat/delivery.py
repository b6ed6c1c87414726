"""A run's outputs delivered: kept as files of a storage session, named in its answer.

Shared by ``/exec`` and ``/exec/programmatic``. ``kept_outputs`` starts a run's
collector (``outputs.KeptOutputs``, within the run's byte cap); ``keep_outputs``
stores what was collected under the answer's ``session_id`` and says, in
``artifact_delivery``, which outputs could not be kept and why; ``drop_outputs``
removes what a run stored when no answer will name it (a run that failed).
"""

from __future__ import annotations

import base64
import contextlib

import anyio

from sandcell_protocol import OutputFile

from .api import LibreChatApi
from .auth import Caller
from .inputs import ResolvedInput
from .outputs import DELIVERY_FAILED_CODE, READ_FAILED_CODE, KeptOutputs, Refusal
from .wire import ModifiedFrom, OutFile

__all__ = ["Delivered", "drop_outputs", "keep_outputs", "kept_outputs"]

Delivered = tuple[list[OutFile], dict[str, object] | None]
"""An answer's ``files`` and its ``artifact_delivery`` (``None``: all were kept)."""


def kept_outputs(api: LibreChatApi, inputs: list[ResolvedInput]) -> KeptOutputs:
    """A run's collector of outputs (``outputs.KeptOutputs``), within the byte cap."""
    return KeptOutputs(
        max_bytes=api.settings.max_output_bytes,
        skip=frozenset(item.wire.name for item in inputs if item.read_only),
        metrics=api.metrics,
    )


async def keep_outputs(
    api: LibreChatApi,
    caller: Caller,
    user: str | None,
    session_id: str,
    outputs: list[OutputFile],
    inputs: list[ResolvedInput],
    kept: KeptOutputs,
) -> Delivered:
    """Store ``outputs`` under ``session_id``: the answer's ``files`` and, when some
    could not be kept (over the run's byte cap, or unreadable), its
    ``artifact_delivery``. ``kept`` holds what was read from the sandbox."""
    by_name = {item.wire.name: item for item in inputs}
    files: list[OutFile] = []
    attempted = 0
    errors: list[dict[str, str]] = []
    for output in outputs:
        if output.symlink_target is not None:
            continue
        source = by_name.get(output.name)
        if source is not None and source.read_only:
            # Read-only inputs are the caller's own: echoed, never replaced.
            files.append(
                OutFile(
                    id=source.wire.id,
                    name=source.wire.name,
                    storage_session_id=source.storage,
                    inherited=True,
                )
            )
            continue
        attempted += 1
        data = _bytes_of(output, kept)
        if data is None:
            refusal = kept.refusal(output) or Refusal(READ_FAILED_CODE, "it was not read")
            errors.append({"name": output.name, "code": refusal.code, "message": refusal.message})
            continue
        file_id = api.new_id()
        files.append(
            OutFile(
                id=file_id,
                name=output.name,
                storage_session_id=session_id,
                path=f"/mnt/data/{output.name}",
                modified_from=(
                    ModifiedFrom(id=source.wire.id, storage_session_id=source.storage)
                    if source is not None
                    else None
                ),
            )
        )
        try:
            await api.files.put(
                caller.namespace, session_id, file_id, data, filename=output.name, user_id=user
            )
        except BaseException:
            # Part way (a store that failed, a run cancelled): what this call stored,
            # the failed put's bytes included, is named by no answer.
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await _delete_kept(api, caller, session_id, files)
            raise
    delivery: dict[str, object] | None = None
    if errors:
        # The summary's code is the one the client reads (any other makes it drop the
        # whole summary, and the model is never warned); each error keeps its reason.
        delivery = {
            "code": DELIVERY_FAILED_CODE,
            "status": "failed" if len(errors) == attempted else "partial",
            "attempted": attempted,
            "delivered": attempted - len(errors),
            "failed": len(errors),
            "errors": errors,
        }
    return files, delivery


async def drop_outputs(
    api: LibreChatApi, caller: Caller, session_id: str, outputs: list[Delivered]
) -> None:
    """Remove a run's kept outputs that no answer names (a run that failed)."""
    for files, _ in outputs:
        await _delete_kept(api, caller, session_id, files)


async def _delete_kept(
    api: LibreChatApi, caller: Caller, session_id: str, files: list[OutFile]
) -> None:
    for file in files:
        if not file.inherited:
            await api.files.delete(caller.namespace, session_id, file.id)


def _bytes_of(output: OutputFile, kept: KeptOutputs) -> bytes | None:
    """The output's bytes as kept: inline, read from the sandbox, or None (refused)."""
    if kept.refusal(output) is not None:
        return None
    if output.content_b64 is not None:
        return base64.b64decode(output.content_b64)
    if output.size == 0:
        return b""
    return kept.bytes_of(output)
