"""Whether a job left its workspace's root exactly as it was handed out.

A one-shot job's workspace is an image's ``ws`` directory, handed out empty
(``images.py``). When the job leaves it so, the next job may have the same
directory instead of a wipe (``rmtree``) and a ``mkdir`` and ``chown`` of a new one.
"As handed out" is judged by the directory itself, opened without following a link:

- its ``fstat``: inode, mode, owner, group, link count, size, and mtime and ctime
  to the nanosecond. Every change to a directory (an entry made, removed or renamed;
  chmod, chown, an xattr, an inode flag, utimes) sets its ctime to "now", and no
  unprivileged process can set a ctime of its choice;
- but "now" is coarse: a kernel without multigrain timestamps (ext4 has them from
  Linux 6.13) stamps with the clock tick, 1-10 ms, so a change in the tick of the
  hand-out leaves both times as they were. So each leftover is also looked for
  directly, none inferred from the times alone:

  - entries (a file, a hidden one, a subdirectory, a hard link, a FIFO, a socket, a
    symlink, a device node): the directory is listed, and must be empty;
  - chmod, chown: mode, owner and group are compared;
  - xattrs (``user.*``, an ACL): the list of names is compared;
  - inode flags (``chattr``: ``FS_IOC_GETFLAGS``; project id and extent size hint:
    ``FS_IOC_FSGETXATTR``) are compared.

What the directory does not hold cannot be left for the next job: the job's processes
are dead (its pid namespace is gone) before this runs, its mounts went with its
mount namespace, and a file it unlinked while open was freed with its last process.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
from pathlib import Path

__all__ = ["Snapshot", "snapshot", "untouched"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FS_IOC_GETFLAGS = 0x80086601  # _IOR('f', 1, long)
_FS_IOC_FSGETXATTR = 0x801C581F  # _IOR('X', 31, struct fsxattr), 28 bytes


@dataclasses.dataclass(frozen=True, slots=True)
class Snapshot:
    """What a directory was when handed out (``snapshot``)."""

    identity: tuple[int, ...]
    """``st_dev, st_ino, st_mode, st_nlink, st_size, st_mtime_ns`` (``_identity``)."""
    owner: tuple[int, int]
    ctime_ns: int
    flags: bytes
    """The ``FS_IOC_GETFLAGS`` and ``FS_IOC_FSGETXATTR`` answers, raw."""
    xattrs: tuple[str, ...]

    def matches(self, st: os.stat_result) -> bool:
        return (
            _identity(st) == self.identity
            and (st.st_uid, st.st_gid) == self.owner
            and st.st_ctime_ns == self.ctime_ns
        )

    def made(self, st: os.stat_result) -> Snapshot:
        """A directory made as this one was (same flags and xattrs), whose ``stat`` is ``st``."""
        return dataclasses.replace(
            self, identity=_identity(st), owner=(st.st_uid, st.st_gid), ctime_ns=st.st_ctime_ns
        )

    def owned(self, st: os.stat_result) -> Snapshot | None:
        """This snapshot after a ``chown`` whose ``stat`` was ``st``: owner, group and
        ctime move, nothing else does (a directory keeps its mode bits); None if
        anything else moved too."""
        return self.made(st) if _identity(st) == self.identity else None


def snapshot(path: Path) -> Snapshot:
    """The state of the directory ``path`` (raises OSError)."""
    fd = os.open(path, _DIR_FLAGS)
    try:
        st = os.fstat(fd)
        return Snapshot(
            identity=_identity(st),
            owner=(st.st_uid, st.st_gid),
            ctime_ns=st.st_ctime_ns,
            flags=_flags(fd),
            xattrs=tuple(sorted(os.listxattr(fd))),
        )
    finally:
        os.close(fd)


def untouched(path: Path, handed: Snapshot) -> bool:
    """Whether ``path`` is the empty directory ``handed`` describes, in every respect
    listed in the module docstring; False too when it cannot be looked at.

    The ``stat`` comes first: a job that left something is told by it alone (one
    call), before the directory is opened. Nothing can swap the directory between
    the two: its parent is the runner's, and the job's processes are dead.
    """
    try:
        if not handed.matches(os.stat(path, follow_symlinks=False)):
            return False
        fd = os.open(path, _DIR_FLAGS)
    except OSError:
        return False
    try:
        return (
            _flags(fd) == handed.flags
            and tuple(sorted(os.listxattr(fd))) == handed.xattrs
            and not os.listdir(fd)
        )
    except OSError:
        return False
    finally:
        os.close(fd)


def _identity(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_mode, st.st_nlink, st.st_size, st.st_mtime_ns)


def _flags(fd: int) -> bytes:
    flags = fcntl.ioctl(fd, _FS_IOC_GETFLAGS, bytes(8))
    fsx = fcntl.ioctl(fd, _FS_IOC_FSGETXATTR, bytes(28))
    return bytes(flags[:4]) + bytes(fsx)
