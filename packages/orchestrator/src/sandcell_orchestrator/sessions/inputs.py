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
import secrets
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

__all__ = [
    "DirectoryInputSource",
    "InputSource",
    "InputStore",
    "deliver_inputs",
    "scope_inputs",
]

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


@runtime_checkable
class InputStore(InputSource, Protocol):
    """An ``InputSource`` that API adapters can also write (uploads, kept outputs).

    Every ``storage_session`` is the scoped one (``scoped_storage_session``); both
    parts must pass ``validate_input_ref``, or ``ProtocolError``.
    """

    async def write(self, storage_session: str, object_id: str, data: bytes) -> None:
        """Store ``data`` under the pair, replacing any previous object atomically."""
        ...

    async def fetch(self, storage_session: str, object_id: str) -> bytes | None:
        """The object's bytes, or ``None`` when there is none."""
        ...

    async def names(self, storage_session: str) -> list[str]:
        """The object ids stored under ``storage_session``, sorted."""
        ...

    async def remove(self, storage_session: str, object_id: str) -> None:
        """Delete the object; quiet when it is already gone."""
        ...


class DirectoryInputSource:
    """Objects stored as ``<root>/<scoped storage_session>/<object_id>``; an ``InputStore``.

    Both parts pass ``validate_input_ref`` before use, and each step beneath the
    root is opened with ``O_NOFOLLOW`` relative to its parent: a link planted in
    the store is never followed, so nothing outside the root can be read.
    """

    def __init__(self, root: Path) -> None:
        self.root = root

    def __repr__(self) -> str:
        return f"DirectoryInputSource(root={str(self.root)!r})"

    async def read(self, ref: FileRef) -> bytes:
        data = await self.fetch(ref.storage_session, ref.object_id)
        if data is None:
            raise _missing(ref)
        return data

    async def fetch(self, storage_session: str, object_id: str) -> bytes | None:
        validate_input_ref(storage_session, object_id)
        try:
            return await asyncio.to_thread(_read_beneath, self.root, storage_session, object_id)
        except OSError:
            return None

    async def write(self, storage_session: str, object_id: str, data: bytes) -> None:
        validate_input_ref(storage_session, object_id)
        await asyncio.to_thread(self._write, storage_session, object_id, data, replace=True)

    async def names(self, storage_session: str) -> list[str]:
        validate_input_ref(storage_session, "x")
        return await asyncio.to_thread(_names_beneath, self.root, storage_session)

    async def remove(self, storage_session: str, object_id: str) -> None:
        validate_input_ref(storage_session, object_id)
        await asyncio.to_thread(_remove_beneath, self.root, storage_session, object_id)

    def store(self, storage_session: str, data: bytes) -> str:
        """Keep ``data`` under a content-derived object id; returns the id (blocking).

        ``storage_session`` is the scoped one (``scoped_storage_session``).
        """
        object_id = hashlib.sha256(data).hexdigest()
        validate_input_ref(storage_session, object_id)
        self._write(storage_session, object_id, data, replace=False)
        return object_id

    def _write(self, storage_session: str, object_id: str, data: bytes, *, replace: bool) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(storage_session, 0o700, dir_fd=root_fd)
            dir_fd = os.open(storage_session, _DIR_FLAGS, dir_fd=root_fd)
        finally:
            os.close(root_fd)
        try:
            if not replace and _exists(dir_fd, object_id):
                return
            temp = f".{object_id}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
            fd = os.open(
                temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dir_fd
            )
            try:
                with open(fd, "wb") as out:
                    out.write(data)
                os.rename(temp, object_id, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(temp, dir_fd=dir_fd)
                raise
        finally:
            os.close(dir_fd)


def _exists(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _open_session_dir(root: Path, storage_session: str) -> int:
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return os.open(storage_session, _DIR_FLAGS, dir_fd=root_fd)
    finally:
        os.close(root_fd)


def _read_beneath(root: Path, storage_session: str, object_id: str) -> bytes:
    """The regular file ``root/storage_session/object_id``, no link followed (blocking)."""
    dir_fd = _open_session_dir(root, storage_session)
    try:
        fd = os.open(object_id, _FILE_FLAGS, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    with open(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
            raise FileNotFoundError(errno.ENOENT, "not a regular file")
        return file.read()


def _names_beneath(root: Path, storage_session: str) -> list[str]:
    try:
        dir_fd = _open_session_dir(root, storage_session)
    except OSError:
        return []
    try:
        names = []
        for name in os.listdir(dir_fd):
            if name.startswith("."):
                continue
            with contextlib.suppress(OSError):
                if stat.S_ISREG(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
                    names.append(name)
        return sorted(names)
    finally:
        os.close(dir_fd)


def _remove_beneath(root: Path, storage_session: str, object_id: str) -> None:
    try:
        dir_fd = _open_session_dir(root, storage_session)
    except OSError:
        return
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(object_id, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)


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
