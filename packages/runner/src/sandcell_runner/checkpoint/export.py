"""Checkpoint export: a workspace as one streamed, compressed PAX tar archive.

Archive layout (restore.py reads exactly this and refuses anything else):

    .sandcell-checkpoint.json   CheckpointMeta as JSON, always the first member
    workspace                   the root directory (mode, mtime)
    workspace/<relpath>         every entry, parents before children, names sorted

Only regular files, directories and symlinks are stored; uid/gid are 0 and
names empty (restore assigns ownership); setuid, setgid and sticky bits are
dropped; an mtime with a sub-second part travels as a PAX ``mtime`` record so
``SurfacedOutput.mtime_ns`` still matches after a restore.

What a restore would refuse is left out and listed in ``CheckpointMeta.skipped``
instead, so that one odd entry costs that entry, not the whole checkpoint:
FIFOs, sockets and devices; names that are not valid workspace paths (invalid
UTF-8, a backslash, too long); symlinks whose target is absolute or climbs out
of the workspace (a venv's ``bin/python -> /usr/bin/python3`` is one). The list names
the first of them (``skipped.MAX_SKIPPED_LISTED_CHARS`` of names), then counts the rest.
Hard-linked files are stored as independent copies.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tarfile
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, ParamSpec, TypeVar

import anyio.to_thread
import msgspec

from sandcell_protocol import CheckpointMeta, ProtocolError, encode, validate_workspace_path
from sandcell_protocol.routes import CHECKPOINT_META_MEMBER, CHECKPOINT_WORKSPACE_PREFIX

from ..errors import ArchiveRejectedError
from .archive_rules import MAX_META_BYTES, PERMISSION_BITS, symlink_target_inside
from .compression import Compressor, Encoding, new_compressor
from .selection import WorkspaceSelection
from .skipped import SkippedEntries

__all__ = [
    "ArchiveLimits",
    "export_checkpoint",
    "format_mtime_ns",
    "stream_checkpoint",
]


_WORKSPACE_MEMBER_PREFIX = CHECKPOINT_WORKSPACE_PREFIX + "/"
_CHUNK_BYTES = 128 << 10
# Each refusal names the setting that raises it: it reaches the user as it is (E2B's 413).
_TOO_MANY = "workspace has more than {} entries (SANDCELL_CHECKPOINT_MAX_MEMBERS)"
_TOO_LARGE = "workspace holds more than {} bytes (SANDCELL_CHECKPOINT_MAX_BYTES)"
_READ_BYTES = 1 << 20
_BLOCK = tarfile.BLOCKSIZE
_RECORD = tarfile.RECORDSIZE
_NS = 1_000_000_000
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: an entry swapped for a FIFO after the scan must not hang the open.
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
# The workload may still be changing the tree: an entry that vanished or changed
# type between the scan and the open is passed over, not fatal.
# (EINVAL: readlink of what is no longer a symlink.)
_RACE_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.ENXIO, errno.EINVAL})

P = ParamSpec("P")
T = TypeVar("T")
Kind = Literal["dir", "file", "symlink", "other", "badname"]


@dataclass(frozen=True)
class ArchiveLimits:
    """Caps shared by export and restore: file bytes and archive members."""

    max_bytes: int = 1 << 30
    max_members: int = 200_000

    def __post_init__(self) -> None:
        if self.max_bytes < 0 or self.max_members < 2:
            raise ValueError("ArchiveLimits: max_bytes must be >= 0 and max_members >= 2")


def format_mtime_ns(mtime_ns: int) -> str:
    """A PAX ``mtime`` value with all nine fractional digits."""
    sign = "-" if mtime_ns < 0 else ""
    seconds, fraction = divmod(abs(mtime_ns), _NS)
    return f"{sign}{seconds}.{fraction:09d}"


def export_checkpoint(
    workspace: Path,
    meta: CheckpointMeta,
    *,
    encoding: Encoding,
    limits: ArchiveLimits,
    selection: WorkspaceSelection | None = None,
) -> Generator[bytes, None, None]:
    """Yield the compressed checkpoint archive of ``workspace`` in ~128 KiB chunks.

    A first pass counts members and sums file sizes (apparent sizes, so a sparse
    terabyte counts as a terabyte) and raises ``ArchiveRejectedError`` before the
    first chunk if either cap is exceeded; the streaming pass enforces the caps
    again in case the tree grew in between. Memory stays bounded by one read
    buffer plus one directory listing per level of the path being walked.
    """
    root_fd = _open_root(workspace)
    try:
        select = selection if selection is not None and not selection.selects_all else None
        skipped = _plan(root_fd, limits, select)
        meta_bytes = encode(msgspec.structs.replace(meta, skipped=skipped))
        if len(meta_bytes) > MAX_META_BYTES:
            raise ArchiveRejectedError(f"checkpoint metadata exceeds {MAX_META_BYTES} bytes")
        out = _TarOutput(new_compressor(encoding))
        out.add(_header(CHECKPOINT_META_MEMBER, tarfile.REGTYPE, 0o644, 0, size=len(meta_bytes)))
        out.add(meta_bytes)
        out.pad(len(meta_bytes))
        root = os.fstat(root_fd)
        out.add(
            _header(CHECKPOINT_WORKSPACE_PREFIX, tarfile.DIRTYPE, root.st_mode, root.st_mtime_ns)
        )
        yield from _stream_entries(root_fd, out, limits, select)
        out.end()
        yield from out.take(final=True)
    except OSError as exc:
        raise ArchiveRejectedError(f"export failed: {exc.strerror}") from exc
    finally:
        os.close(root_fd)


async def stream_checkpoint(
    workspace: Path,
    meta: CheckpointMeta,
    *,
    encoding: Encoding,
    limits: ArchiveLimits,
    batch_bytes: int = 1 << 20,
    selection: WorkspaceSelection | None = None,
) -> AsyncIterator[bytes]:
    """``export_checkpoint`` driven from a worker thread, for an async response body.

    Each step pulls about ``batch_bytes`` of chunks in one thread hop, so a slow
    client holds back the export itself (nothing is produced ahead of demand)
    and the event loop only ever relays finished chunks.
    """
    chunks = export_checkpoint(
        workspace, meta, encoding=encoding, limits=limits, selection=selection
    )
    try:
        while batch := await anyio.to_thread.run_sync(_next_batch, chunks, batch_bytes):
            for chunk in batch:
                yield chunk
    finally:
        # Not running in any thread here: to_thread waits for its call to end
        # even when cancelled, so closing (which closes fds) cannot race it.
        chunks.close()


def _next_batch(chunks: Iterator[bytes], batch_bytes: int) -> list[bytes]:
    batch: list[bytes] = []
    size = 0
    for chunk in chunks:
        batch.append(chunk)
        size += len(chunk)
        if size >= batch_bytes:
            break
    return batch


def _open_root(workspace: Path) -> int:
    try:
        return os.open(workspace, _DIR_FLAGS)
    except OSError as exc:
        raise ArchiveRejectedError(f"workspace is not a directory: {exc.strerror}") from exc


def _plan(root_fd: int, limits: ArchiveLimits, select: WorkspaceSelection | None) -> list[str]:
    """First pass: enforce the caps up front and collect what will be skipped."""
    members = 2  # the metadata member and the root directory
    file_bytes = 0
    skipped = SkippedEntries()
    with contextlib.closing(_walk(root_fd, select)) as entries:
        for relpath, parent_fd, name, kind in entries:
            members += 1
            if members > limits.max_members:
                raise ArchiveRejectedError(_TOO_MANY.format(limits.max_members))
            if kind == "file":
                st = _unless_raced(os.stat, name, dir_fd=parent_fd, follow_symlinks=False)
                file_bytes += 0 if st is None else st.st_size
                if file_bytes > limits.max_bytes:
                    raise ArchiveRejectedError(_TOO_LARGE.format(limits.max_bytes))
            elif kind == "symlink":
                target = _unless_raced(os.readlink, name, dir_fd=parent_fd)
                if target is not None and not symlink_target_inside(relpath, target):
                    skipped.add(relpath)
            elif kind != "dir":
                skipped.add(relpath)
    return skipped.listed()


def _stream_entries(
    root_fd: int, out: _TarOutput, limits: ArchiveLimits, select: WorkspaceSelection | None
) -> Iterator[bytes]:
    """Second pass: the entries as tar members; the caps are checked again as it goes."""
    members = 2
    file_bytes = 0
    with contextlib.closing(_walk(root_fd, select)) as entries:
        for relpath, parent_fd, name, kind in entries:
            member = _WORKSPACE_MEMBER_PREFIX + relpath
            if kind == "file":
                budget = limits.max_bytes - file_bytes
                written = yield from _stream_file(out, member, name, parent_fd, budget)
                file_bytes += written or 0
                stored = written is not None
            else:
                stored = _add_entry(out, member, relpath, name, parent_fd, kind)
            members += stored
            if members > limits.max_members:
                raise ArchiveRejectedError(_TOO_MANY.format(limits.max_members))
            yield from out.take()


def _add_entry(
    out: _TarOutput, member: str, relpath: str, name: str, parent_fd: int, kind: Kind
) -> bool:
    """Add a directory or symlink header; False when the entry is passed over."""
    if kind not in ("dir", "symlink"):
        return False
    target = ""
    if kind == "symlink":
        target = _unless_raced(os.readlink, name, dir_fd=parent_fd) or ""
        if not symlink_target_inside(relpath, target):
            return False
    st = _unless_raced(os.stat, name, dir_fd=parent_fd, follow_symlinks=False)
    if st is None:
        return False
    type_ = tarfile.DIRTYPE if kind == "dir" else tarfile.SYMTYPE
    out.add(_header(member, type_, st.st_mode, st.st_mtime_ns, linkname=target))
    return True


def _stream_file(
    out: _TarOutput, member: str, name: str, parent_fd: int, budget: int
) -> Generator[bytes, None, int | None]:
    """Emit one regular file; the generator's return value is its size (None: passed over)."""
    fd = _unless_raced(os.open, name, _FILE_FLAGS, dir_fd=parent_fd)
    if fd is None:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        size = st.st_size
        if size > budget:
            raise ArchiveRejectedError("workspace grew past max_bytes during the checkpoint")
        out.add(_header(member, tarfile.REGTYPE, st.st_mode, st.st_mtime_ns, size=size))
        remaining = size
        while remaining:
            data = os.read(fd, min(remaining, _READ_BYTES))
            if not data:
                # Truncated under us: the header already promised `size` bytes.
                data = bytes(min(remaining, _READ_BYTES))
            out.add(data)
            remaining -= len(data)
            yield from out.take()
        out.pad(size)
        return size
    finally:
        os.close(fd)


def _walk(
    root_fd: int, select: WorkspaceSelection | None = None
) -> Generator[tuple[str, int, str, Kind], None, None]:
    """Pre-order walk yielding ``(relpath, parent_fd, name, kind)``, names sorted.

    Only fds of the directories on the current path are open, each opened with
    O_NOFOLLOW relative to its parent, so a symlink is never followed. A
    ``badname`` directory is not descended into: nothing under it can be stored.
    """
    stack: list[tuple[int, str, Iterator[tuple[str, Kind]]]] = []
    try:
        stack.append((root_fd, "", iter(_scan(root_fd))))
        while stack:
            dir_fd, prefix, entries = stack[-1]
            entry = next(entries, None)
            if entry is None:
                stack.pop()
                if dir_fd != root_fd:
                    os.close(dir_fd)
                continue
            name, kind = entry
            relpath = prefix + name
            if select is not None and not select.keeps(relpath, is_dir=kind == "dir"):
                continue  # not part of the persistent workspace
            if not _valid_name(relpath):
                kind = "badname"
            if kind == "dir":
                child_fd = _unless_raced(os.open, name, _DIR_FLAGS, dir_fd=dir_fd)
                if child_fd is None:
                    continue
                try:
                    listing = _scan(child_fd)
                except BaseException:
                    os.close(child_fd)
                    raise
                stack.append((child_fd, relpath + "/", iter(listing)))
            yield relpath, dir_fd, name, kind
    finally:
        for dir_fd, _, _ in stack:
            if dir_fd != root_fd:
                os.close(dir_fd)


def _scan(dir_fd: int) -> list[tuple[str, Kind]]:
    listing: list[tuple[str, Kind]] = []
    with os.scandir(dir_fd) as entries:
        for entry in entries:
            kind: Kind
            if entry.is_symlink():
                kind = "symlink"
            elif entry.is_dir(follow_symlinks=False):
                kind = "dir"
            elif entry.is_file(follow_symlinks=False):
                kind = "file"
            else:
                kind = "other"
            listing.append((entry.name, kind))
    listing.sort()
    return listing


def _unless_raced(call: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T | None:
    """``call``, or None if its entry vanished or changed type since the scan."""
    try:
        return call(*args, **kwargs)
    except OSError as exc:
        if exc.errno in _RACE_ERRNOS:
            return None
        raise


def _valid_name(relpath: str) -> bool:
    try:
        return validate_workspace_path(relpath) == relpath
    except ProtocolError:
        return False


def _header(
    name: str, type_: bytes, mode: int, mtime_ns: int, *, size: int = 0, linkname: str = ""
) -> bytes:
    info = tarfile.TarInfo(name)
    info.type = type_
    info.mode = mode & PERMISSION_BITS
    info.size = size
    info.linkname = linkname
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    seconds, fraction = divmod(mtime_ns, _NS)
    info.mtime = seconds
    if fraction or not 0 <= seconds < 8**11:
        info.pax_headers = {"mtime": format_mtime_ns(mtime_ns)}
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "strict")


class _TarOutput:
    """Tar bytes in, compressed chunks of about ``_CHUNK_BYTES`` out."""

    def __init__(self, compressor: Compressor) -> None:
        self._compressor = compressor
        self._pending = bytearray()
        self._tar_bytes = 0

    def add(self, data: bytes) -> None:
        self._tar_bytes += len(data)
        self._pending += self._compressor.compress(data)

    def pad(self, size: int) -> None:
        if size % _BLOCK:
            self.add(bytes(_BLOCK - size % _BLOCK))

    def end(self) -> None:
        self.add(bytes(2 * _BLOCK))
        if self._tar_bytes % _RECORD:
            self.add(bytes(_RECORD - self._tar_bytes % _RECORD))

    def take(self, *, final: bool = False) -> Iterator[bytes]:
        if final:
            self._pending += self._compressor.flush()
        elif len(self._pending) < _CHUNK_BYTES:
            return
        pending, self._pending = self._pending, bytearray()
        # One compress() call may release far more than a chunk (a whole zstd block).
        for start in range(0, len(pending), 2 * _CHUNK_BYTES):
            yield bytes(pending[start : start + 2 * _CHUNK_BYTES])
