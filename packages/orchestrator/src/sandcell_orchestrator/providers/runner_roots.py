"""Runner processes on this host: a loopback port for one, and removing what it left.

Shared by the local provider and the MicroVM emulator, which both run
``sandcell-runner`` processes under a private root directory.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import shutil
import socket
import subprocess
from pathlib import Path

__all__ = [
    "detach_runner_mounts",
    "free_loopback_port",
    "reap_runner_cgroups",
    "remove_runner_root",
]

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_MNT_DETACH = 2
_REAPER_LEFT = 3
"""The reaper's exit status for "a subtree is still there" (``cgroup_reaper.EXIT_LEFT``;
not imported: the runner package need not be importable here). Any other failure (a
crash exits 1) is no reason to keep the root: a later try would fail the same way."""
log = logging.getLogger(__name__)


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def remove_runner_root(root: Path) -> None:
    """Detach mounts a killed runner left under ``root`` (its tmpfs workspaces), then delete it."""
    detach_runner_mounts(root)
    shutil.rmtree(root, ignore_errors=True)


def detach_runner_mounts(root: Path) -> None:
    """Detach every mount under ``root`` (a killed runner's tmpfs workspaces hold memory)."""
    prefix = str(root.resolve()) + "/"
    points = []
    with contextlib.suppress(OSError), open("/proc/self/mountinfo", encoding="utf-8") as info:
        for line in info:
            point = line.split()[4].replace("\\040", " ")
            if point.startswith(prefix):
                points.append(point)
    for point in sorted(points, key=len, reverse=True):  # deepest first
        _libc.umount2(point.encode(), _MNT_DETACH)


def reap_runner_cgroups(python: str, root: Path) -> bool:
    """Remove the cgroup subtree a killed runner under ``root`` left behind.

    A runner removes its own cgroups when it stops gracefully; after a SIGKILL
    nobody would. The runner package owns that layout, so its reaper runs as a
    child (``python -m sandcell_runner.jail.cgroup_reaper``) instead of this side
    knowing cgroup paths; it removes nothing a live runner holds a lease on.

    False when the subtree is still there (the reaper said so): the caller keeps
    ``root``, whose name is what finds the subtree, for a later try. True otherwise,
    also when the reaper could not run at all (a later try would not either).
    """
    argv = [python, "-I", "-m", "sandcell_runner.jail.cgroup_reaper", str(root / "workspaces")]
    try:
        done = subprocess.run(
            argv,
            capture_output=True,
            timeout=30,
            check=False,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("cgroup reaper for %s did not run: %s", root, exc)
        return True
    if done.returncode != 0:
        log.warning("cgroup reaper for %s failed: %s", root, done.stderr.decode()[-300:])
        return done.returncode != _REAPER_LEFT
    return True
