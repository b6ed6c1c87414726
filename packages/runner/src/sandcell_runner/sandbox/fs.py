"""Filesystem calls on the session workspace for envd-style APIs: stat, mkdir, move, list, remove.

Blocking (run them in a thread). Every path is a sandbox path (``sandbox_path``:
``/home/user/…`` or relative to it) walked with ``fsops.open_dir``: one component
at a time from a directory fd with ``O_NOFOLLOW``, so a link a job planted is
reported, never followed, and nothing outside the workspace is reached. New
directories belong to the session's UID. Listings are bounded (``max_entries``):
a job's million files cannot make one call unbounded work.
"""

from __future__ import annotations

import heapq
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from sandcell_protocol import ProtocolError, escape_name
from sandcell_protocol import sandbox_messages as sm

from ..errors import BadRequestError, InvalidPathError, NotFoundError
from ..workspace import fsops

MAX_ENTRIES = 10_000
MAX_DEPTH = 64


def _parts(raw: str) -> list[str]:
    try:
        relative = sm.sandbox_path(raw)
    except ProtocolError as exc:
        raise InvalidPathError(str(exc)) from None
    return relative.split("/") if relative else []


def _kind(mode: int) -> sm.EntryType:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "other"


class WorkspaceFs:
    """The filesystem calls of one workspace owned by ``uid``."""

    def __init__(self, root: Path, *, uid: int, max_entries: int = MAX_ENTRIES) -> None:
        self.root = root
        self.uid = uid
        self.max_entries = max_entries

    def _owner(self, ident: int) -> str:
        return "user" if ident == self.uid else str(ident)

    def _entry(self, parts: list[str], st: os.stat_result, dir_fd: int | None) -> sm.EntryInfo:
        relative = "/".join(parts)
        target = None
        if stat.S_ISLNK(st.st_mode) and dir_fd is not None:
            target = escape_name(os.readlink(os.fsencode(parts[-1]), dir_fd=dir_fd))
        return sm.EntryInfo(
            name=parts[-1] if parts else "user",
            type=_kind(st.st_mode),
            path=sm.sandbox_display_path(relative),
            size=st.st_size,
            mode=stat.S_IMODE(st.st_mode),
            permissions=stat.filemode(st.st_mode),
            owner=self._owner(st.st_uid),
            group=self._owner(st.st_gid),
            modified_time_ns=st.st_mtime_ns,
            symlink_target=target,
        )

    def _stat(self, parts: list[str]) -> sm.EntryInfo:
        if not parts:
            return self._entry([], os.stat(self.root, follow_symlinks=False), None)
        try:
            with fsops.open_dir(self.root, parts[:-1]) as fd:
                st = os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
                return self._entry(parts, st, fd)
        except (FileNotFoundError, NotADirectoryError, fsops.UnsafePathError):
            raise NotFoundError(f"path /home/user/{'/'.join(parts)[:200]} not found") from None

    def stat(self, raw: str) -> sm.FsResult:
        return sm.FsResult(entry=self._stat(_parts(raw)))

    def make_dir(self, raw: str) -> sm.FsResult:
        """Create the directory and its parents; ``created`` false if it was there."""
        parts = _parts(raw)
        if not parts:
            return sm.FsResult(entry=self._stat([]), created=False)
        try:
            with fsops.open_dir(
                self.root, parts[:-1], create=True, uid=self.uid, gid=self.uid
            ) as fd:
                try:
                    os.mkdir(parts[-1], 0o755, dir_fd=fd)
                except FileExistsError:
                    st = os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
                    if not stat.S_ISDIR(st.st_mode):
                        raise BadRequestError(
                            f"{raw[:200]!r} exists and is not a directory"
                        ) from None
                    return sm.FsResult(entry=self._entry(parts, st, fd), created=False)
                os.chown(parts[-1], self.uid, self.uid, dir_fd=fd, follow_symlinks=False)
                st = os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
                return sm.FsResult(entry=self._entry(parts, st, fd), created=True)
        except (NotADirectoryError, fsops.UnsafePathError):
            raise InvalidPathError(f"{raw[:200]!r}: a parent is not a plain directory") from None

    def move(self, source: str, destination: str) -> sm.FsResult:
        """Rename ``source`` to ``destination`` (parents of the destination are created)."""
        src, dst = _parts(source), _parts(destination)
        if not src or not dst:
            raise BadRequestError("move: the home directory itself cannot be moved or replaced")
        if dst[: len(src)] == src:
            raise BadRequestError("move: a directory cannot move into itself")
        try:
            with (
                fsops.open_dir(self.root, src[:-1]) as src_fd,
                fsops.open_dir(
                    self.root, dst[:-1], create=True, uid=self.uid, gid=self.uid
                ) as dst_fd,
            ):
                os.rename(src[-1], dst[-1], src_dir_fd=src_fd, dst_dir_fd=dst_fd)
                st = os.stat(dst[-1], dir_fd=dst_fd, follow_symlinks=False)
                return sm.FsResult(entry=self._entry(dst, st, dst_fd))
        except FileNotFoundError:
            raise NotFoundError(f"path {source[:200]!r} not found") from None
        except (NotADirectoryError, IsADirectoryError, fsops.UnsafePathError) as exc:
            raise InvalidPathError(f"move: {exc.strerror or exc}") from None
        except OSError as exc:
            raise BadRequestError(f"move: {exc.strerror or exc}") from None

    def remove(self, raw: str) -> sm.FsResult:
        parts = _parts(raw)
        if not parts:
            raise BadRequestError("remove: the home directory itself cannot be removed")
        try:
            removed = fsops.remove_path(self.root, "/".join(parts))
        except (NotADirectoryError, fsops.UnsafePathError):
            removed = False
        if not removed:
            raise NotFoundError(f"path {raw[:200]!r} not found")
        return sm.FsResult()

    def list_dir(self, raw: str, *, depth: int) -> sm.FsResult:
        """Entries under ``raw`` down to ``depth`` levels, breadth first, links not followed."""
        parts = _parts(raw)
        if self._stat(parts).type != "dir":
            raise InvalidPathError(f"{raw[:200]!r} is not a directory")
        return sm.FsResult(entries=list(self._walk(parts, min(depth, MAX_DEPTH))))

    def snapshot(self, raw: str, *, recursive: bool) -> sm.FsResult:
        """What a polling watcher compares: every entry (``recursive``) or the direct ones."""
        parts = _parts(raw)
        if self._stat(parts).type != "dir":
            raise InvalidPathError(f"{raw[:200]!r} is not a directory")
        return sm.FsResult(entries=list(self._walk(parts, MAX_DEPTH if recursive else 1)))

    def _walk(self, parts: list[str], depth: int) -> Iterator[sm.EntryInfo]:
        count = 0
        queue = [(parts, 1)]
        while queue:
            here, level = queue.pop(0)
            try:
                with fsops.open_dir(self.root, here) as fd:
                    for name in _first_names(fd, self.max_entries - count + 1):
                        try:
                            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                        except FileNotFoundError:
                            continue
                        child = [*here, name]
                        count += 1
                        if count > self.max_entries:
                            raise BadRequestError(
                                f"more than {self.max_entries} entries; list a smaller tree"
                            )
                        yield self._entry(child, st, fd)
                        if stat.S_ISDIR(st.st_mode) and level < depth:
                            queue.append((child, level + 1))
            except (FileNotFoundError, NotADirectoryError, fsops.UnsafePathError):
                continue


def _first_names(fd: int, wanted: int) -> Iterator[str]:
    """A directory's names in order, at most ``wanted`` held at once. The caller may
    take ``wanted - 1`` more entries and fails at the next, so a directory of 200,000
    names is never read into one sorted list (about 40 MB, per list and per poll). A
    batch the caller uses up without failing (entries gone before their stat) is
    followed by the next ``wanted`` names after it."""
    after: str | None = None
    while True:
        with os.scandir(fd) as listing:
            names = (item.name for item in listing)
            later = names if after is None else (name for name in names if name > after)
            batch = heapq.nsmallest(wanted, later)
        yield from batch
        if len(batch) < wanted:
            return
        after = batch[-1]


def run_fs(fs: WorkspaceFs, request: sm.FsRequest) -> sm.FsResult:
    """One ``FsRequest`` (blocking)."""
    if isinstance(request, sm.FsStat):
        return fs.stat(request.path)
    if isinstance(request, sm.FsMakeDir):
        return fs.make_dir(request.path)
    if isinstance(request, sm.FsMove):
        return fs.move(request.source, request.destination)
    if isinstance(request, sm.FsListDir):
        return fs.list_dir(request.path, depth=request.depth)
    if isinstance(request, sm.FsRemove):
        return fs.remove(request.path)
    return fs.snapshot(request.path, recursive=request.recursive)


__all__ = ["MAX_ENTRIES", "WorkspaceFs", "run_fs"]
