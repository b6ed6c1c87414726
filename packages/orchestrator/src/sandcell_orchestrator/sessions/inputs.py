"""Where input objects come from: the orchestrator pushes them to runners (push model).

The runner never holds storage credentials, so the control plane hands the
orchestrator an ``InputSource`` that can read an object by (storage_session,
object_id); the execution path probes the runner's cache and pushes only what
it lacks.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import urllib.parse
from pathlib import Path
from typing import Protocol, runtime_checkable

from sandcell_protocol import ExecuteRequest, FileRef

from ..errors import InputMissingError
from ..handle import SandboxHandle
from ..runner.transfers import InputPayload

__all__ = ["DirectoryInputSource", "InputSource", "deliver_inputs"]


@runtime_checkable
class InputSource(Protocol):
    """Reads input objects by identity."""

    async def read(self, ref: FileRef) -> bytes:
        """The object's bytes, or ``InputMissingError``."""
        ...


class DirectoryInputSource:
    """Objects stored as ``<root>/<storage_session>/<object_id>`` (both URL-quoted)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path_of(self, storage_session: str, object_id: str) -> Path:
        return (
            self.root
            / urllib.parse.quote(storage_session, safe="")
            / urllib.parse.quote(object_id, safe="")
        )

    async def read(self, ref: FileRef) -> bytes:
        path = self.path_of(ref.storage_session, ref.object_id)
        try:
            return await asyncio.to_thread(path.read_bytes)
        except OSError:
            raise InputMissingError(
                f"input {ref.storage_session}/{ref.object_id} (for {ref.name}) not found"
            ) from None

    def store(self, storage_session: str, data: bytes) -> str:
        """Keep ``data`` under a content-derived object id; returns the id (blocking)."""
        object_id = hashlib.sha256(data).hexdigest()
        path = self.path_of(storage_session, object_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            temp = path.with_name(f".{object_id}.{os.getpid()}.tmp")
            temp.write_bytes(data)
            temp.replace(path)
        return object_id


async def deliver_inputs(
    handle: SandboxHandle,
    request: ExecuteRequest,
    *,
    session_id: str | None,
    source: InputSource | None,
) -> None:
    """Probe the runner's input cache and push only the objects it lacks.

    Without a ``source`` nothing is pushed: the runner then reports
    ``input_missing`` naming the ref.
    """
    if not request.files:
        return
    missing = await handle.runner.probe_inputs(request.files, session_id=session_id)
    if not missing or source is None:
        return
    payloads: dict[tuple[str, str], InputPayload] = {}
    for ref in missing:
        key = (ref.storage_session, ref.object_id)
        if key not in payloads:
            payloads[key] = InputPayload(
                storage_session=ref.storage_session,
                object_id=ref.object_id,
                data=await source.read(ref),
                read_only=ref.read_only,
            )
    await handle.runner.push_inputs(list(payloads.values()), session_id=session_id)
