"""Where jobs run: fresh per-job workspaces and the session workspace, on disk.

Layout under ``SANDCELL_WORKSPACE_ROOT`` (mode 0711: jobs never see it, the jail
bind-mounts only their own directories)::

    jobs/<id>/ws       fresh workspace (an ext4 image bound here, or a tmpfs), removed after the job
    jobs/<id>/job      the job's entry file, mounted read-only at /mnt/job
    session/ws-<n>     the bound session's workspace (n grows with each restore)
    (a restore extracts into the next ws-<n> and becomes the workspace only when complete)
    session/job-<id>   a session job's entry file
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from sandcell_protocol import SurfacedOutput

from ..config import MIB
from ..errors import ConfigError
from . import mounts
from .entry import recycle_job_dir
from .fsops import remove_tree
from .images import ImagePool

log = logging.getLogger(__name__)

_FREE_JOBS = 64
"""Emptied job directories kept for reuse (more than a runner's concurrent jobs)."""

_FREE_SESSION_JOBS = 4
"""Emptied session job directories kept for reuse (a session's turns run one at a time)."""


@dataclass(frozen=True, slots=True)
class JobDirs:
    """The host directories of one job."""

    workspace: Path
    job_dir: Path
    base: Path
    """``jobs/<id>``, the job directory's parent (kept, not derived: a ``.parent`` per
    use made a new path, hashed and compared, three times a job)."""


@dataclass(slots=True)
class JobWorkspace:
    """The workspace a job runs in, and what the caller already knows of its files."""

    path: Path
    uid: int
    gid: int
    job_dir: Path
    surfaced: dict[str, SurfacedOutput] = field(default_factory=dict)
    """Files the caller has seen (inputs it wrote, outputs of earlier turns)."""
    session_id: str | None = None


class WorkspaceManager:
    """Creates and removes workspaces: an ext4 image from the pool where it can
    (``images.py``), else a quota-sized tmpfs, else a plain directory."""

    def __init__(
        self,
        root: Path,
        *,
        quota_bytes: int,
        inodes: int | None = None,
        image_dir: Path | None = None,
        keep_untouched: bool = True,
    ) -> None:
        """``keep_untouched``: a one-shot job's workspace left exactly as handed out may
        serve the next job as it is (``ImagePool._untouched``)."""
        self.root = root
        self.quota_bytes = quota_bytes
        self.quota_enforced = mounts.can_mount()
        self.jobs = root / "jobs"
        self.session = root / "session"
        self.images: ImagePool | None = None
        if self.quota_enforced and image_dir is not None:
            # At most one inode per 4 KiB block: mkfs refuses more.
            count = min(inodes or quota_bytes >> 14, max(256, quota_bytes >> 12))
            self.images = ImagePool(
                image_dir, size_bytes=quota_bytes, inodes=count, keep_untouched=keep_untouched
            )
        self.images_refused = ""
        """Why there is no image pool (empty when there is one, or no root)."""
        self.backend = "plain"
        """Where workspace bytes live: ``ext4`` (disk), ``tmpfs`` (memory) or ``plain``."""
        self._free_jobs: list[Path] = []
        """Emptied ``jobs/<id>`` directories (each holding an empty ``job``), reused."""
        self._free_session_jobs: list[Path] = []
        """Emptied ``session/job-<id>`` directories, reused (``create_session_job_dir``)."""
        self._free_lock = threading.Lock()

    def prepare(self) -> None:
        """Create the root directories (idempotent).

        nsjail mounts a job's directories after switching to the job's UID, so every
        ancestor of the root must be traversable by others (``o+x``); a 0700 parent
        would fail every job, so it fails start-up instead, naming the variable.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        for ancestor in self.root.resolve().parents:
            if not os.stat(ancestor).st_mode & 0o001:
                raise ConfigError(
                    f"SANDCELL_WORKSPACE_ROOT: ancestor {ancestor} is not traversable by job "
                    "UIDs (needs o+x); choose another root or chmod o+x it"
                )
        for directory in (self.root, self.jobs, self.session):
            directory.mkdir(parents=True, exist_ok=True)
            # Traversable, not listable: job UIDs reach only the mounts nsjail makes.
            os.chmod(directory, 0o711)  # noqa: S103
        if self.images is not None:
            try:
                self.images.prepare()
            except OSError as exc:
                log.warning("workspace images unavailable (%s); using tmpfs", exc)
                self.images_refused = exc.strerror or str(exc)
                self.images = None
        if self.images is not None:
            self.backend = "ext4"
        elif self.quota_enforced:
            self.backend = "tmpfs"

    # -- workspaces -------------------------------------------------------------

    def make_workspace(self, path: Path, *, uid: int, gid: int, fixed: bool = True) -> Path:
        """An empty workspace owned by ``uid``, quota-capped when possible; its path.

        ``fixed``: it is ``path`` (a session's ``ws-N``). Otherwise an image's own
        directory may be answered instead, which saves a mount and an unmount per job.
        """
        if self.images is not None:
            try:
                if not fixed:
                    return self.images.take(uid=uid, gid=gid)
                path.mkdir(mode=0o700)
                return self.images.take(uid=uid, gid=gid, bind_at=path)
            except OSError as exc:
                # No image to be had now (no free loop device, a full disk): this
                # workspace is a tmpfs rather than the job an error.
                log.warning("no workspace image (%s); this workspace is a tmpfs", exc)
        if not path.exists():
            path.mkdir(mode=0o700)
        if self.quota_enforced:
            try:
                mounts.mount_tmpfs(path, size_bytes=self.quota_bytes, uid=uid, gid=gid)
            except OSError as exc:
                log.warning("workspace quota unavailable (%s); using a plain directory", exc)
                self.quota_enforced = False
            else:
                return path
        os.chown(path, uid, gid)
        return path

    def remove_workspace(self, path: Path, *, reuse: bool = False) -> None:
        """Unmount and delete; raises OSError when the tree cannot be removed.

        ``reuse``: nothing can see the workspace any more (a one-shot job's), so its
        image may serve the next one; a session's may still be seen by its processes.
        """
        if self.images is not None and self.images.owns(path):
            self.images.give(path, reuse=reuse)
            if path.name == "ws" and path.parent.parent == self.images.directory:
                return
        if mounts.is_mount_point(path):
            mounts.unmount(path)
        if path.is_symlink():
            path.unlink()
        elif path.exists():
            remove_tree(path)  # the job's tree, however deep it nests

    def disk_full(self, path: Path) -> bool:
        """True when the workspace has (almost) no free space left: a quota hit."""
        if not self.quota_enforced:
            return False
        try:
            st = os.statvfs(path)
        except OSError:
            return False
        # Out of blocks, or (an image has a fixed inode count) out of inodes. ext4
        # refuses a write (delayed allocation reserves its worst-case metadata) while
        # statvfs still shows up to ~1% free: "full" is within 2% (at least 2 MiB).
        slack = max(2 * MIB, st.f_blocks * st.f_frsize // 50)
        return st.f_bavail * st.f_frsize < slack or (st.f_files > 0 and st.f_favail == 0)

    # -- fresh per-job directories ------------------------------------------------

    def create_job(self, *, uid: int, gid: int, with_workspace: bool = True) -> JobDirs:
        """A ``jobs/<id>`` with an empty workspace and an empty job directory.

        The ``jobs/<id>`` of a finished one-shot job is reused when there is one:
        two ``mkdir`` and two ``rmdir`` less per job, which under 16 concurrent jobs
        waited on the kernel in the runner's worker threads (``remove_job`` was the
        largest item of a 16-client py-spy profile). Its job directory was emptied
        (but for its entry file, which ``entry.write_entry`` writes over), and it is the
        runner's alone (read-only in the jail, never the workspace).
        """
        with self._free_lock:
            base = self._free_jobs.pop() if self._free_jobs else None
        if base is None:
            base = self.jobs / f"{int(time.time())}-{secrets.token_hex(6)}"
            base.mkdir(mode=0o711)
            (base / "job").mkdir(mode=0o755)
        else:
            os.utime(base)  # the reaper goes by age: a reused one is as new as its job
        job_dir = base / "job"
        workspace = base / "ws"
        if with_workspace:
            workspace = self.make_workspace(workspace, uid=uid, gid=gid, fixed=False)
        return JobDirs(workspace=workspace, job_dir=job_dir, base=base)

    def create_job_now(self, *, uid: int, gid: int) -> JobDirs | None:
        """``create_job`` when it needs no waiting, else None (the caller hops to a thread).

        Only a reused ``jobs/<id>`` and a ready image qualify: a ``utime``, a
        ``mkdir`` and a ``chown``, cheaper on the event loop than the thread hop
        ``create_job`` costs (~0.3 CPU-ms a hop at 16 clients, more than the work).
        A new directory, a tmpfs mount or a new image stay in ``create_job``.
        """
        if self.images is None:
            return None
        with self._free_lock:
            base = self._free_jobs.pop() if self._free_jobs else None
        if base is None:
            return None
        try:
            workspace = self.images.take_ready(uid=uid, gid=gid)
        except BaseException:
            self._give_free(base)
            raise
        if workspace is None:
            self._give_free(base)
            return None
        os.utime(base)  # the reaper goes by age: a reused one is as new as its job
        return JobDirs(workspace=workspace, job_dir=base / "job", base=base)

    def _give_free(self, base: Path) -> None:
        with self._free_lock:
            self._free_jobs.append(base)

    def remove_job(self, dirs: JobDirs) -> None:
        """Remove a fresh job's workspace; empty its ``jobs/<id>`` for the next job."""
        base = dirs.base
        with contextlib.suppress(FileNotFoundError):
            if self.images is not None and self.images.owns(dirs.workspace):
                self.remove_workspace(dirs.workspace, reuse=True)
            elif dirs.workspace.parent == base:
                self.remove_workspace(dirs.workspace)
            if not self._recycle(base):
                shutil.rmtree(base)

    def remove_job_now(self, dirs: JobDirs) -> bool:
        """``remove_job`` when it is a few small calls (an image's small workspace,
        ``ImagePool.give_small``), on the caller's thread; False: call ``remove_job``
        (in a thread). Together with ``create_job_now`` a small one-shot job hops to
        no thread at all: two hops cost the event loop and the workers ~0.8 CPU-ms a
        job at 16 clients (the GIL passed back and forth on every system call)."""
        images = self.images
        # ``give_small`` refuses (False) a workspace that is no image's ``ws``.
        if images is None or not images.give_small(dirs.workspace):
            return False
        base = dirs.base
        with contextlib.suppress(FileNotFoundError):
            if not self._recycle(base):
                shutil.rmtree(base)
        return True

    def _recycle(self, base: Path) -> bool:
        """Put ``base`` in the free list if it now holds only its job directory's files.

        The job directory is emptied but for its entry file, kept for the next job to
        write over (``entry.py``: a create costs more than a write)."""
        if len(self._free_jobs) >= _FREE_JOBS or os.listdir(base) != ["job"]:
            return False
        recycle_job_dir(base / "job")
        with self._free_lock:
            if len(self._free_jobs) >= _FREE_JOBS:
                return False
            self._free_jobs.append(base)
        return True

    def create_session_job_dir(self, *, reuse: bool = False) -> Path:
        """A job directory for one session turn (the workspace is the session's).

        ``reuse``: the caller writes the turn's entry file (``entry.write_entry``)
        before anything runs, so a finished turn's directory will do when
        ``remove_session_job_dir`` kept one: a ``mkdir``, a create of the entry file
        and their two deletions less per turn, each of which pays ext4's walk past
        recently freed inodes (``entry.py``). It holds at most the last turn's entry
        file, root's with mode 0 (perhaps another session's code: hence only for a
        caller that writes over it; its size would show in a ``stat``).
        """
        path = None
        if reuse:
            with self._free_lock:
                path = self._free_session_jobs.pop() if self._free_session_jobs else None
        if path is not None:
            try:
                os.utime(path)  # the reaper goes by age: a reused one is as new as its turn
            except FileNotFoundError:
                path = None
        if path is None:
            path = self.session / f"job-{int(time.time())}-{secrets.token_hex(6)}"
            path.mkdir(mode=0o755)
        return path

    def remove_session_job_dir(self, path: Path) -> None:
        """Done with a session turn's job directory (``create_session_job_dir``'s with
        ``reuse``): emptied but for its entry file and kept for the next turn, or removed.

        Only for a turn whose processes are all gone (a job ``Jail.run`` waited for):
        the directory's next user writes its code there."""
        with contextlib.suppress(FileNotFoundError):
            if len(self._free_session_jobs) < _FREE_SESSION_JOBS:
                try:
                    recycle_job_dir(path)
                except OSError:
                    pass
                else:
                    with self._free_lock:
                        if len(self._free_session_jobs) < _FREE_SESSION_JOBS:
                            self._free_session_jobs.append(path)
                            return
            shutil.rmtree(path)

    def remove_dir(self, path: Path) -> None:
        with contextlib.suppress(FileNotFoundError):
            remove_tree(path)

    # -- reaping --------------------------------------------------------------

    def reap(self, *, older_than_s: float, keep: set[Path], now: float | None = None) -> list[Path]:
        """Remove leftovers older than ``older_than_s``; never a path in ``keep``.

        ``keep`` holds the bound session's workspace and any staging directory; the
        input cache lives outside the workspace root and is never looked at.
        """
        now = time.time() if now is None else now
        removed: list[Path] = []
        with self._free_lock:
            keep = keep | set(self._free_jobs) | set(self._free_session_jobs)
        for parent in (self.jobs, self.session):
            if not parent.is_dir():
                continue
            for entry in parent.iterdir():
                if entry in keep or any(entry == k or entry in k.parents for k in keep):
                    continue
                try:
                    age = now - entry.lstat().st_mtime
                except FileNotFoundError:
                    continue
                if age < older_than_s:
                    continue
                try:
                    self._remove_any(entry)
                    removed.append(entry)
                except OSError as exc:
                    log.warning("reaper could not remove %s: %s", entry, exc)
        return removed

    def _remove_any(self, entry: Path) -> None:
        if entry.is_symlink() or entry.is_file():
            entry.unlink()
            return
        for child in (entry / "ws", entry):
            if self.images is not None and self.images.owns(child):
                self.images.give(child, reuse=False)
            if mounts.is_mount_point(child):
                mounts.unmount(child)
        remove_tree(entry)

    def close(self) -> None:
        """Unmount and delete the image pool (at shutdown)."""
        if self.images is not None:
            self.images.close()
