"""A spawn request as the helper checks it, and the forked child's steps from it to exec.

Part of the resident spawn helper (``spawnd.py``, which says why it exists): the
helper runs with the standard library only, and imports this module from beside it.
``Job`` checks everything a request carries before any child exists; ``child`` is the
fork path's set-up in Python, the same steps in the same order as ``_vfork.c``'s.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import signal

PR_SET_PDEATHSIG = 1
CLONE_NEWNET = 0x40000000

libc = ctypes.CDLL(None, use_errno=True)


def _fail(errpipe: int, step: str, exc: BaseException) -> None:
    code = exc.errno if isinstance(exc, OSError) and exc.errno else 0
    try:
        os.write(errpipe, f"{step}:{code}:{exc}"[:400].encode("utf-8", "replace"))
    finally:
        os._exit(127)


class Job:
    """A spawn request, checked before the fork (the child only acts on it)."""

    __slots__ = (
        "argv",
        "cwd",
        "env",
        "gid",
        "join_fds",
        "join_paths",
        "netns",
        "quiet",
        "seq",
        "setsid",
        "targets",
        "uid",
    )

    def __init__(self, request: dict[str, object], fd_count: int) -> None:
        self.seq = _int(request["seq"])
        self.argv = [str(arg) for arg in _list(request["argv"])]
        env = request["env"]
        if not isinstance(env, dict) or not self.argv:
            raise ValueError("bad request")
        self.env = {str(key): str(value) for key, value in env.items()}
        # The first descriptors go to these numbers in the child; the rest (cgroup
        # files, a namespace) are used before exec and not inherited.
        self.targets = [_int(fd) for fd in _list(request["targets"])]
        if len(self.targets) > fd_count or min(self.targets, default=0) < 0:
            raise ValueError("more targets than descriptors")
        self.join_paths = [str(path) for path in _list(request.get("join_paths", []))]
        self.join_fds = [_index(i, fd_count) for i in _list(request.get("join_fds", []))]
        netns = request.get("netns")
        self.netns = None if netns is None else _index(netns, fd_count)
        cwd = request.get("cwd")
        self.cwd = None if cwd is None else str(cwd)
        uid, gid = request.get("uid"), request.get("gid")
        self.uid = None if uid is None else _id(uid)
        self.gid = self.uid if gid is None else _id(gid)
        self.setsid = bool(request.get("setsid", True))
        self.quiet = bool(request.get("quiet", False))
        """Answer only a failure; the exit names the request (``SpawnHelper.start``)."""


def _int(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError("not an integer")
    return value


def _id(value: object) -> int:
    """A UID or GID: 32 bits, and not (uid_t) -1, which means "leave it" to setresuid."""
    number = _int(value)
    if not 0 <= number < 0xFFFFFFFF:
        raise ValueError("uid or gid out of range")
    return number


def _list(value: object) -> list[object]:
    if not isinstance(value, list):
        raise TypeError("not a list")
    return value


def _index(value: object, count: int) -> int:
    index = _int(value)
    if not 0 <= index < count:
        raise ValueError("descriptor index out of range")
    return index


def _check(result: int) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def child(job: Job, fds: list[int], errpipe: int, parent: int) -> None:
    """In the forked child: set up, then exec. Never returns."""
    step = "setup"
    try:
        # Python ignores these; an ignored disposition survives exec (as subprocess resets).
        for signum in (signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(signum, signal.SIG_DFL)
        if job.setsid:
            step = "setsid"
            os.setsid()
        if job.netns is not None:
            step = "setns"
            _check(libc.setns(fds[job.netns], CLONE_NEWNET))
        step = "cgroup"
        for path in job.join_paths:
            fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
            os.write(fd, b"0")
            os.close(fd)
        for index in job.join_fds:
            os.write(fds[index], b"0")
        if job.cwd is not None:
            step = "chdir"
            os.chdir(job.cwd)
        # Descriptors go to the numbers the runner gave them (its argv names them):
        # everything first above every target, so no dup2 clobbers a source.
        step = "fds"
        base = max([*job.targets, *fds, errpipe, 2]) + 1
        errpipe = fcntl.fcntl(errpipe, fcntl.F_DUPFD_CLOEXEC, base)
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, base) for fd in fds[: len(job.targets)]]
        for source, target in zip(high, job.targets, strict=True):
            os.dup2(source, target, inheritable=True)
        if job.uid is not None and job.gid is not None:
            step = "setuid"
            os.setgroups([])
            os.setresgid(job.gid, job.gid, job.gid)
            os.setresuid(job.uid, job.uid, job.uid)
        # After the UID switch, which clears it; then make sure the helper did not
        # die before it was set (the signal would never come).
        step = "pdeathsig"
        _check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0))
        if os.getppid() != parent:
            os._exit(126)
        step = "exec"
        os.execve(job.argv[0], job.argv, job.env)  # noqa: S606 (argv is the runner's own)
    except BaseException as exc:
        _fail(errpipe, step, exc)


def env_entry(key: str, value: str) -> bytes:
    if not key or "=" in key:
        raise ValueError("illegal environment variable name")
    return os.fsencode(key) + b"=" + os.fsencode(value)


__all__ = ["CLONE_NEWNET", "PR_SET_PDEATHSIG", "Job", "child", "env_entry", "libc"]
