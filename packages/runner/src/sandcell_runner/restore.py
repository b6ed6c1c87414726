"""Checkpoint restore: feed an archive to the hardened extractor in a child process.

The extraction itself (decompression, tar parsing, file creation) happens in
``restore_child``, a separate process that drops to the workspace's pinned UID
before it reads a byte: a parser bug can then write only what that UID may,
and nothing of it runs in the runner's address space. This side streams the
request body into the child's stdin with backpressure, hashes what it sent,
and turns the child's verdict into ``CheckpointMeta`` or ``ArchiveRejectedError``.

The second half of this module states what a restore accepts at the tar level
(``StrictTarInfo``, ``workspace_relpath``, ``member_mtime_ns``); the child
parses with it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import subprocess
import sys
import tarfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import anyio
import anyio.abc
import anyio.to_thread
import msgspec

from sandcell_protocol import CheckpointMeta, ProtocolError, decode, validate_workspace_path
from sandcell_protocol.routes import CHECKPOINT_WORKSPACE_PREFIX

from .checkpoint import MAX_META_BYTES, ArchiveLimits
from .compression import Encoding
from .errors import ArchiveRejectedError

__all__ = ["ChildResult", "restore_checkpoint"]

# The meta member travels back as a JSON string: escaping at most doubles it.
_MAX_RESULT_BYTES = 2 * MAX_META_BYTES + 4096
_STDERR_TAIL_BYTES = 4096
# Root may size a pipe past pipe-max-size (1 MiB): 16 MiB of body then waits in
# the kernel while the extractor starts. Pages are only taken as data arrives.
_PIPE_BYTES_PRIVILEGED = 16 << 20
_PIPE_BYTES = 1 << 20
_STAGING_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class ChildResult(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The extractor's verdict on stdout: ``meta`` (its JSON) when ``ok``, else ``reason``."""

    ok: bool
    meta: str | None = None
    reason: str | None = None


async def restore_checkpoint(
    chunks: AsyncIterator[bytes],
    staging: Path,
    *,
    uid: int,
    gid: int,
    encoding: Encoding,
    limits: ArchiveLimits,
    expected_sha256: str | None,
) -> CheckpointMeta:
    """Extract a checkpoint archive into the empty directory ``staging``, as ``uid:gid``.

    Returns the archive's ``CheckpointMeta``. Any failure (a hostile or corrupt
    archive, a limit, a digest mismatch, the extractor dying) raises
    ``ArchiveRejectedError`` and leaves ``staging`` in an unspecified state for
    the caller to delete; nothing outside ``staging`` is touched. When the
    runner is not root, ``uid`` must be its own UID. Cancelling the call kills
    the extractor.
    """
    privileged = os.geteuid() == 0
    if not privileged and uid != os.getuid():
        raise ArchiveRejectedError(f"cannot restore as uid {uid}: the runner is not root")
    try:
        staging_fd = await anyio.to_thread.run_sync(os.open, staging, _STAGING_FLAGS)
    except OSError as exc:
        raise ArchiveRejectedError(f"staging is not a directory: {exc.strerror}") from exc
    argv = [
        sys.executable,
        "-I",  # no cwd, user site or PYTHON* variables on sys.path
        "-X",
        "utf8",
        "-m",
        "sandcell_runner.restore_child",
        f"--staging-fd={staging_fd}",
        f"--encoding={encoding}",
        f"--max-bytes={limits.max_bytes}",
        f"--max-members={limits.max_members}",
    ]
    if privileged and uid != os.geteuid():
        # The child drops privileges itself, after its imports: the interpreter
        # and this package need not be readable by the sandbox UID.
        argv += [f"--uid={uid}", f"--gid={gid}"]
    try:
        result, digest = await _run_child(argv, chunks, staging_fd)
    finally:
        os.close(staging_fd)
    if not result.ok:
        raise ArchiveRejectedError(result.reason or "archive rejected")
    if expected_sha256 is not None and digest != expected_sha256.lower():
        raise ArchiveRejectedError("archive sha256 does not match the expected digest")
    try:
        return decode((result.meta or "").encode("utf-8"), CheckpointMeta)
    except ProtocolError as exc:
        raise ArchiveRejectedError(f"invalid checkpoint metadata: {exc}") from exc


async def _run_child(
    argv: list[str], chunks: AsyncIterator[bytes], staging_fd: int
) -> tuple[ChildResult, str]:
    read_fd, write_fd = _archive_pipe()
    run = _ChildRun(write_fd)
    try:
        process = await anyio.open_process(
            argv,
            stdin=read_fd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(staging_fd,),
            cwd="/",
            env={},
        )
    except BaseException:
        run.close_pipe()
        raise
    finally:
        os.close(read_fd)
    try:
        assert process.stdout is not None
        assert process.stderr is not None
        # The tasks never raise (task groups would wrap it in an ExceptionGroup):
        # they record a failure and kill the child, which ends the others.
        async with anyio.create_task_group() as tg:
            tg.start_soon(run.feed, process, chunks)
            tg.start_soon(run.collect, process, process.stdout, run.stdout, _MAX_RESULT_BYTES)
            tg.start_soon(run.collect, process, process.stderr, run.stderr, None)
        returncode = await process.wait()
    finally:
        run.close_pipe()
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
        with anyio.CancelScope(shield=True):
            await process.aclose()
    if run.failure is not None:
        raise run.failure
    if returncode != 0:
        tail = run.stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
        raise ArchiveRejectedError(f"extractor failed (exit {returncode}): {tail[0][:300]}")
    try:
        result = msgspec.json.decode(bytes(run.stdout), type=ChildResult)
    except msgspec.MsgspecError as exc:
        raise ArchiveRejectedError(f"extractor gave no verdict: {exc}") from exc
    return result, run.hasher.hexdigest()


def _archive_pipe() -> tuple[int, int]:
    """The child's stdin: a pipe as large as the kernel allows, its write end non-blocking.

    Made here rather than by ``open_process`` so that it is large before the
    child starts: the body keeps flowing into it while the child's interpreter
    starts, and the two processes take turns far less often afterwards.
    """
    read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
    for size in (_PIPE_BYTES_PRIVILEGED, _PIPE_BYTES):
        try:
            fcntl.fcntl(write_fd, fcntl.F_SETPIPE_SZ, size)
            break
        except OSError:
            continue  # past /proc/sys/fs/pipe-max-size without CAP_SYS_RESOURCE
    os.set_blocking(write_fd, False)
    return read_fd, write_fd


async def _write_pipe(fd: int, data: bytes) -> None:
    # os.write on a non-blocking pipe plus the event loop's writability wait:
    # no buffering transport between the body and the pipe, and no copy of the tail.
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:
            await anyio.wait_writable(fd)


class _ChildRun:
    """The parent's half of one extraction: the bytes it sent, what came back."""

    def __init__(self, pipe_fd: int) -> None:
        self._pipe_fd: int | None = pipe_fd
        self.hasher = hashlib.sha256()
        self.stdout = bytearray()
        self.stderr = bytearray()
        self.failure: ArchiveRejectedError | None = None
        # Cancelled once the child closes its stdout: a child that rejected
        # early must not wait for a slow client's next chunk to be noticed.
        self.feed_scope = anyio.CancelScope()

    def close_pipe(self) -> None:
        """Close the child's stdin (its end of input); idempotent."""
        if self._pipe_fd is not None:
            os.close(self._pipe_fd)
            self._pipe_fd = None

    async def feed(self, process: anyio.abc.Process, chunks: AsyncIterator[bytes]) -> None:
        """Copy the body into the child's stdin, waiting while the pipe is full; closes it."""
        assert self._pipe_fd is not None
        pipe_fd = self._pipe_fd
        try:
            with self.feed_scope:
                async for chunk in chunks:
                    if chunk:
                        self.hasher.update(chunk)
                        await _write_pipe(pipe_fd, chunk)
        except BrokenPipeError:
            pass  # the child stopped reading: it has a verdict already
        except Exception as exc:  # the body failed: the archive is incomplete
            self._fail(process, ArchiveRejectedError(f"reading the archive failed: {exc}"))
        finally:
            self.close_pipe()

    async def collect(
        self,
        process: anyio.abc.Process,
        stream: anyio.abc.ByteReceiveStream,
        into: bytearray,
        cap: int | None,
    ) -> None:
        """Read ``stream`` to its end: refuse to grow past ``cap``, or keep only a tail."""
        async for data in stream:
            into += data
            if cap is None:
                del into[:-_STDERR_TAIL_BYTES]
            elif len(into) > cap:
                self._fail(process, ArchiveRejectedError("extractor output too large"))
                break
        if cap is not None:
            self.feed_scope.cancel()

    def _fail(self, process: anyio.abc.Process, failure: ArchiveRejectedError) -> None:
        if self.failure is None:
            self.failure = failure
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()


# -- What a restore accepts. The extractor (restore_child) parses with these:
# tarfile only parses header blocks; these rules sit on top of it.

_PAX_MAX_BYTES = 16 << 10
_PAX_KEYS = frozenset({"path", "linkpath", "mtime", "size"})
_MTIME_RE = re.compile(r"(-?)([0-9]{1,11})(?:\.([0-9]{1,9}))?")
_MAX_MTIME_S = 10**11
_ALLOWED_TYPES = frozenset(
    {tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.XHDTYPE}
)
_REFUSED_TYPES = {
    tarfile.LNKTYPE: "hard links are not allowed",
    tarfile.CHRTYPE: "character devices are not allowed",
    tarfile.BLKTYPE: "block devices are not allowed",
    tarfile.FIFOTYPE: "FIFOs are not allowed",
    tarfile.XGLTYPE: "global PAX headers are not allowed",
    tarfile.GNUTYPE_SPARSE: "sparse members are not allowed",
}


ReadExact = Callable[[int], bytes]
"""``read(n)`` of the decompressed tar stream: ``n`` bytes, fewer only where it ends."""


class StrictTarInfo(tarfile.TarInfo):
    """A TarInfo that refuses, at parse time, everything a checkpoint never holds.

    tarfile parses each header block (``frombuf``); ``next_member`` walks the
    stream instead of tarfile's stream reader, so that the extractor can copy
    member data straight from the decompressor. On top of tarfile's header
    parser: member types are checked from the header before any data is read;
    a bad or missing header past the first fails instead of quietly ending the
    archive; PAX headers (per-member only, at most 16 KiB, known keys only) are
    parsed by ``parse_pax_records`` in linear time instead of tarfile's
    backtracking regexes (CVE-2024-6232 is not fixed in 3.11.7).
    """

    @classmethod
    def frombuf(cls, buf: bytes | bytearray, encoding: str, errors: str) -> StrictTarInfo:
        if len(buf) == tarfile.BLOCKSIZE and not buf.strip(b"\0"):
            # The end-of-archive marker: tarfile raises its EOF error. Only a
            # PAX header's member can get here (next_member stops before).
            return super().frombuf(buf, encoding, errors)
        try:
            info = super().frombuf(buf, encoding, errors)
        except tarfile.HeaderError as exc:
            raise ArchiveRejectedError(f"tar: {exc} (corrupt or truncated archive)") from None
        except UnicodeError:
            raise ArchiveRejectedError("tar: a member name is not UTF-8") from None
        if info.type in _REFUSED_TYPES:
            raise ArchiveRejectedError(f"tar: {_REFUSED_TYPES[info.type]} ({shown(info.name)})")
        if info.type not in _ALLOWED_TYPES:
            raise ArchiveRejectedError(f"tar: unsupported member type {info.type!r}")
        if info.size < 0 or (info.type in (tarfile.DIRTYPE, tarfile.SYMTYPE) and info.size):
            raise ArchiveRejectedError(f"tar: bad size in header of {shown(info.name)}")
        if info.type == tarfile.XHDTYPE and info.size > _PAX_MAX_BYTES:
            raise ArchiveRejectedError("tar: PAX header too large")
        if info.isdir():
            # What tarfile's member processing does after frombuf: a ustar
            # prefix joined to an empty name leaves a trailing slash.
            info.name = info.name.rstrip("/")
        return info

    @classmethod
    def next_member(cls, read: ReadExact) -> StrictTarInfo | None:
        """The next member's header (and PAX header), or None at the end-of-archive marker.

        Reads headers only: the caller then reads ``size`` bytes of data and
        the padding to the next 512-byte block.
        """
        buf = read(tarfile.BLOCKSIZE)
        if len(buf) == tarfile.BLOCKSIZE and not buf.strip(b"\0"):
            return None
        info = cls.frombuf(buf, "utf-8", "strict")
        if info.type != tarfile.XHDTYPE:
            return info
        padded = _padded(info.size)
        pax = read(padded)
        if len(pax) != padded:
            raise ArchiveRejectedError("tar: truncated PAX header")
        records = parse_pax_records(pax[: info.size])
        try:
            member = cls.frombuf(read(tarfile.BLOCKSIZE), "utf-8", "strict")
        except tarfile.HeaderError:
            raise ArchiveRejectedError("tar: PAX header not followed by a member") from None
        if member.type == tarfile.XHDTYPE:
            raise ArchiveRejectedError("tar: two PAX headers in a row")
        if "path" in records:
            member.name = records["path"].rstrip("/") if member.isdir() else records["path"]
        if "linkpath" in records:
            member.linkname = records["linkpath"]
        if "size" in records:
            size = records["size"]
            if not member.isreg() or not (size.isascii() and size.isdigit() and len(size) < 20):
                raise ArchiveRejectedError("tar: bad PAX size")
            member.size = int(size)
        member.pax_headers = records
        return member


def parse_pax_records(buf: bytes) -> dict[str, str]:
    """Parse ``"<len> <key>=<value>\\n"`` records strictly; any deviation is refused."""
    records: dict[str, str] = {}
    pos = 0
    while pos < len(buf):
        space = buf.find(b" ", pos, pos + 8)
        digits = buf[pos:space] if space > pos else b""
        if not digits.isdigit() or digits.startswith(b"0"):
            raise ArchiveRejectedError("tar: malformed PAX record length")
        end = pos + int(digits)
        if end > len(buf) or buf[end - 1 : end] != b"\n":
            raise ArchiveRejectedError("tar: PAX record overruns its header")
        key, eq, value = buf[space + 1 : end - 1].partition(b"=")
        try:
            key_text, value_text = key.decode("ascii"), value.decode("utf-8")
        except UnicodeError:
            raise ArchiveRejectedError("tar: PAX record is not UTF-8") from None
        if not eq or key_text not in _PAX_KEYS or key_text in records:
            raise ArchiveRejectedError(f"tar: unexpected PAX record {key_text!r}")
        records[key_text] = value_text
        pos = end
    return records


def workspace_relpath(name: str) -> str | None:
    """``workspace/<relpath>`` to ``relpath``, ``workspace`` to None; refuse anything else.

    The relpath must already be normalized: the exporter writes it so, and two
    spellings of one path are how duplicate checks get fooled.
    """
    if name.startswith("/"):
        raise ArchiveRejectedError(f"absolute member name {shown(name)}")
    if ".." in name.split("/"):
        raise ArchiveRejectedError(f"member name {shown(name)} contains '..'")
    if name == CHECKPOINT_WORKSPACE_PREFIX:
        return None
    prefix = CHECKPOINT_WORKSPACE_PREFIX + "/"
    if not name.startswith(prefix):
        raise ArchiveRejectedError(f"member {shown(name)} is outside {prefix}")
    relpath = name[len(prefix) :]
    try:
        normalized = validate_workspace_path(relpath)
    except ProtocolError as exc:
        raise ArchiveRejectedError(f"member {shown(name)}: {exc}") from None
    if normalized != relpath:
        raise ArchiveRejectedError(f"member name {shown(name)} is not normalized")
    return relpath


def member_mtime_ns(member: tarfile.TarInfo) -> int:
    """The member's mtime in ns: the exporter's PAX record if any, else the header's."""
    text = member.pax_headers.get("mtime")
    if text is None:
        seconds = int(member.mtime)
        if abs(seconds) >= _MAX_MTIME_S:
            raise ArchiveRejectedError(f"mtime out of range in {shown(member.name)}")
        return seconds * 1_000_000_000
    match = _MTIME_RE.fullmatch(text)
    if match is None:
        raise ArchiveRejectedError(f"bad mtime {text[:40]!r} in {shown(member.name)}")
    sign, seconds_text, fraction = match.groups()
    value = int(seconds_text) * 1_000_000_000 + int((fraction or "").ljust(9, "0"))
    return -value if sign else value


def shown(name: str) -> str:
    """A member name for an error message: quoted, and short."""
    return repr(name if len(name) <= 120 else name[:120] + "...")


def _padded(size: int) -> int:
    return -(-size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
