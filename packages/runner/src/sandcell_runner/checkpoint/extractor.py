"""The hardened extractor: one restore's extraction, in a child of the fork server.

The fork server (``extractor_server.py``) imports this module once; for each
restore it forks a child that calls ``serve`` with the ``ExtractorArgs`` the
runner sent and its descriptors: the read end of the archive's pipe, the staging
directory and the restore cgroup's files. The child joins the cgroup first,
makes the staging directory its working directory and, when it may (root), its
root directory too; drops to the pinned UID (when given) before reading a byte
of input; reads the compressed archive from the pipe, extracts its
``workspace/`` members there, writes one ``ChildResult`` JSON object on stdout
and exits: one process per restore, so nothing one archive did to it can reach
the next. Everything it needs is imported before the chroot, and it imports as
little as it can (no HTTP, anyio or subprocess).

Why not ``TarFile.extractall(filter="data")``: the data filter resolves names
with ``os.path.realpath`` against the live tree, which was bypassed repeatedly in
2024-2025 (CVE-2024-12718, CVE-2025-4138, -4330, -4517: symlink chains, PATH_MAX
truncation, hard links to symlinks), with fixes not in 3.11.7. Here tarfile only
parses header blocks and its data filter is a first check; on top of it:

- member types other than regular file, directory, symlink and a per-member PAX
  header are refused while the header is parsed, before any data is read, and
  PAX records are parsed strictly in linear time (``archive_rules.StrictTarInfo``);
- names must be normalized workspace paths under ``workspace/``
  (``archive_rules.workspace_relpath``), each member unique; symlink targets must
  provably stay inside (``archive_rules.symlink_target_inside``); hard links are
  refused outright;
- entries are created with ``*at()`` calls relative to directory fds opened with
  O_NOFOLLOW (leaves with O_EXCL), so no path is resolved through a symlink;
- members, file bytes actually read and metadata bytes per member are counted,
  and the compressed stream must end exactly where the archive does;
- all of it runs as the pinned UID, so even a bug here writes only what that UID may,
  and (as root) chrooted into the staging directory, so it cannot reach a path
  outside it at all; and (as root) under a job's jail (``confine.py``): its own
  cgroup, an empty network namespace, rlimits and a seccomp filter.

The stream is walked here rather than by tarfile's stream mode, whose reader
copies every chunk through bytes joins and slices: member data goes from the
decompressor's output straight to ``os.write``, about 3x faster.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import resource
import sys
import tarfile
from collections.abc import Sequence
from typing import NamedTuple, NoReturn

import msgspec

from sandcell_protocol import CheckpointMeta, ProtocolError, decode
from sandcell_protocol.routes import CHECKPOINT_META_MEMBER, CHECKPOINT_WORKSPACE_PREFIX

from ..errors import ArchiveRejectedError
from . import confine
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

__all__ = [
    "ChildResult",
    "ExtractorArgs",
    "Request",
    "checked_request",
    "extract",
    "parse_request",
    "prewarm",
    "serve",
    "serve_and_exit",
]


class ChildResult(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The extractor's verdict on stdout: ``meta`` (its JSON) when ``ok``, else ``reason``."""

    ok: bool
    meta: str | None = None
    reason: str | None = None


class ExtractorArgs(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the runner tells the extractor: its one message, as JSON.

    The descriptors travel with it, in this order: the archive's pipe, the
    staging directory, then ``cgroups`` open ``cgroup.procs`` files to join first
    (the runner's restore cgroup). Decoded by msgspec, which the child imports anyway.
    """

    encoding: Encoding
    max_bytes: int
    max_members: int
    uid: int | None = None
    gid: int | None = None
    cgroups: int = 0
    cgroups_move_thread: bool = False
    """The cgroup files are v1 ``tasks`` (they move the writing thread), not ``cgroup.procs``:
    the extractor joins only while it has that one thread, and refuses otherwise."""
    confine: bool = False
    """Apply a job's jail (``confine.py``): namespaces, rlimits, seccomp (root only)."""


_BLOCK = tarfile.BLOCKSIZE
# Decompressed bytes one member's headers may take, with the padding of the
# previous member's data: a PAX header (at most 16 KiB) and two header blocks
# fit with room to spare.
_HEADER_ALLOWANCE = 128 << 10
_TRAILER_ALLOWANCE = 64 << 10
_COPY_BYTES = 1 << 20
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def extract(
    source: RawSource,
    staging_fd: int,
    *,
    encoding: Encoding,
    max_bytes: int,
    max_members: int,
) -> bytes:
    """Extract the archive read from ``source`` into ``staging_fd``; return the meta member.

    ``staging_fd`` must also be the working directory: tarfile's data filter
    resolves names against it. Chrooted there, that path is ``/`` and the
    filter's ``realpath`` stats only the name's own components (~40 us less per
    member than with the staging directory's whole absolute path).
    """
    if os.listdir(staging_fd):
        raise ArchiveRejectedError("staging directory is not empty")
    if not os.path.samestat(os.fstat(staging_fd), os.stat(".")):
        raise ArchiveRejectedError("extractor: the staging directory is not the working directory")
    reader = DecompressingReader(source, encoding=encoding)
    extractor = _Extractor(
        reader,
        staging_fd,
        filter_dest=os.getcwd(),
        max_bytes=max_bytes,
        max_members=max_members,
    )
    try:
        meta = extractor.run()
    except tarfile.TarError as exc:
        raise ArchiveRejectedError(f"tar: {exc}") from None
    try:
        decode(meta, CheckpointMeta)
    except ProtocolError as exc:
        raise ArchiveRejectedError(f"invalid checkpoint metadata: {exc}") from None
    return meta


class _Attrs(NamedTuple):
    mode: int
    mtime_ns: int


class _Extractor:
    def __init__(
        self,
        reader: DecompressingReader,
        staging_fd: int,
        *,
        filter_dest: str,
        max_bytes: int,
        max_members: int,
    ) -> None:
        self._reader = reader
        self._tree = _DirStack(staging_fd)
        self._filter_dest = filter_dest
        self._max_bytes = max_bytes
        self._max_members = max_members
        self._members = 0
        self._file_bytes = 0
        # Digests, not names: 200k hostile 4 KiB names would otherwise cost 800 MB.
        self._seen: set[bytes] = set()
        self._meta: bytes | None = None
        self._root: _Attrs | None = None

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
        try:
            tarfile.data_filter(member.replace(name=relpath or ".", deep=False), self._filter_dest)
        except tarfile.FilterError as exc:
            # The class names the problem; its message would echo host paths.
            raise ArchiveRejectedError(
                f"data filter: {type(exc).__name__} ({shown(name)})"
            ) from None
        attrs = _Attrs(member.mode & PERMISSION_BITS, member_mtime_ns(member))
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

    def _read_meta(self, member: tarfile.TarInfo) -> bytes:
        if not member.isreg() or member.size > MAX_META_BYTES:
            raise ArchiveRejectedError(f"{CHECKPOINT_META_MEMBER} is not a small regular file")
        self._reader.allow(member.size + _HEADER_ALLOWANCE)
        data = self._read_exact(member.size)
        if len(data) != member.size:
            raise ArchiveRejectedError(f"{CHECKPOINT_META_MEMBER} is truncated")
        self._skip_padding(member.size)
        return data

    def _write_file(self, member: tarfile.TarInfo, parts: list[str], attrs: _Attrs) -> None:
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
                _write_all(fd, chunk)
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


class _OpenDir(NamedTuple):
    name: str
    fd: int
    attrs: _Attrs | None


class _DirStack:
    """The directories on the path of the last member, each held open.

    Every fd was opened relative to its parent with O_NOFOLLOW|O_DIRECTORY, and
    entries are created with ``*at()`` calls on them, so a symlink an earlier
    member planted can never redirect a later one. A directory's mode and mtime
    are applied when the walk leaves it, after its contents are in.
    """

    def __init__(self, root_fd: int) -> None:
        self._root_fd = root_fd
        self._open: list[_OpenDir] = []

    def make_dir(self, parts: list[str], attrs: _Attrs) -> None:
        self._parent_of(parts)
        self._enter(parts[-1], attrs)

    def create_file(self, parts: list[str]) -> int:
        return os.open(parts[-1], _NEW_FILE_FLAGS, 0o600, dir_fd=self._parent_of(parts))

    def symlink(self, parts: list[str], target: str, mtime_ns: int) -> None:
        parent_fd = self._parent_of(parts)
        os.symlink(target, parts[-1], dir_fd=parent_fd)
        os.utime(parts[-1], ns=(mtime_ns, mtime_ns), dir_fd=parent_fd, follow_symlinks=False)

    def finish(self, root: _Attrs | None) -> None:
        self._leave(0)
        if root is not None:
            _apply(self._root_fd, root)

    def close(self) -> None:
        while self._open:
            os.close(self._open.pop().fd)

    def _parent_of(self, parts: list[str]) -> int:
        dirs = parts[:-1]
        keep = 0
        for open_dir, name in zip(self._open, dirs, strict=False):
            if open_dir.name != name:
                break
            keep += 1
        self._leave(keep)
        for name in dirs[keep:]:
            self._enter(name, None)
        return self._open[-1].fd if self._open else self._root_fd

    def _enter(self, name: str, attrs: _Attrs | None) -> None:
        parent_fd = self._open[-1].fd if self._open else self._root_fd
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=parent_fd)
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise ArchiveRejectedError(
                    f"{shown(name)} is a symlink or file, not a directory"
                ) from None
            raise
        self._open.append(_OpenDir(name, fd, attrs))

    def _leave(self, keep: int) -> None:
        while len(self._open) > keep:
            open_dir = self._open.pop()
            try:
                if open_dir.attrs is not None:
                    _apply(open_dir.fd, open_dir.attrs)
            finally:
                os.close(open_dir.fd)


def _apply(fd: int, attrs: _Attrs) -> None:
    os.fchmod(fd, attrs.mode)
    os.utime(fd, ns=(attrs.mtime_ns, attrs.mtime_ns))


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data) :]


def _drop_privileges(uid: int, gid: int) -> None:
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid):
        raise SystemExit("extractor: could not drop privileges")


def _thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def _raise_fd_limit() -> None:
    # One fd per directory level of the deepest path (up to 2048 for 4 KiB paths).
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 4096 if hard == resource.RLIM_INFINITY else min(hard, 4096)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


MAX_REQUEST_BYTES = 4096
"""An ``ExtractorArgs`` message is about 150 bytes."""
MAX_REQUEST_FDS = 16


class Request(NamedTuple):
    """One restore, as received: its arguments and descriptors."""

    args: ExtractorArgs
    stream_fd: int
    staging_fd: int
    cgroup_fds: list[int]


def parse_request(message: bytes, fds: Sequence[int]) -> Request:
    """The runner's message and descriptors as a ``Request``; ``SystemExit`` if malformed."""
    try:
        args = msgspec.json.decode(message, type=ExtractorArgs)
    except msgspec.MsgspecError as exc:
        raise SystemExit(f"extractor: {exc}") from None
    return checked_request(args, fds)


def checked_request(args: ExtractorArgs, fds: Sequence[int]) -> Request:
    """``args`` with its descriptors, which must be exactly the ones it names."""
    if len(fds) != 2 + args.cgroups:
        raise SystemExit(f"extractor: expected {2 + args.cgroups} descriptors, got {len(fds)}")
    return Request(args, fds[0], fds[1], list(fds[2:]))


def prewarm() -> None:
    """First-use costs paid while the server waits rather than by the restore (~1 CPU-ms):
    msgspec's type information for the messages, the decompressors' setup."""
    for type_ in (CheckpointMeta, ExtractorArgs, ChildResult):
        msgspec.json.Decoder(type_)
    DecompressingReader.prewarm()


def serve(request: Request, *, die_with: int | None = None) -> int:
    """Run one extraction; the verdict goes to stdout, exit 0 unless the child itself broke.

    ``die_with``: the pid of the parent this process must not outlive (the fork
    server's); its death signal is set after the privilege drop, which clears it.
    """
    args = request.args
    if args.cgroups_move_thread and _thread_count() != 1:
        # A second thread would stay behind in the runner's cgroup, unbounded.
        raise SystemExit("extractor: more than one thread; cannot join the restore cgroup")
    for fd in request.cgroup_fds:
        # First: everything from here on (memory, tasks, CPU) is the restore's.
        os.write(fd, b"0")
        os.close(fd)
    _raise_fd_limit()
    os.fchdir(request.staging_fd)
    if os.geteuid() == 0:
        if args.confine:
            confine.isolate_namespaces()
        # Before the privilege drop (chroot needs CAP_SYS_CHROOT), after every import.
        os.chroot(".")
    if args.confine:
        confine.limit_resources(max_file_bytes=args.max_bytes)
    if args.uid is not None:
        _drop_privileges(args.uid, args.gid if args.gid is not None else args.uid)
    if die_with is not None:
        confine.die_with_parent(die_with)
    if args.confine:
        # Last: from here on only what extracting needs (no exec, fork or socket).
        confine.install_seccomp()
    os.umask(0o077)
    try:
        meta = extract(
            lambda size: os.read(request.stream_fd, size),
            request.staging_fd,
            encoding=args.encoding,
            max_bytes=args.max_bytes,
            max_members=args.max_members,
        )
        result = ChildResult(ok=True, meta=meta.decode("utf-8"))
    except ArchiveRejectedError as exc:
        result = ChildResult(ok=False, reason=str(exc))
    except OSError as exc:
        # ENOSPC, EDQUOT, EACCES from a hostile mode: the archive cannot land.
        result = ChildResult(ok=False, reason=f"extract failed: {exc.strerror}")
    sys.stdout.buffer.write(msgspec.json.encode(result))
    sys.stdout.buffer.flush()
    return 0


def serve_and_exit(request: Request, *, die_with: int | None = None) -> NoReturn:
    """``serve``, then ``os._exit``: no interpreter shutdown.

    Shutdown would end the decompressing thread with ``pthread_exit``, which
    loads libgcc_s on first use, and a chrooted process cannot reach it (the
    child aborted). Nothing is left to flush but the standard streams.
    """
    try:
        code = serve(request, die_with=die_with)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
