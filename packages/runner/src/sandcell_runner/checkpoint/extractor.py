"""The hardened extraction of one checkpoint archive into a staging directory.

``extract`` is what the extractor child (``extractor_child.py``) runs, jailed.

Why not ``TarFile.extractall(filter="data")``: the data filter resolves names
with ``os.path.realpath`` against the live tree, which was bypassed repeatedly in
2024-2025 (CVE-2024-12718, CVE-2025-4138, -4330, -4517: symlink chains, PATH_MAX
truncation, hard links to symlinks), with fixes not in 3.11.7. Here tarfile only
parses header blocks, and every check the data filter makes is made below, stricter
and without resolving anything: its ``realpath`` of each name and link target
``lstat``-ed every prefix of the path (O(depth) walks of O(depth) each), so a 50 KB
archive of 2,000 nested directories kept the extractor busy for minutes. Instead:

- member types other than regular file, directory, symlink and a per-member PAX
  header are refused while the header is parsed, before any data is read, and
  PAX records are parsed strictly in linear time (``archive_rules.StrictTarInfo``);
- names must be normalized workspace paths under ``workspace/``
  (``archive_rules.workspace_relpath``), each member unique; symlink targets must
  provably stay inside (``archive_rules.symlink_target_inside``); hard links are
  refused outright;
- entries are created with ``*at()`` calls relative to directory fds opened with
  O_NOFOLLOW (leaves with O_EXCL), so no path is resolved through a symlink
  (``extract_tree.DirStack``);
- members, file bytes actually read and metadata bytes per member are counted,
  and the compressed stream must end exactly where the archive does; so are the
  directories entered, which an archive in tree order (the exporter's) enters once
  each: one that hops between deep branches would cost O(depth) system calls a member;
- all of it runs as the pinned UID, so even a bug here writes only what that UID may,
  and (as root) chrooted into the staging directory, so it cannot reach a path
  outside it at all; and (as root) under a job's jail (``confine.py``): its own
  cgroup, an empty network namespace, rlimits and a seccomp filter.

The stream is walked here rather than by tarfile's stream mode, whose reader
copies every chunk through bytes joins and slices: member data goes from the
decompressor's output straight to ``os.write``, about 3x faster.
"""

from __future__ import annotations

import hashlib
import os
import tarfile

from sandcell_protocol import CheckpointMeta, ProtocolError, decode
from sandcell_protocol.routes import CHECKPOINT_META_MEMBER, CHECKPOINT_WORKSPACE_PREFIX

from ..errors import ArchiveRejectedError
from .archive_rules import (
    MAX_META_BYTES,
    PERMISSION_BITS,
    StrictTarInfo,
    member_mtime_ns,
    shown,
    symlink_target_inside,
    workspace_relpath,
)
from .compression import DecompressingReader, Encoding, RawSource
from .extract_tree import Attrs, DirStack, write_all

__all__ = ["extract"]

_BLOCK = tarfile.BLOCKSIZE
# Decompressed bytes one member's headers may take, with the padding of the
# previous member's data: a PAX header (at most 16 KiB) and two header blocks
# fit with room to spare.
_HEADER_ALLOWANCE = 128 << 10
_TRAILER_ALLOWANCE = 64 << 10
_COPY_BYTES = 1 << 20
# Directories entered beyond one per member: room for members whose parents have no
# member of their own (a hand-made archive), two 4 KiB paths' worth of levels.
_ENTER_ALLOWANCE = 4096


def extract(
    source: RawSource,
    staging_fd: int,
    *,
    encoding: Encoding,
    max_bytes: int,
    max_members: int,
) -> bytes:
    """Extract the archive read from ``source`` into ``staging_fd``; return the meta member.

    ``staging_fd`` must also be the working directory (the extractor child makes it
    its working and, as root, its root directory): a caller that did not is a bug.
    """
    if os.listdir(staging_fd):
        raise ArchiveRejectedError("staging directory is not empty")
    if not os.path.samestat(os.fstat(staging_fd), os.stat(".")):
        raise ArchiveRejectedError("extractor: the staging directory is not the working directory")
    reader = DecompressingReader(source, encoding=encoding)
    extractor = _Extractor(reader, staging_fd, max_bytes=max_bytes, max_members=max_members)
    try:
        meta = extractor.run()
    except tarfile.TarError as exc:
        raise ArchiveRejectedError(f"tar: {exc}") from None
    try:
        decode(meta, CheckpointMeta)
    except ProtocolError as exc:
        raise ArchiveRejectedError(f"invalid checkpoint metadata: {exc}") from None
    return meta


class _Extractor:
    def __init__(
        self,
        reader: DecompressingReader,
        staging_fd: int,
        *,
        max_bytes: int,
        max_members: int,
    ) -> None:
        self._reader = reader
        self._tree = DirStack(staging_fd)
        self._max_bytes = max_bytes
        self._max_members = max_members
        self._members = 0
        self._file_bytes = 0
        # Digests, not names: 200k hostile 4 KiB names would otherwise cost 800 MB.
        self._seen: set[bytes] = set()
        self._meta: bytes | None = None
        self._root: Attrs | None = None

    def run(self) -> bytes:
        try:
            self._reader.allow(_HEADER_ALLOWANCE)
            while (member := StrictTarInfo.next_member(self._read_exact)) is not None:
                self._add(member)
                self._reader.allow(_HEADER_ALLOWANCE)
            self._check_trailer()
            self._tree.finish(self._root)
        finally:
            self._tree.close()
        if self._meta is None:
            raise ArchiveRejectedError(f"archive has no {CHECKPOINT_META_MEMBER} member")
        return self._meta

    def _add(self, member: tarfile.TarInfo) -> None:
        self._members += 1
        if self._members > self._max_members:
            raise ArchiveRejectedError(f"archive has more than {self._max_members} members")
        name = member.name
        digest = hashlib.blake2b(name.encode("utf-8"), digest_size=16).digest()
        if digest in self._seen:
            raise ArchiveRejectedError(f"duplicate member {shown(name)}")
        self._seen.add(digest)
        if name == CHECKPOINT_META_MEMBER:
            self._meta = self._read_meta(member)
            return
        relpath = workspace_relpath(name)
        attrs = Attrs(member.mode & PERMISSION_BITS, member_mtime_ns(member))
        if relpath is None:
            if not member.isdir():
                raise ArchiveRejectedError(f"{CHECKPOINT_WORKSPACE_PREFIX} is not a directory")
            self._root = attrs
            return
        parts = relpath.split("/")
        try:
            if member.isdir():
                self._tree.make_dir(parts, attrs)
            elif member.issym():
                if not symlink_target_inside(relpath, member.linkname):
                    raise ArchiveRejectedError(f"symlink {shown(relpath)} points outside")
                self._tree.symlink(parts, member.linkname, attrs.mtime_ns)
            else:
                self._write_file(member, parts, attrs)
        except FileExistsError:
            raise ArchiveRejectedError(f"{shown(relpath)} already exists") from None
        # Checked after the member: one member enters at most its own depth (~2,000).
        if self._tree.entered > self._members + _ENTER_ALLOWANCE:
            raise ArchiveRejectedError(
                "archive re-enters directories too often (members not in tree order)"
            )

    def _read_meta(self, member: tarfile.TarInfo) -> bytes:
        if not member.isreg() or member.size > MAX_META_BYTES:
            raise ArchiveRejectedError(f"{CHECKPOINT_META_MEMBER} is not a small regular file")
        self._reader.allow(member.size + _HEADER_ALLOWANCE)
        data = self._read_exact(member.size)
        if len(data) != member.size:
            raise ArchiveRejectedError(f"{CHECKPOINT_META_MEMBER} is truncated")
        self._skip_padding(member.size)
        return data

    def _write_file(self, member: tarfile.TarInfo, parts: list[str], attrs: Attrs) -> None:
        if member.size > self._max_bytes - self._file_bytes:
            raise ArchiveRejectedError(f"archive holds more than {self._max_bytes} bytes")
        fd = self._tree.create_file(parts)
        try:
            self._reader.allow(member.size + _HEADER_ALLOWANCE)
            remaining = member.size
            while remaining:
                chunk = self._reader.read(min(remaining, _COPY_BYTES))
                if not chunk:
                    raise ArchiveRejectedError("tar: unexpected end of data")
                remaining -= len(chunk)
                # Bytes actually read, not the header's claim, count against the cap.
                self._file_bytes += len(chunk)
                if self._file_bytes > self._max_bytes:
                    raise ArchiveRejectedError(f"archive holds more than {self._max_bytes} bytes")
                write_all(fd, chunk)
            self._skip_padding(member.size)
            os.fchmod(fd, attrs.mode)
            os.utime(fd, ns=(attrs.mtime_ns, attrs.mtime_ns))
        finally:
            os.close(fd)

    def _read_exact(self, size: int) -> bytes:
        """``size`` bytes of the tar stream, fewer only where the stream ends."""
        first = self._reader.read(size) if size else memoryview(b"")
        if len(first) == size or not first:
            return first.tobytes()
        parts = [first.tobytes()]
        got = len(first)
        while got < size and (chunk := self._reader.read(size - got)):
            parts.append(chunk.tobytes())
            got += len(chunk)
        return b"".join(parts)

    def _skip_padding(self, size: int) -> None:
        # Data is padded to a whole block; the padding must be there, its bytes are unused.
        padding = -size % _BLOCK
        if len(self._read_exact(padding)) != padding:
            raise ArchiveRejectedError("tar: unexpected end of data")

    def _check_trailer(self) -> None:
        # The loop ended at a zero block; what follows may only be zero padding,
        # and the compressed stream must end right after it.
        self._reader.allow(_TRAILER_ALLOWANCE)
        while data := self._reader.read(_TRAILER_ALLOWANCE):
            if data.tobytes().strip(b"\0"):
                raise ArchiveRejectedError("tar: data after the end-of-archive marker")
