"""The runner's mounts: every ``mount`` and ``umount2`` of a workspace is made here.

Size-capped tmpfs mounts are the workspace quota where there are no workspace
images. The runner's workspaces are ext4 images from a pool (``images.py``); where it
cannot make them (no ``/dev/loop-control`` in a container, no ``mkfs.ext4``) a
tmpfs per workspace, sized to the quota, still caps the total (``rlimit_fsize``
caps one file, not a workspace). The price: tmpfs pages are memory, charged to
the memory cgroup of the job that writes them, which ``/health`` warns about.
Where the runner is not root it cannot mount: workspaces are plain directories
without a quota, and ``/health`` says so.

ctypes rather than the ``mount`` binary: a fork+exec per job would cost more than
the mount itself. The ext4 images (``images.py``, ``loop_image.py``) mount and
bind through the same calls.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
from pathlib import Path

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_MS_NOSUID = 0x2
_MS_NODEV = 0x4
_MS_NOATIME = 0x400
_MS_BIND = 0x1000
_MNT_DETACH = 0x2


def can_mount() -> bool:
    """True when this process may create tmpfs mounts (root in the initial namespace)."""
    return os.geteuid() == 0


def mount_tmpfs(target: Path, *, size_bytes: int, uid: int, gid: int, mode: int = 0o700) -> None:
    """Mount a tmpfs of ``size_bytes`` at ``target``, owned by ``uid:gid``."""
    options = f"size={size_bytes},uid={uid},gid={gid},mode={mode:o},nr_inodes=0"
    _mount("sandcell", target, "tmpfs", _MS_NOSUID | _MS_NODEV, options, what="tmpfs")


def mount_ext4(device: str, target: Path) -> None:
    """Mount the ext4 filesystem on ``device`` at ``target`` (nosuid, nodev, noatime)."""
    _mount(device, target, "ext4", _MS_NOSUID | _MS_NODEV | _MS_NOATIME, None, what=device)


def bind(source: Path, target: Path) -> None:
    """Bind-mount the directory ``source`` at ``target``."""
    _mount(str(source), target, None, _MS_BIND, None, what=str(source))


def _mount(
    source: str, target: Path, fstype: str | None, flags: int, data: str | None, *, what: str
) -> None:
    result = _libc.mount(
        source.encode(),
        str(target).encode(),
        fstype.encode() if fstype else None,
        flags,
        data.encode() if data else None,
    )
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {what} at {target}: {os.strerror(err)}")


def unmount(target: Path) -> None:
    """Detach the mount at ``target``; a path that is not a mount point is left alone."""
    if _libc.umount2(str(target).encode(), _MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err in (errno.EINVAL, errno.ENOENT):
            return
        raise OSError(err, f"umount {target}: {os.strerror(err)}")


def unmount_under(directory: Path) -> None:
    """Detach every mount below ``directory``, deepest first (a previous runner's), quietly."""
    prefix = str(directory.resolve()) + "/"
    points = []
    with contextlib.suppress(OSError), open("/proc/self/mountinfo", encoding="utf-8") as info:
        for line in info:
            point = line.split()[4].replace("\\040", " ")
            if point.startswith(prefix):
                points.append(point)
    for point in sorted(points, key=len, reverse=True):
        _libc.umount2(point.encode(), _MNT_DETACH)


def is_mount_point(path: Path) -> bool:
    try:
        return os.path.ismount(path)
    except OSError:
        return False
