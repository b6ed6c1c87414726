"""Runner processes on this host: a loopback port for one, and removing what it left.

Shared by the local provider and the MicroVM emulator, which both run
``sandcell-runner`` processes under a private root directory.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import shutil
import socket
from pathlib import Path

__all__ = ["free_loopback_port", "remove_runner_root"]

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_MNT_DETACH = 2


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def remove_runner_root(root: Path) -> None:
    """Detach mounts a killed runner left under ``root`` (its tmpfs workspaces), then delete it."""
    prefix = str(root.resolve()) + "/"
    points = []
    with contextlib.suppress(OSError), open("/proc/self/mountinfo", encoding="utf-8") as info:
        for line in info:
            point = line.split()[4].replace("\\040", " ")
            if point.startswith(prefix):
                points.append(point)
    for point in sorted(points, key=len, reverse=True):  # deepest first
        _libc.umount2(point.encode(), _MNT_DETACH)
    shutil.rmtree(root, ignore_errors=True)
