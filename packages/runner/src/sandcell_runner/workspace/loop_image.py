"""One ext4 image: a sparse file of exactly the quota, on a loop device, mounted.

The image is made with ``mkfs.ext4`` once (``-N`` bounds its inodes, ``-m 0``
gives the job every block, no journal: the filesystem never outlives the runner),
attached to a loop device with direct I/O (so the backing file is not cached a
second time) and auto-clear (the device goes away with the last unmount, even
when the runner was killed and someone else unmounts), and mounted once. The pool
that reuses images is ``images.py``; the mounts themselves are ``mounts.py``'s.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

from . import mounts

log = logging.getLogger(__name__)

_LOOP_CTL_GET_FREE = 0x4C82
_LOOP_CONFIGURE = 0x4C0A
_LO_FLAGS_AUTOCLEAR = 4
_LO_FLAGS_DIRECT_IO = 16
# struct loop_config { u32 fd; u32 block_size; struct loop_info64 info; u64 reserved[8]; }
# loop_info64: 5 x u64, 4 x u32 (lo_flags last), 64 + 64 + 32 bytes of names/key, 2 x u64.
_LOOP_CONFIG = struct.Struct("=II QQQQQ IIII 64s64s32s QQ 64x")
_FITRIM = 0xC0185879  # _IOWR('X', 121, struct fstrim_range)
_TRIM_RANGE = struct.Struct("=QQQ")  # start, len, minlen


def find_mkfs() -> str | None:
    """The host's ``mkfs.ext4``, or None."""
    return shutil.which("mkfs.ext4", path="/usr/sbin:/sbin:/usr/bin:/bin")


def check_host(mkfs: str | None) -> None:
    """Raise OSError unless this host can make images (``mkfs.ext4``, loop devices)."""
    if mkfs is None:
        raise OSError("mkfs.ext4 not found")
    if not Path("/dev/loop-control").exists():
        raise OSError("no /dev/loop-control")


@dataclass(frozen=True, slots=True)
class Ext4Format:
    """How an image is made: ``mkfs`` (the binary), ``size_bytes``, ``inodes``."""

    mkfs: str
    size_bytes: int
    inodes: int

    def create(self, file: Path, mount: Path) -> None:
        """Make the image ``file`` and mount it at ``mount`` (a new directory);
        on failure nothing of it is left."""
        mount.mkdir(mode=0o711)
        try:
            self._format(file)
            _attach_and_mount(file, mount)
        except BaseException:
            destroy(file, mount)
            raise

    def reformat(self, file: Path, mount: Path) -> None:
        """A new, empty filesystem in place of the one mounted at ``mount``."""
        mounts.unmount(mount)
        self._format(file)
        _attach_and_mount(file, mount)

    def _format(self, file: Path) -> None:
        fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, self.size_bytes)
        finally:
            os.close(fd)
        argv = [self.mkfs, "-q", "-F", "-b", "4096", "-m", "0", "-N", str(self.inodes)]
        argv += ["-O", "^has_journal"]
        argv += ["-E", "lazy_itable_init=1,nodiscard", str(file)]
        done = subprocess.run(argv, capture_output=True, timeout=60, check=False, env={})
        if done.returncode != 0:
            raise OSError(f"mkfs.ext4 failed: {done.stderr.decode(errors='replace')[-300:]}")


def destroy(file: Path, mount: Path) -> None:
    """Unmount and delete the image (the loop device auto-clears), quietly."""
    with contextlib.suppress(OSError):
        mounts.unmount(mount)
    with contextlib.suppress(OSError):
        mount.rmdir()
    with contextlib.suppress(OSError):
        file.unlink()


def trim(mount: Path) -> None:
    """FITRIM the filesystem at ``mount``: its free blocks become holes in the backing file."""
    fd = os.open(mount, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, _FITRIM, bytearray(_TRIM_RANGE.pack(0, 2**64 - 1, 0)))
    except OSError as exc:
        log.warning("workspace image at %s not trimmed: %s", mount, exc)
    finally:
        os.close(fd)


def _attach_and_mount(file: Path, mount: Path) -> None:
    device_fd, device = _attach_loop(file)
    try:
        # No online discard: with it every freed block (even an empty directory's)
        # waited for the loop device to punch its hole, 100-200 us of sleep in
        # each wipe (bench, 2026-12-02). The pool trims a big image instead (``trim``).
        mounts.mount_ext4(device, mount)
    finally:
        os.close(device_fd)  # auto-clear: the device now lives as long as the mount
    with contextlib.suppress(FileNotFoundError):
        (mount / "lost+found").rmdir()
    os.chmod(mount, 0o711)  # noqa: S103


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
