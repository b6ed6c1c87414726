"""A pool of loop-mounted ext4 images: workspace quotas that are disk, not memory.

A tmpfs workspace keeps its bytes in memory, charged to the memory cgroup of the
job that wrote them and still charged there after the job ended: a full workspace
ended in ``memory_limit`` instead of ``disk_limit``, and files kept by a session
shrank every later job's memory. An ext4 filesystem keeps them on disk; what it
caches is page cache, which the kernel reclaims when a job needs the memory.

Each image is a sparse file of exactly the quota, made with ``mkfs.ext4`` once
(``-N`` bounds its inodes, ``-m 0`` gives the job every block, no journal: the
filesystem never outlives the runner), attached to a loop device with direct I/O
(so the backing file is not cached a second time) and auto-clear (the device goes
away with the last unmount, even when the runner was killed and someone else
unmounts), and mounted once under the pool directory. A workspace *takes* an
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
import ctypes
import ctypes.util
import fcntl
import logging
import os
import shutil
import struct
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

from .untouched import Snapshot, snapshot, untouched

log = logging.getLogger(__name__)

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_MS_NOSUID = 0x2
_MS_NODEV = 0x4
_MS_NOATIME = 0x400
_MS_BIND = 0x1000
_MNT_DETACH = 0x2
_LOOP_CTL_GET_FREE = 0x4C82
_LOOP_CONFIGURE = 0x4C0A
_LO_FLAGS_AUTOCLEAR = 4
_LO_FLAGS_DIRECT_IO = 16
# struct loop_config { u32 fd; u32 block_size; struct loop_info64 info; u64 reserved[8]; }
# loop_info64: 5 x u64, 4 x u32 (lo_flags last), 64 + 64 + 32 bytes of names/key, 2 x u64.
_LOOP_CONFIG = struct.Struct("=II QQQQQ IIII 64s64s32s QQ 64x")
_REFORMAT_INODES = 4096
"""A workspace that used more inodes than this is re-made rather than walked."""
_FITRIM = 0xC0185879  # _IOWR('X', 121, struct fstrim_range)
_TRIM_RANGE = struct.Struct("=QQQ")  # start, len, minlen
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
        self._mkfs = shutil.which("mkfs.ext4", path="/usr/sbin:/sbin:/usr/bin:/bin")
        self._lock = threading.Lock()
        self._ready: list[_Image] = []
        self._taken: dict[Path, _Image] = {}
        self._made = 0
        self._refill: threading.Thread | None = None
        self._closed = False

    def prepare(self) -> None:
        """Check the host can do it (raises OSError) and clear a previous runner's images."""
        if self._mkfs is None:
            raise OSError("mkfs.ext4 not found")
        if not Path("/dev/loop-control").exists():
            raise OSError("no /dev/loop-control")
        # Traversable, not listable: nsjail (as the job's UID) binds a job's ``ws``.
        self.directory.mkdir(mode=0o711, parents=True, exist_ok=True)
        os.chmod(self.directory, 0o711)  # noqa: S103
        _unmount_under(self.directory)
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
                _mount(str(workspace), bind_at, None, _MS_BIND, None)
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
        (no online discard: see ``_attach_and_mount``), cheaper on the event loop
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
            _umount(workspace)
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
                self._reformat(image)
            else:
                try:
                    _empty(image.mount)
                except (OSError, RecursionError):
                    # A tree deeper than rmtree recurses (a job can nest a thousand
                    # directories): a new filesystem is cheaper than walking it.
                    self._reformat(image)
                else:
                    if st.f_blocks - st.f_bfree > _TRIM_AFTER_BLOCKS:
                        _trim(image.mount)
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
                    _umount(target)
        for image in images:
            self._discard(image)

    # -- making images ------------------------------------------------------------

    def _make(self) -> _Image:
        with self._lock:
            number = self._made
            self._made += 1
        image = _Image(self.directory / f"{number}.img", self.directory / f"{number}.mnt")
        image.mount.mkdir(mode=0o711)
        try:
            self._format(image)
            self._attach_and_mount(image)
        except BaseException:
            self._discard(image)
            raise
        return image

    def _format(self, image: _Image) -> None:
        assert self._mkfs is not None
        fd = os.open(image.file, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, self.size_bytes)
        finally:
            os.close(fd)
        argv = [self._mkfs, "-q", "-F", "-b", "4096", "-m", "0", "-N", str(self.inodes)]
        argv += ["-O", "^has_journal"]
        argv += ["-E", "lazy_itable_init=1,nodiscard", str(image.file)]
        done = subprocess.run(argv, capture_output=True, timeout=60, check=False, env={})
        if done.returncode != 0:
            raise OSError(f"mkfs.ext4 failed: {done.stderr.decode(errors='replace')[-300:]}")

    def _attach_and_mount(self, image: _Image) -> None:
        device_fd, device = _attach_loop(image.file)
        try:
            # No online discard: with it every freed block (even an empty directory's)
            # waited for the loop device to punch its hole, 100-200 us of sleep in
            # each wipe (bench, 2026-12-02). ``_give_back`` trims a big image instead.
            _mount(device, image.mount, "ext4", _MS_NOSUID | _MS_NODEV | _MS_NOATIME, None)
        finally:
            os.close(device_fd)  # auto-clear: the device now lives as long as the mount
        with contextlib.suppress(FileNotFoundError):
            (image.mount / "lost+found").rmdir()
        os.chmod(image.mount, 0o711)  # noqa: S103

    def _reformat(self, image: _Image) -> None:
        _umount(image.mount)
        self._format(image)
        self._attach_and_mount(image)

    def _discard(self, image: _Image) -> None:
        with contextlib.suppress(OSError):
            _umount(image.mount)
        with contextlib.suppress(OSError):
            image.mount.rmdir()
        with contextlib.suppress(OSError):
            image.file.unlink()


def _attach_loop(backing: Path) -> tuple[int, str]:
    """A free loop device bound to ``backing`` (auto-clear, direct I/O when possible)."""
    file_fd = os.open(backing, os.O_RDWR | os.O_CLOEXEC)
    try:
        control = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
        try:
            for _ in range(16):
                number = fcntl.ioctl(control, _LOOP_CTL_GET_FREE)
                device = f"/dev/loop{number}"
                device_fd = os.open(device, os.O_RDWR | os.O_CLOEXEC)
                for flags in (_LO_FLAGS_AUTOCLEAR | _LO_FLAGS_DIRECT_IO, _LO_FLAGS_AUTOCLEAR):
                    config = bytearray(
                        _LOOP_CONFIG.pack(
                            file_fd, 4096, 0, 0, 0, 0, 0, 0, 0, 0, flags, b"", b"", b"", 0, 0
                        )
                    )
                    try:
                        fcntl.ioctl(device_fd, _LOOP_CONFIGURE, config)
                    except OSError as exc:
                        if exc.errno == 16:  # EBUSY: another process took it first
                            break
                        if flags & _LO_FLAGS_DIRECT_IO:
                            continue  # the backing filesystem refuses O_DIRECT
                        os.close(device_fd)
                        raise
                    return device_fd, device
                os.close(device_fd)
            raise OSError("no free loop device")
        finally:
            os.close(control)
    finally:
        os.close(file_fd)


def _mount(source: str, target: Path, fstype: str | None, flags: int, data: str | None) -> None:
    result = _libc.mount(
        source.encode(),
        str(target).encode(),
        fstype.encode() if fstype else None,
        flags,
        data.encode() if data else None,
    )
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} at {target}: {os.strerror(err)}")


def _umount(target: Path) -> None:
    if _libc.umount2(str(target).encode(), _MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (22, 2):  # EINVAL (not a mount point), ENOENT
            raise OSError(err, f"umount {target}: {os.strerror(err)}")


def _empty(directory: Path) -> None:
    """Remove everything in ``directory`` without following a link (the job's files)."""
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)


def _trim(mount: Path) -> None:
    """FITRIM the filesystem at ``mount``: its free blocks become holes in the backing file."""
    fd = os.open(mount, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, _FITRIM, bytearray(_TRIM_RANGE.pack(0, 2**64 - 1, 0)))
    except OSError as exc:
        log.warning("workspace image at %s not trimmed: %s", mount, exc)
    finally:
        os.close(fd)


def _unmount_under(directory: Path) -> None:
    prefix = str(directory.resolve()) + "/"
    points = []
    with contextlib.suppress(OSError), open("/proc/self/mountinfo", encoding="utf-8") as info:
        for line in info:
            point = line.split()[4].replace("\\040", " ")
            if point.startswith(prefix):
                points.append(point)
    for point in sorted(points, key=len, reverse=True):
        _libc.umount2(point.encode(), _MNT_DETACH)


__all__ = ["ImagePool"]
