"""Checkpoint restore: feed an archive to the hardened extractor in a child process.

The extraction itself (decompression, tar parsing, file creation) happens in
``extractor_child.py`` (running ``extractor.py``), a separate process that
drops to the workspace's pinned UID before it reads a byte: a parser bug can
then write only what that UID may, and nothing of it runs in the runner's
address space. This side has the fork
server (``extractor_process``) fork a child, handing it the read end of a pipe
with the staging directory, streams the request body into the pipe with
backpressure, hashes what it sent, and turns the child's verdict into
``CheckpointMeta`` or ``ArchiveRejectedError``.

What a restore accepts at the tar level is stated in ``archive_rules``.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import anyio
import anyio.to_thread
import msgspec

from sandcell_protocol import CheckpointMeta, ProtocolError, decode

from ..cancelling import to_thread_to_the_end
from ..errors import ArchiveRejectedError
from . import confine
from .archive_rules import MAX_META_BYTES
from .compression import Encoding
from .export import ArchiveLimits
from .extractor_child import ChildResult, ExtractorArgs
from .extractor_process import ExtractorProcess, ExtractorServer, ServerLostError

__all__ = ["ChildResult", "restore_checkpoint"]

# The meta member travels back as a JSON string: escaping at most doubles it.
_MAX_RESULT_BYTES = 2 * MAX_META_BYTES + 4096
_STDERR_TAIL_BYTES = 4096
# With CAP_SYS_RESOURCE a pipe may grow past /proc/sys/fs/pipe-max-size (1 MiB
# by default): 16 MiB of body then waits in the kernel while the extractor
# starts. Without it (containers often drop it) the pipe gets pipe-max-size.
# Pages are only taken as data arrives.
_PIPE_BYTES_PRIVILEGED = 16 << 20
_PIPE_BYTES = 1 << 20
_READ_BYTES = 64 << 10
_STAGING_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


async def restore_checkpoint(
    chunks: AsyncIterator[bytes],
    staging: Path,
    *,
    uid: int,
    gid: int,
    encoding: Encoding,
    limits: ArchiveLimits,
    expected_sha256: str | None,
    cgroup_fds: Sequence[int] = (),
    cgroup_fds_move_thread: bool = False,
    extractors: ExtractorServer | None = None,
) -> CheckpointMeta:
    """Extract a checkpoint archive into the empty directory ``staging``, as ``uid:gid``.

    Returns the archive's ``CheckpointMeta``. Any failure (a hostile or corrupt
    archive, a limit, a digest mismatch, the extractor dying) raises
    ``ArchiveRejectedError`` and leaves ``staging`` in an unspecified state for
    the caller to delete; nothing outside ``staging`` is touched. When the
    runner is not root, ``uid`` must be its own UID. Cancelling the call kills
    the extractor. ``cgroup_fds``: open ``cgroup.procs`` files (the caller's to
    close) of the cgroup the extractor joins before anything else (a job's limits),
    or v1 ``tasks`` files with ``cgroup_fds_move_thread`` (cheaper: ``session.py``);
    as root it also gets a job's namespaces, rlimits and seccomp filter (``confine.py``).
    ``extractors``: the fork server the extractor child comes from (the runner's,
    started ahead); by default one is started for this call and stopped after it.
    """
    privileged = os.geteuid() == 0
    if not privileged and uid != os.getuid():
        raise ArchiveRejectedError(f"cannot restore as uid {uid}: the runner is not root")
    try:
        # To its end, closed when cancelled: a native cancellation passes anyio's thread
        # wait, and the descriptor opened after it was never closed.
        staging_fd = await to_thread_to_the_end(
            functools.partial(os.open, staging, _STAGING_FLAGS), undo=os.close
        )
    except OSError as exc:
        raise ArchiveRejectedError(f"staging is not a directory: {exc.strerror}") from exc
    # The child drops privileges itself, after its imports: the interpreter and
    # this package need not be readable by the sandbox UID.
    drop = privileged and uid != os.geteuid()
    args = ExtractorArgs(
        encoding=encoding,
        max_bytes=limits.max_bytes,
        max_members=limits.max_members,
        uid=uid if drop else None,
        gid=gid if drop else None,
        cgroups=len(cgroup_fds),
        cgroups_move_thread=cgroup_fds_move_thread,
        confine=privileged and confine.supported(),
    )
    server = extractors if extractors is not None else ExtractorServer()
    try:
        result, digest = await _run_child(server, args, chunks, (staging_fd, *cgroup_fds))
    finally:
        os.close(staging_fd)
        if extractors is None:
            with anyio.CancelScope(shield=True):
                await server.aclose()
    if not result.ok:
        raise ArchiveRejectedError(result.reason or "archive rejected")
    if expected_sha256 is not None and digest != expected_sha256.lower():
        raise ArchiveRejectedError("archive sha256 does not match the expected digest")
    try:
        return decode((result.meta or "").encode("utf-8"), CheckpointMeta)
    except ProtocolError as exc:
        raise ArchiveRejectedError(f"invalid checkpoint metadata: {exc}") from exc


async def _forked(
    server: ExtractorServer, args: ExtractorArgs, fds: Sequence[int]
) -> ExtractorProcess:
    """A child holding the request; a second try (with a new server) if the server was lost."""
    try:
        return await server.extract(args, fds)
    except ServerLostError:
        # Killed while idle (OOM, an operator): no byte of the body is spent yet.
        return await server.extract(args, fds)


async def _run_child(
    server: ExtractorServer, args: ExtractorArgs, chunks: AsyncIterator[bytes], fds: Sequence[int]
) -> tuple[ChildResult, str]:
    read_fd, write_fd = _archive_pipe()
    run = _ChildRun(write_fd)
    try:
        process = await _forked(server, args, (read_fd, *fds))
    except BaseException:
        run.close_pipe()
        raise
    finally:
        os.close(read_fd)
    try:
        # The tasks never raise (task groups would wrap it in an ExceptionGroup):
        # they record a failure and kill the child, which ends the others.
        async with anyio.create_task_group() as tg:
            tg.start_soon(run.feed, process, chunks)
            tg.start_soon(run.collect, process, process.stdout_fd, run.stdout, _MAX_RESULT_BYTES)
            tg.start_soon(run.collect, process, process.stderr_fd, run.stderr, None)
        returncode = await process.wait()
    finally:
        run.close_pipe()
        process.kill()
        with anyio.CancelScope(shield=True):
            await process.wait()
        process.close()
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

    async def feed(self, process: ExtractorProcess, chunks: AsyncIterator[bytes]) -> None:
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
        self, process: ExtractorProcess, fd: int, into: bytearray, cap: int | None
    ) -> None:
        """Read the pipe ``fd`` to its end: refuse to grow past ``cap``, or keep only a tail."""
        while True:
            try:
                data = os.read(fd, _READ_BYTES)
            except BlockingIOError:
                await anyio.wait_readable(fd)
                continue
            if not data:
                break
            into += data
            if cap is None:
                del into[:-_STDERR_TAIL_BYTES]
            elif len(into) > cap:
                self._fail(process, ArchiveRejectedError("extractor output too large"))
                break
        if cap is not None:
            self.feed_scope.cancel()

    def _fail(self, process: ExtractorProcess, failure: ArchiveRejectedError) -> None:
        if self.failure is None:
            self.failure = failure
        process.kill()
