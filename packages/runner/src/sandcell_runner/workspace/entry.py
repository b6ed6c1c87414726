"""A job directory's entry file, written over the one the reused directory kept.

A one-shot job's ``jobs/<id>/job`` serves job after job (``WorkspaceManager._recycle``),
and so does the inode of its entry file: kept when the directory is recycled
(``recycle_job_dir``), written over by the next job (``write_entry``: its bytes from
offset 0, then cut to their length; renamed first when that job's language names
its entry otherwise), never unlinked and created again, never emptied.

Why not a new file: on ext4 without a journal (the root filesystem of this machine
and of many a container host) a new inode is looked for past every inode of the
group freed in the last ``vm.dirty_expire_centisecs`` (ext4's ``find_inode_bit``
skips each one ``recently_deleted``), so the cost of a create grows with the rate
of deletions on the filesystem, the runner's own and every neighbour's. Why not
``O_TRUNC``: ext4 flushes a file truncated to zero and written again when it is
closed (``auto_da_alloc``), a block write per job. Measured (2026-12-04, this
machine's root ext4, no journal, ``discard``): create + write + unlink 32-170 us
of CPU, truncate to zero + write 66-75 us, write over + ``ftruncate`` 8 us; and by
``perf record -a -g`` under 16 clients of ``bash: true`` at ~100 jobs/s, 0.33
CPU-ms a job in the runner's ``openat(O_CREAT)`` of ``main.sh`` (``recently_deleted``),
a fifth of the runner's own CPU per request.

The job directory is the runner's own (root's, read-only in the jail): no job can
have put a link or a hard link in it, unlike a workspace (``fsops.write_file``, which
unlinks rather than truncates for that reason), and no job sees a kept file before
the next ``write_entry`` has replaced every byte of it (until then it has mode 0).
Links are still never followed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from pathlib import Path

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_REUSE_FLAGS = os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def write_entry(job_dir: Path, name: str, data: bytes, *, mode: int) -> None:
    """Write ``data`` as ``job_dir/name`` with ``mode``, over the file the directory kept.

    ``name`` is a single component (a language's entry name). What else the directory
    held is gone after this: a kept file of another name becomes ``name``, and holds
    ``data`` and nothing else.
    """
    dir_fd = os.open(job_dir, _DIR_FLAGS)
    try:
        fd = _reuse(dir_fd, name)
        reused = fd is not None
        if fd is None:
            fd = os.open(name, _CREATE_FLAGS, 0o600, dir_fd=dir_fd)
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            if reused:
                os.ftruncate(fd, len(data))  # the kept file's bytes past ours
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
    finally:
        os.close(dir_fd)


def _reuse(dir_fd: int, name: str) -> int | None:
    """The kept file, as ``name``, open for writing at offset 0; None: create one."""
    try:
        return os.open(name, _REUSE_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except OSError:
        # Not a file this module kept (a link, a directory; a runner without root,
        # which cannot write its own 0444 file): made anew, as before.
        _remove(dir_fd, name)
        return None
    # Another language's entry (the previous job's): renamed, not unlinked.
    kept = os.listdir(dir_fd)
    if len(kept) != 1:
        for other in kept:
            _remove(dir_fd, other)
        return None
    try:
        os.rename(kept[0], name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        return os.open(name, _REUSE_FLAGS, dir_fd=dir_fd)
    except OSError:
        _remove(dir_fd, name)
        _remove(dir_fd, kept[0])
        return None


def _remove(dir_fd: int, name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISDIR(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
            shutil.rmtree(name, dir_fd=dir_fd)
        else:
            os.unlink(name, dir_fd=dir_fd)


def recycle_job_dir(job_dir: Path) -> None:
    """Ready a finished job's directory for the next one: every entry removed but one
    regular file, kept for ``write_entry`` to write over, with mode 0 until then (its
    bytes, the last job's code, are root's alone to read; and a kept file is told
    from one in use)."""
    kept = False
    with os.scandir(job_dir) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            elif not kept and entry.is_file(follow_symlinks=False):
                os.chmod(entry.path, 0)
                kept = True
            else:
                os.unlink(entry.path)


__all__ = ["recycle_job_dir", "write_entry"]
