"""The extractor child: one restore's extraction, in a child of the fork server.

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

The extraction itself, and why it is safe, is ``extractor.py``.
"""

from __future__ import annotations

import os
import resource
import sys
from collections.abc import Sequence
from typing import NamedTuple, NoReturn

import msgspec

from sandcell_protocol import CheckpointMeta

from ..errors import ArchiveRejectedError
from . import confine
from .compression import DecompressingReader, Encoding
from .extractor import extract

__all__ = [
    "ChildResult",
    "ExtractorArgs",
    "Request",
    "checked_request",
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
