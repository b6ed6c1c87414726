"""The bound session's files as the file routes see them: list, read, write, remove.

Each call takes the session lock (a job never runs while a file changes under it)
and goes through ``fsops``, which never follows a link the job planted. Paths are
validated workspace paths (``""`` is the workspace itself); the blocking work
runs in a thread.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import stat
from pathlib import Path

from sandcell_protocol import FileEntry, FileListing, SurfacedOutput, escape_name

from ..errors import BadRequestError, InvalidPathError, NotFoundError
from . import fsops
from .session import SessionManager


class SessionFiles:
    """File operations on the bound session's workspace, each under the session lock."""

    def __init__(self, sessions: SessionManager, *, max_read_bytes: int) -> None:
        self._sessions = sessions
        self._max_read_bytes = max_read_bytes

    async def get(self, session_id: str, relpath: str) -> FileListing | bytes:
        """A directory's listing, or a regular file's bytes (at most ``max_read_bytes``)."""
        async with self._sessions.locked(session_id) as state:
            try:
                if relpath == "":
                    return await asyncio.to_thread(_list_dir, state.workspace, "")
                *parents, name = relpath.split("/")
                st = await asyncio.to_thread(_lstat_at, state.workspace, parents, name)
                if stat.S_ISDIR(st.st_mode):
                    return await asyncio.to_thread(_list_dir, state.workspace, relpath)
                return await asyncio.to_thread(
                    fsops.read_file, state.workspace, relpath, max_bytes=self._max_read_bytes
                )
            except FileNotFoundError:
                raise NotFoundError(f"no such file: {relpath}") from None
            except fsops.UnsafePathError as exc:
                raise InvalidPathError(str(exc.strerror or exc)) from None

    async def put(self, session_id: str, relpath: str, data: bytes, *, mode: int) -> FileEntry:
        """Write a file as the session's UID; the caller has seen it, so it is not an output."""
        async with self._sessions.locked(session_id) as state:
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
        return _entry(relpath.rsplit("/", 1)[-1], st)

    async def remove(self, session_id: str, relpath: str) -> None:
        """Remove a file or a directory tree; ``NotFoundError`` when nothing was there."""
        async with self._sessions.locked(session_id) as state:
            try:
                removed = await asyncio.to_thread(fsops.remove_path, state.workspace, relpath)
            except fsops.UnsafePathError as exc:
                raise InvalidPathError(str(exc.strerror or exc)) from None
        if not removed:
            raise NotFoundError(f"no such file: {relpath}")


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
            target = None
            if stat.S_ISLNK(st.st_mode):
                target = escape_name(os.readlink(os.fsencode(item.name), dir_fd=dir_fd))
            # A name that is not UTF-8 is listed escaped (sandcell_protocol.names).
            entries.append(_entry(escape_name(os.fsencode(item.name)), st, target))
    return FileListing(path=relpath, entries=sorted(entries, key=lambda e: e.name))


def _lstat_at(root: Path, parents: list[str], name: str) -> os.stat_result:
    with fsops.open_dir(root, parents) as dir_fd:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)


__all__ = ["SessionFiles"]
