"""Host-side file operations inside a workspace that never follow a link the job planted.

Every path is walked one component at a time from a directory file descriptor with
``O_NOFOLLOW``; a symlink anywhere on the way is refused (writes) or reported as a
symlink (scans), never traversed. These run as root on the host, so one followed
link (``x -> /etc/shadow``) would be a read or write outside the jail.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CHUNK = 1 << 20


class UnsafePathError(OSError):
    """A path crosses a symlink or a non-directory the job controls."""


@dataclass(frozen=True, slots=True)
class Entry:
    """One workspace entry seen by a scan."""

    name: str
    kind: str  # "file" | "symlink"
    size: int
    mtime_ns: int
    symlink_target: str | None = None


@contextlib.contextmanager
def open_dir(
    root: Path, parts: list[str], *, create: bool = False, uid: int = -1, gid: int = -1
) -> Iterator[int]:
    """A directory fd for ``root/parts...``, walked without following links."""
    fd = os.open(root, _DIR_FLAGS)
    try:
        for part in parts:
            try:
                next_fd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                os.mkdir(part, 0o755, dir_fd=fd)
                if uid >= 0:
                    os.chown(part, uid, gid, dir_fd=fd, follow_symlinks=False)
                next_fd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                raise UnsafePathError(exc.errno, f"not a plain directory: {part}") from exc
            os.close(fd)
            fd = next_fd
        yield fd
    finally:
        os.close(fd)


def write_file(
    root: Path,
    relpath: str,
    data: bytes,
    *,
    mode: int = 0o644,
    uid: int = -1,
    gid: int = -1,
    replace: bool = True,
) -> os.stat_result:
    """Write ``data`` at ``root/relpath`` (a validated workspace path) and return its stat."""
    *dirs, name = relpath.split("/")
    with open_dir(root, dirs, create=True, uid=uid, gid=gid) as dir_fd:
        if replace:
            with contextlib.suppress(FileNotFoundError):
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    raise UnsafePathError(21, f"is a directory: {relpath}")
                # Unlink rather than truncate: the old inode may be a hard link the
                # job made to something it should not be able to change through us.
                os.unlink(name, dir_fd=dir_fd)
        fd = os.open(
            name,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
            dir_fd=dir_fd,
        )
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            if uid >= 0:
                os.fchown(fd, uid, gid)
            os.fchmod(fd, mode)
            return os.fstat(fd)
        finally:
            os.close(fd)


def copy_into(
    root: Path,
    relpath: str,
    source: Path,
    *,
    mode: int,
    uid: int,
    gid: int,
    dir_uid: int,
    dir_gid: int,
) -> os.stat_result:
    """Copy ``source`` (a runner-owned file) to ``root/relpath``, replacing what is there.

    The file gets ``uid:gid``; parent directories created on the way get
    ``dir_uid:dir_gid`` (the job's), so a root-owned input never locks its directory.
    """
    *dirs, name = relpath.split("/")
    with open_dir(root, dirs, create=True, uid=dir_uid, gid=dir_gid) as dir_fd:
        with contextlib.suppress(FileNotFoundError):
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                _rmtree_at(dir_fd, name)
            else:
                os.unlink(name, dir_fd=dir_fd)
        src = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            dst = os.open(
                name,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o600,
                dir_fd=dir_fd,
            )
            try:
                size = os.fstat(src).st_size
                offset = 0
                while offset < size:
                    sent = os.sendfile(dst, src, offset, min(size - offset, 1 << 30))
                    if sent == 0:
                        break
                    offset += sent
                os.fchown(dst, uid, gid)
                os.fchmod(dst, mode)
                return os.fstat(dst)
            finally:
                os.close(dst)
        finally:
            os.close(src)


def file_digest(root: Path, relpath: str) -> tuple[os.stat_result, str] | None:
    """(stat, sha256) of a regular file at ``relpath``; None if absent or not a plain file."""
    try:
        *dirs, name = relpath.split("/")
        with open_dir(root, dirs) as dir_fd:
            fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    return None
                digest = hashlib.sha256()
                while chunk := os.read(fd, _CHUNK):
                    digest.update(chunk)
                return st, digest.hexdigest()
            finally:
                os.close(fd)
    except OSError:
        return None


def read_file(root: Path, relpath: str, *, max_bytes: int) -> bytes:
    """Read a regular file without following links; ``UnsafePathError`` otherwise."""
    *dirs, name = relpath.split("/")
    with open_dir(root, dirs) as dir_fd:
        try:
            fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno == 40:  # ELOOP: the final component is a symlink
                raise UnsafePathError(exc.errno, f"is a symlink: {relpath}") from exc
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise UnsafePathError(21, f"not a regular file: {relpath}")
            if st.st_size > max_bytes:
                raise UnsafePathError(27, f"larger than {max_bytes} bytes: {relpath}")
            return _read_all(fd, st.st_size)
        finally:
            os.close(fd)


def remove_path(root: Path, relpath: str) -> bool:
    """Remove a file, symlink or directory tree; False when nothing was there."""
    *dirs, name = relpath.split("/")
    try:
        with open_dir(root, dirs) as dir_fd:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                _rmtree_at(dir_fd, name)
            else:
                os.unlink(name, dir_fd=dir_fd)
            return True
    except FileNotFoundError:
        return False


def remove_tree(path: Path) -> None:
    """``shutil.rmtree(path)`` without its recursion: a job may nest 2,000 directories,
    which took Python's rmtree past the recursion limit (``RecursionError``, no
    ``OSError``, so no caller's handling saw it). ``path`` itself must not be a symlink."""
    parent_fd = os.open(path.parent, _DIR_FLAGS)
    try:
        _rmtree_at(parent_fd, path.name)
    finally:
        os.close(parent_fd)


def _rmtree_at(parent_fd: int, name: str) -> None:
    """Remove the tree ``name`` under ``parent_fd``, iteratively (a job may nest 2,000 deep)."""
    # Each level: its fd, its name, the fd it was opened from, its subdirectories left.
    stack: list[tuple[int, str, int, list[str]]] = []
    fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    stack.append((fd, name, parent_fd, _clear_files(fd)))
    try:
        while stack:
            fd, dir_name, dir_parent, subdirs = stack[-1]
            if subdirs:
                child_name = subdirs.pop()
                child = os.open(child_name, _DIR_FLAGS, dir_fd=fd)
                stack.append((child, child_name, fd, []))  # closed by the finally if clearing fails
                stack[-1][3].extend(_clear_files(child))
                continue
            stack.pop()
            os.close(fd)
            os.rmdir(dir_name, dir_fd=dir_parent)
    finally:
        for fd, _, _, _ in stack:
            os.close(fd)


def _clear_files(dir_fd: int) -> list[str]:
    """Unlink every non-directory in ``dir_fd``; return the subdirectories' names."""
    subdirs = []
    for base, st in _list(dir_fd):
        if stat.S_ISDIR(st.st_mode):
            subdirs.append(base)
        else:
            os.unlink(base, dir_fd=dir_fd)
    return subdirs


@dataclass(frozen=True, slots=True)
class _Level:
    """One directory of a walk in progress: its fd, its path prefix, entries left to visit."""

    fd: int
    prefix: str
    pending: list[tuple[str, os.stat_result]]


def walk(
    root: Path, *, limit: int = 1_000_000, charge: Callable[[], bool] | None = None
) -> Iterator[tuple[int, Entry]]:
    """Every regular file and symlink under ``root`` with the fd of its directory.

    Directories are walked, links never followed. Iterative, holding one fd per
    level, so a tree as deep as a path can be costs no recursion. The fd is valid
    until the iterator moves on (open the file relative to it: ``os.open(name,
    dir_fd=fd)``). Names are as the host's ``os`` functions take them (bytes that
    are not UTF-8 surrogate-escaped); ``sandcell_protocol.escape_name`` makes wire names.
    ``charge`` is called once per directory entry listed (of any kind); once it has
    returned False nothing more is listed (what was listed is still visited).
    """
    found = 0
    refused = False

    def take() -> bool:
        nonlocal refused
        if not refused and charge is not None and not charge():
            refused = True
        return not refused

    listing_charge = take if charge is not None else None
    top = os.open(root, _DIR_FLAGS)
    try:
        stack = [_Level(top, "", _list(top, listing_charge))]
    except BaseException:
        os.close(top)
        raise
    try:
        while stack and found < limit:
            level = stack[-1]
            if not level.pending:
                os.close(stack.pop().fd)
                continue
            base, st = level.pending.pop()
            name = level.prefix + base
            if stat.S_ISDIR(st.st_mode):
                try:
                    child = os.open(base, _DIR_FLAGS, dir_fd=level.fd)
                except OSError:
                    continue  # replaced by a link since listed: not ours to follow
                try:
                    pending = _list(child, listing_charge)
                except OSError:
                    os.close(child)
                    continue
                stack.append(_Level(child, name + "/", pending))
            elif stat.S_ISREG(st.st_mode):
                found += 1
                yield level.fd, Entry(name, "file", st.st_size, st.st_mtime_ns)
            elif stat.S_ISLNK(st.st_mode):
                try:
                    target = os.readlink(base, dir_fd=level.fd)
                except OSError:
                    continue
                found += 1
                size = len(os.fsencode(target))
                yield level.fd, Entry(name, "symlink", size, st.st_mtime_ns, target)
    finally:
        for level in stack:
            os.close(level.fd)


def _list(fd: int, charge: Callable[[], bool] | None = None) -> list[tuple[str, os.stat_result]]:
    """The entries of the directory ``fd`` with their lstat, in reverse order (up to the
    first entry ``charge`` refuses)."""
    # scandir works on its own duplicate of fd: fd stays open and at its position.
    listed = []
    with os.scandir(fd) as entries:
        for entry in entries:
            if charge is not None and not charge():
                break
            try:
                listed.append((entry.name, entry.stat(follow_symlinks=False)))
            except FileNotFoundError:
                continue  # removed since listed (a session process still runs)
    listed.reverse()  # popped from the end: visited in directory order
    return listed


def scan(root: Path, *, limit: int = 1_000_000) -> list[Entry]:
    """Every regular file and symlink under ``root`` (directories walked, links not)."""
    return [entry for _, entry in walk(root, limit=limit)]


def _read_all(fd: int, size_hint: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, max(_CHUNK, size_hint)):
        chunks.append(chunk)
    return b"".join(chunks)
