"""Cgroup subtrees of runners that are gone: who owns one, and removing the orphans.

A runner's job cgroups live under ``sandcell/<instance>`` in each controller
(``cgroups.py``). A runner stopped gracefully removes its own; one that was
SIGKILLed (or crashed) cannot, and its subtree stays behind for ever. So each
runner holds a lease on its instance for its whole life: an ``flock`` on
``/run/sandcell/cgroup-leases/<instance>``, which the kernel drops when the process
dies, however it dies. A subtree whose lease nobody holds is an orphan.

Orphans are removed by whoever notices first: the runner's periodic reaper (only
subtrees untouched for a while: a runner of an older version holds no lease), the
local provider after it had to SIGKILL a runner, and the test fixtures after every
runner they stopped; the last two run ``python -m sandcell_runner.jail.cgroup_reaper
WORKSPACE_ROOT``, which removes exactly that runner's subtree.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import sys
import time
from pathlib import Path

from .cgroups import CGROUP_ROOT, V1_ALL
from .job_cgroup import JobCgroup

log = logging.getLogger(__name__)

LEASE_DIR = Path("/run/sandcell/cgroup-leases")
EXIT_LEFT = 3
"""``main``'s exit status when some subtree is still there (1 and 2: it failed to run)."""


def instance_key(workspace_root: Path) -> str:
    """Stable per-runner key (from its workspace root) naming its cgroup subtree."""
    return hashlib.sha256(str(workspace_root).encode()).hexdigest()[:16]


class InstanceLease:
    """This runner's claim on its cgroup subtree, held until ``release`` or death."""

    def __init__(self, instance: str, *, lease_dir: Path = LEASE_DIR) -> None:
        self._fd: int | None = None
        self._path = lease_dir / instance
        try:
            lease_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(lease_dir / instance, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            log.warning("cgroup lease for %s unavailable: %s", instance, exc)
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            log.warning(
                "another live runner uses cgroup instance %s (same workspace root)", instance
            )
            return
        self._fd = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Drop the claim, and its file: every runner's root is its own, so a file left
        by each graceful stop piled up in ``/run`` for as long as the host ran.
        Unlinked while still locked, as ``reap_instance`` does: a runner that opens the
        name next gets a fresh file. Called after the runner removed its own subtree;
        a subtree it could not remove is then unleased, an orphan the reaper takes."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                self._path.unlink()
            os.close(self._fd)
            self._fd = None


def _take_lease(instance: str, lease_dir: Path) -> int | None:
    """The lock of an instance nobody holds (-1: it has no lease file); None when held."""
    try:
        fd = os.open(lease_dir / instance, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return -1
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _instance_dirs(root: Path, instance: str) -> list[Path]:
    """The subtree's directory in every controller (v1) or the one (v2)."""
    found = [root / c / "sandcell" / instance for c in V1_ALL]
    found.append(root / "sandcell" / instance)
    return [d for d in found if d.is_dir()]


def _instances(root: Path) -> set[str]:
    names: set[str] = set()
    for parent in (*(root / c / "sandcell" for c in V1_ALL), root / "sandcell"):
        with contextlib.suppress(OSError):
            names.update(entry.name for entry in os.scandir(parent) if entry.is_dir())
    return names


def reap_instance(
    instance: str,
    *,
    root: Path = CGROUP_ROOT,
    lease_dir: Path = LEASE_DIR,
    only_empty: bool = False,
) -> bool:
    """Kill what is left in an unleased instance's cgroups and remove them; False if leased.

    ``only_empty``: leave a subtree that still has a process in it. A runner of an
    older version holds no lease, and its resident spawner threads sit in its job
    cgroups: killing "leftovers" there would kill that live runner.
    """
    fd = _take_lease(instance, lease_dir)
    if fd is None:
        return False
    try:
        dirs = _instance_dirs(root, instance)
        if only_empty and any(_has_processes(d) for d in dirs):
            return False
        for parent in dirs:
            _remove_subtree(parent, version=2 if parent.parent.parent == root else 1)
        if fd >= 0:
            # Unlinked while locked: a runner that opens it next gets a fresh file.
            with contextlib.suppress(OSError):
                (lease_dir / instance).unlink()
    finally:
        if fd >= 0:
            os.close(fd)
    return True


def _remove_subtree(parent: Path, *, version: int) -> None:
    for child in list(parent.iterdir()):
        if child.is_dir():
            JobCgroup([child], version=version).destroy()
    for _ in range(100):
        try:
            parent.rmdir()
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                log.warning("orphaned cgroup %s not removed: %s", parent, exc)
                return
            time.sleep(0.005)
        else:
            return


def _has_processes(directory: Path) -> bool:
    for dirpath, _, filenames in os.walk(directory):
        if "cgroup.procs" in filenames:
            with contextlib.suppress(OSError):
                if Path(dirpath, "cgroup.procs").read_text().strip():
                    return True
    return False


def reap_orphans(
    *,
    older_than_s: float,
    root: Path = CGROUP_ROOT,
    lease_dir: Path = LEASE_DIR,
    now: float | None = None,
) -> list[str]:
    """Remove every unleased, empty instance subtree untouched for ``older_than_s``."""
    now = time.time() if now is None else now
    reaped = []
    for instance in sorted(_instances(root)):
        dirs = _instance_dirs(root, instance)
        try:
            touched = max(d.stat().st_mtime for d in dirs) if dirs else 0.0
        except OSError:
            continue
        if now - touched < older_than_s:
            continue
        if reap_instance(instance, root=root, lease_dir=lease_dir, only_empty=True):
            reaped.append(instance)
    return reaped


def main(argv: list[str]) -> int:
    """``python -m sandcell_runner.jail.cgroup_reaper WORKSPACE_ROOT...``: reap those runners.

    Exit ``EXIT_LEFT`` when a subtree is still there (leased by a live runner, or a
    directory the kernel still calls busy): the caller keeps what it needs to try
    again later. Not 1, which is also what the interpreter answers for a crash.
    """
    if not argv:
        sys.stderr.write("usage: python -m sandcell_runner.jail.cgroup_reaper WORKSPACE_ROOT...\n")
        return 2
    left = []
    for workspace_root in argv:
        instance = instance_key(Path(workspace_root))
        if not reap_instance(instance) or _instance_dirs(CGROUP_ROOT, instance):
            left.append(workspace_root)
    if left:
        sys.stderr.write(f"cgroups left for {len(left)} runner(s): {', '.join(left)}\n")
        return EXIT_LEFT
    return 0


__all__ = ["LEASE_DIR", "InstanceLease", "instance_key", "reap_instance", "reap_orphans"]


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
