"""Writing an archive's members beneath the staging directory, by descriptor only.

``DirStack`` holds open the directories on the path of the last member written;
every entry is created with ``*at()`` calls relative to a directory fd opened
with O_NOFOLLOW (leaves with O_EXCL), so no path is ever resolved through a
symlink an earlier member planted. ``extractor.py`` walks the archive and checks
each member before it gets here.
"""

from __future__ import annotations

import contextlib
import errno
import os
from typing import NamedTuple

from ..errors import ArchiveRejectedError
from .archive_rules import shown

__all__ = ["Attrs", "DirStack", "write_all"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class Attrs(NamedTuple):
    mode: int
    mtime_ns: int


class _OpenDir(NamedTuple):
    name: str
    fd: int
    attrs: Attrs | None


class DirStack:
    """The directories on the path of the last member, each held open.

    Every fd was opened relative to its parent with O_NOFOLLOW|O_DIRECTORY, and
    entries are created with ``*at()`` calls on them, so a symlink an earlier
    member planted can never redirect a later one. A directory's mode and mtime
    are applied when the walk leaves it, after its contents are in.
    """

    def __init__(self, root_fd: int) -> None:
        self._root_fd = root_fd
        self._open: list[_OpenDir] = []
        self.entered = 0
        """Directories entered so far: an archive in tree order enters each once."""

    def make_dir(self, parts: list[str], attrs: Attrs) -> None:
        self._parent_of(parts)
        self._enter(parts[-1], attrs)

    def create_file(self, parts: list[str]) -> int:
        return os.open(parts[-1], _NEW_FILE_FLAGS, 0o600, dir_fd=self._parent_of(parts))

    def symlink(self, parts: list[str], target: str, mtime_ns: int) -> None:
        parent_fd = self._parent_of(parts)
        os.symlink(target, parts[-1], dir_fd=parent_fd)
        os.utime(parts[-1], ns=(mtime_ns, mtime_ns), dir_fd=parent_fd, follow_symlinks=False)

    def finish(self, root: Attrs | None) -> None:
        self._leave(0)
        if root is not None:
            _apply(self._root_fd, root)

    def close(self) -> None:
        while self._open:
            os.close(self._open.pop().fd)

    def _parent_of(self, parts: list[str]) -> int:
        dirs = parts[:-1]
        keep = 0
        for open_dir, name in zip(self._open, dirs, strict=False):
            if open_dir.name != name:
                break
            keep += 1
        self._leave(keep)
        for name in dirs[keep:]:
            self._enter(name, None)
        return self._open[-1].fd if self._open else self._root_fd

    def _enter(self, name: str, attrs: Attrs | None) -> None:
        self.entered += 1
        parent_fd = self._open[-1].fd if self._open else self._root_fd
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=parent_fd)
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise ArchiveRejectedError(
                    f"{shown(name)} is a symlink or file, not a directory"
                ) from None
            raise
        self._open.append(_OpenDir(name, fd, attrs))

    def _leave(self, keep: int) -> None:
        while len(self._open) > keep:
            open_dir = self._open.pop()
            try:
                if open_dir.attrs is not None:
                    _apply(open_dir.fd, open_dir.attrs)
            finally:
                os.close(open_dir.fd)


def _apply(fd: int, attrs: Attrs) -> None:
    os.fchmod(fd, attrs.mode)
    os.utime(fd, ns=(attrs.mtime_ns, attrs.mtime_ns))


def write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data) :]
