"""A pool of loop-mounted ext4 images: workspace quotas that are disk, not memory.

A tmpfs workspace keeps its bytes in memory, charged to the memory cgroup of the
job that wrote them and still charged there after the job ended: a full workspace
ended in ``memory_limit`` instead of ``disk_limit``, and files kept by a session
shrank every later job's memory. An ext4 filesystem keeps them on disk; what it
caches is page cache, which the kernel reclaims when a job needs the memory.

Each image is a sparse file of exactly the quota on a loop device, mounted once
under the pool directory (``loop_image.py`` makes one). A workspace *takes* an
image (a directory ``ws`` in it, owned by the job's UID: the job's workspace is
that path, no mount per job) and *gives* it back (what the job left is removed,
or, when it left ``ws`` exactly as handed out, ``ws`` is kept for the next job);
images are reused, so the ~50 ms of mkfs and mount are paid once per image, not
per job. A full image is wiped like any other: deleting needs no free block.

Measured here (scripts/bench_workspace.py): take + give of a reused image costs
less than mounting and unmounting a tmpfs, per exec.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path

from . import loop_image, mounts
from .loop_image import Ext4Format
from .untouched import Snapshot, snapshot, untouched

log = logging.getLogger(__name__)

_REFORMAT_INODES = 4096
"""A workspace that used more inodes than this is re-made rather than walked."""
_TRIM_AFTER_BLOCKS = 256
"""An image given back after holding more than this (1 MiB) is trimmed: its freed
blocks are punched out of the sparse backing file, so the host disk gets them back."""
SMALL_INODES = 64
SMALL_BLOCKS = 64
"""A workspace this small (inodes, 4 KiB blocks in use) is wiped in ~100 us of CPU:
``give_small`` does it on the caller's thread (the event loop)."""


@dataclass(slots=True)
class _Image:
    file: Path
    mount: Path
    handed: Snapshot | None = None
    """Its ``ws`` as handed out (while taken) or as kept (while ready); None: no
    ``ws`` (while ready), or one not to be kept (a bind, which is never reused)."""
    fresh: Snapshot | None = None
    """Its first ``ws`` as made: the inode flags and xattrs every later one is made
    with too (the kernel gives them from the image's root, which nothing changes;
    were they ever to differ, the check fails and the ``ws`` is wiped, never kept)."""
    ws: Path = field(init=False)
    """``mount / "ws"``, made once: each job compared and joined it four times."""

    def __post_init__(self) -> None:
        self.ws = self.mount / "ws"


class ImagePool:
    """Loop-mounted ext4 images of ``size_bytes`` with ``inodes`` inodes, reused."""

    def __init__(
        self, directory: Path, *, size_bytes: int, inodes: int, keep_untouched: bool = True
    ) -> None:
        self.directory = directory
        self.keep_untouched = keep_untouched
        """Whether a ``ws`` left as handed out may be kept for the next job (``_untouched``)."""
        self.size_bytes = size_bytes
        self.inodes = inodes
        self._mkfs = loop_image.find_mkfs()
        self._lock = threading.Lock()
        self._ready: list[_Image] = []
        self._taken: dict[Path, _Image] = {}
        self._made = 0
        self._refill: threading.Thread | None = None
        self._closed = False

    def prepare(self) -> None:
        """Check the host can do it (raises OSError) and clear a previous runner's images."""
        loop_image.check_host(self._mkfs)
        # Traversable, not listable: nsjail (as the job's UID) binds a job's ``ws``.
        self.directory.mkdir(mode=0o711, parents=True, exist_ok=True)
        os.chmod(self.directory, 0o711)  # noqa: S103
        mounts.unmount_under(self.directory)
        for entry in self.directory.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
        # One image now: the first job should not pay for mkfs.
        image = self._make()
        with self._lock:
            self._ready.append(image)

    def take(self, *, uid: int, gid: int, bind_at: Path | None = None) -> Path:
        """A clean workspace owned by ``uid``: the directory ``ws`` in an image.

        ``bind_at`` (an empty directory): bind-mount it there and answer that path,
        for a workspace whose path must stay put (a session's ``ws-N``). Otherwise
        the image's own path: no mount at all, which is what makes a one-shot job's
        workspace cheaper than a tmpfs (every unmount waits for an RCU grace period).
        """
        with self._lock:
            image = self._ready.pop() if self._ready else None
        if image is None:
            image = self._make()
        return self._hand_out(image, uid=uid, gid=gid, bind_at=bind_at)

    def take_ready(self, *, uid: int, gid: int) -> Path | None:
        """``take`` of an image already made (no bind), or None when none is ready.

        Safe on the event loop: a ready image costs a ``mkdir`` and a ``chown``
        (~30 us), or nothing when its ``ws`` was kept, never the 50-250 ms of making one.
        """
        with self._lock:
            image = self._ready.pop() if self._ready else None
        if image is None:
            return None
        return self._hand_out(image, uid=uid, gid=gid, bind_at=None)

    def _hand_out(self, image: _Image, *, uid: int, gid: int, bind_at: Path | None) -> Path:
        self._refill_soon()
        workspace = image.ws
        kept, image.handed = image.handed, None
        try:
            if kept is not None and kept.owner != (uid, gid):
                # The ``ws`` a job left untouched (``give``), for another UID: a chown.
                os.chown(workspace, uid, gid)
                kept = kept.owned(os.stat(workspace, follow_symlinks=False))
                if kept is None:  # more than the owner moved: made anew
                    _empty(image.mount)
            if kept is None:
                workspace.mkdir(mode=0o700)
                os.chown(workspace, uid, gid)
                if image.fresh is None:
                    kept = image.fresh = snapshot(workspace)
                else:  # a stat, not the ioctls and listxattr of a snapshot
                    kept = image.fresh.made(os.stat(workspace, follow_symlinks=False))
            if bind_at is not None:
                mounts.bind(workspace, bind_at)
                workspace = bind_at
            else:
                image.handed = kept
        except BaseException:
            self._give_back(image)
            raise
        with self._lock:
            self._taken[workspace] = image
        return workspace

    def owns(self, workspace: Path) -> bool:
        with self._lock:
            return workspace in self._taken

    def give(self, workspace: Path, *, reuse: bool) -> None:
        """Return ``workspace``'s image to the pool wiped (``reuse``), or retire it.

        Reuse only when nothing can still see the image: a one-shot job's mount
        namespace died with its pid namespace. A session's long-lived processes
        keep the workspace they started with across a restore (as a detached tmpfs
        did), so a session's image is retired instead: detached and unlinked, it
        lives on while they hold it and is never handed to another workspace.
        An image's own ``ws`` that the job left exactly as handed out is kept, not
        wiped (``_untouched``).
        """
        self._give(workspace, reuse=reuse, kept=None)

    def give_small(self, workspace: Path) -> bool:
        """``give(workspace, reuse=True)`` if it is small (``SMALL_INODES``,
        ``SMALL_BLOCKS``) and an image's own ``ws``: False (nothing done) otherwise.

        Its wipe is a few ``unlink`` and one ``rmdir`` that never wait on the device
        (no online discard: see ``loop_image.py``), cheaper on the event loop
        than the thread hop; a bigger one is the thread's (``give``). One left as
        handed out is not wiped at all.
        """
        with self._lock:
            image = self._taken.get(workspace)
        if image is None or workspace != image.ws:
            return False
        kept = self._untouched(image)
        if not kept:
            try:
                st = os.statvfs(image.mount)
            except OSError:
                return False
            if st.f_files - st.f_ffree > SMALL_INODES or st.f_blocks - st.f_bfree > SMALL_BLOCKS:
                return False
        self._give(workspace, reuse=True, kept=kept)
        return True

    def _give(self, workspace: Path, *, reuse: bool, kept: bool | None) -> None:
        """``give``; ``kept``: what ``_untouched`` said of it already (None: ask it)."""
        with self._lock:
            image = self._taken.pop(workspace, None)
        if image is None:
            return
        if workspace != image.ws:
            mounts.unmount(workspace)
        if not reuse:
            self._discard(image)
        elif kept if kept is not None else self._untouched(image):
            with self._lock:
                self._ready.append(image)
        else:
            self._give_back(image)

    def _untouched(self, image: _Image) -> bool:
        """Whether the job left the image's ``ws`` exactly as handed out (``untouched.py``
        says how that is judged); if not, ``image.handed`` is cleared (it is to be wiped).

        Why it pays: the common one-shot job leaves nothing, and for it the wipe and
        re-make (a ``statvfs``, ``rmtree`` of the empty ``ws``, then ``mkdir`` and
        ``chown``) were most of a workspace's cost. ``bench_workspace.py`` (row
        "left empty"), this tree and main's run in turn twice, 2026-12-03, load 8-13
        on 2 CPUs: take + give of a workspace left empty 58-85 us wiped and re-made
        (main), 21-31 us kept (the same UID), 35-45 us kept for another UID (a chown);
        one a job wrote a file into, wiped as before, 125-162 us against 126-154 us.
        With the other two levers (a free UID keeps its lease, ``jail/uidpool.py``;
        no statvfs after exit 0, ``executor.py``), bench_runner.py --b-tree main,
        3 rounds, load 11 on 2 CPUs: runner CPU per request main/this 1.28x at one
        client and 1.37x at 16 (``bash: true``), 1.18x and 1.25x (``python: pass``).
        An A/A run straight after (this tree against itself) gave 1.00x / 1.16x and
        1.04x / 0.98x: B's windows carry that much bias, so the gain is about 1.2x.
        """
        if self.keep_untouched and image.handed is not None and untouched(image.ws, image.handed):
            return True
        image.handed = None
        return False

    def _give_back(self, image: _Image) -> None:
        image.handed = None  # its ``ws`` goes with the wipe
        try:
            st = os.statvfs(image.mount)
            if st.f_files - st.f_ffree > _REFORMAT_INODES:
                self._ext4().reformat(image.file, image.mount)
            else:
                try:
                    _empty(image.mount)
                except (OSError, RecursionError):
                    # A tree deeper than rmtree recurses (a job can nest a thousand
                    # directories): a new filesystem is cheaper than walking it.
                    self._ext4().reformat(image.file, image.mount)
                else:
                    if st.f_blocks - st.f_bfree > _TRIM_AFTER_BLOCKS:
                        loop_image.trim(image.mount)
        except OSError as exc:
            log.warning("workspace image %s not reused: %s", image.file, exc)
            self._discard(image)
            return
        with self._lock:
            self._ready.append(image)

    def _refill_soon(self) -> None:
        """Make the next image in a thread when none is ready.

        A restore takes a second image for its staging directory while the
        session holds one: with mkfs and mount (~5 CPU-ms, but 50-250 ms of
        waiting on the kernel) off its path, its staging costs only the bind mount.
        """
        with self._lock:
            if self._ready or self._refill is not None or self._closed:
                return
            self._refill = threading.Thread(target=self._make_ready, name="sandcell-image-refill")
            self._refill.start()

    def _make_ready(self) -> None:
        image: _Image | None = None
        try:
            image = self._make()
        except OSError as exc:
            log.warning("workspace image not made ahead: %s", exc)
        with self._lock:
            self._refill = None
            if image is not None and not self._closed:
                self._ready.append(image)
                return
        if image is not None:
            self._discard(image)

    def close(self) -> None:
        """Unmount and delete every image (at shutdown); the loop devices auto-clear."""
        with self._lock:
            self._closed = True
            refill = self._refill
        if refill is not None:
            refill.join()
        with self._lock:
            images = [*self._ready, *self._taken.values()]
            targets = list(self._taken)
            self._ready, self._taken = [], {}
        for target in targets:
            if target.name != "ws":
                with contextlib.suppress(OSError):
                    mounts.unmount(target)
        for image in images:
            self._discard(image)

    # -- making images ------------------------------------------------------------

    def _ext4(self) -> Ext4Format:
        assert self._mkfs is not None
        return Ext4Format(self._mkfs, self.size_bytes, self.inodes)

    def _make(self) -> _Image:
        with self._lock:
            number = self._made
            self._made += 1
        image = _Image(self.directory / f"{number}.img", self.directory / f"{number}.mnt")
        self._ext4().create(image.file, image.mount)
        return image

    def _discard(self, image: _Image) -> None:
        loop_image.destroy(image.file, image.mount)


def _empty(directory: Path) -> None:
    """Remove everything in ``directory`` without following a link (the job's files)."""
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)


__all__ = ["ImagePool"]
