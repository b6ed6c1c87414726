"""Where input objects come from: the orchestrator pushes them to runners (push model).

The runner never holds storage credentials, so the control plane hands the
orchestrator an ``InputSource`` that can read an object by (storage_session,
object_id); the execution path probes the runner's cache and pushes only what
it lacks.

Every ref is scoped before it is resolved: ``scope_inputs`` replaces each ref's
``storage_session`` by ``scoped_storage_session(namespace, ...)`` (the protocol's
one rule, which also validates both parts), so sources, runners and the runner's
file-server pull only ever see the caller's own namespace. Another tenant's
object is then simply not there: it answers ``input_missing`` like any missing one.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import os
import stat
from pathlib import Path
from typing import Protocol, runtime_checkable

import msgspec

from sandcell_protocol import (
    ExecuteRequest,
    FileRef,
    scoped_storage_session,
    validate_input_ref,
)

from ..errors import InputMissingError
from ..handle import SandboxHandle
from ..runner.transfers import InputPayload

__all__ = ["DirectoryInputSource", "InputSource", "deliver_inputs", "scope_inputs"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO planted under a name cannot hang the worker thread in open().
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


@runtime_checkable
class InputSource(Protocol):
    """Reads input objects by identity.

    ``ref.storage_session`` is already scoped to the caller's namespace (see
    ``scope_inputs``); a source must resolve it beneath its own root only.
    """

    async def read(self, ref: FileRef) -> bytes:
        """The object's bytes, or ``InputMissingError``."""
        ...


def scope_inputs(request: ExecuteRequest, namespace: str) -> ExecuteRequest:
    """``request`` with every ref validated and scoped to ``namespace``.

    ``ProtocolError`` (a 400) names the first refused field; values never reach a path.
    """
    if not request.files:
        return request
    scoped = []
    for ref in request.files:
        validate_input_ref(ref.storage_session, ref.object_id)
        scoped.append(
            msgspec.structs.replace(
                ref, storage_session=scoped_storage_session(namespace, ref.storage_session)
            )
        )
    return msgspec.structs.replace(request, files=scoped)


def _missing(ref: FileRef) -> InputMissingError:
    # The same words whether the object is absent or another tenant's.
    return InputMissingError(f"input {ref.object_id} (for {ref.name}) not found")


class DirectoryInputSource:
    """Objects stored as ``<root>/<scoped storage_session>/<object_id>``.

    Both parts pass ``validate_input_ref`` before use, and each step beneath the
    root is opened with ``O_NOFOLLOW`` relative to its parent: a link planted in
    the store is never followed, so nothing outside the root can be read.
    """

    def __init__(self, root: Path) -> None:
        self.root = root

    def __repr__(self) -> str:
        return f"DirectoryInputSource(root={str(self.root)!r})"

    async def read(self, ref: FileRef) -> bytes:
        validate_input_ref(ref.storage_session, ref.object_id)
        try:
            return await asyncio.to_thread(
                _read_beneath, self.root, ref.storage_session, ref.object_id
            )
        except OSError:
            raise _missing(ref) from None

    def store(self, storage_session: str, data: bytes) -> str:
        """Keep ``data`` under a content-derived object id; returns the id (blocking).

        ``storage_session`` is the scoped one (``scoped_storage_session``).
        """
        object_id = hashlib.sha256(data).hexdigest()
        validate_input_ref(storage_session, object_id)
        self.root.mkdir(parents=True, exist_ok=True)
        root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(storage_session, 0o700, dir_fd=root_fd)
            dir_fd = os.open(storage_session, _DIR_FLAGS, dir_fd=root_fd)
        finally:
            os.close(root_fd)
        try:
            if _exists(dir_fd, object_id):
                return object_id
            temp = f".{object_id}.{os.getpid()}.tmp"
            fd = os.open(
                temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600, dir_fd=dir_fd
            )
            with open(fd, "wb") as out:
                out.write(data)
            os.rename(temp, object_id, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
        return object_id


def _exists(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _read_beneath(root: Path, storage_session: str, object_id: str) -> bytes:
    """The regular file ``root/storage_session/object_id``, no link followed (blocking)."""
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        dir_fd = os.open(storage_session, _DIR_FLAGS, dir_fd=root_fd)
    finally:
        os.close(root_fd)
    try:
        fd = os.open(object_id, _FILE_FLAGS, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    with open(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
            raise FileNotFoundError(errno.ENOENT, "not a regular file")
        return file.read()


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
