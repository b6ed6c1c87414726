"""The extractor fork server: imported once, it forks one jailed child per restore.

    python -I -X utf8 -m sandcell_runner.checkpoint.extractor_server <runner pid>
    (fd 0: a SOCK_SEQPACKET socket to the runner)

Why. A fresh extractor per restore cost an interpreter start and its imports
(~155 CPU-ms, 30-100 ms of waiting on this 2-core machine), paid for every
restore either on its path or by a spare started after it, competing with the
next. A fork of an imported process costs ~1 ms, and the child starts exactly
where a fresh one stood: every import done, nothing of any archive seen.

Each child (``extractor_child.serve``) still joins the restore's cgroup first, gets
its own network and IPC namespace, chroots into the staging directory, drops to
the pinned UID and installs the extractor's seccomp filter before it reads a
byte, and exits after its one restore: no state outlives a restore, and no
session meets another's extractor. The child closes the server's socket and the
pidfds of its siblings before anything else.

The server itself is jailed once, after its imports (as root, where the filter
exists): an empty network namespace, no core dumps, ``no_new_privs`` and a
filter like a child's that still lets its children unshare and chroot (no exec,
no sockets, no mounts). It has ``PR_SET_PDEATHSIG`` towards the runner and exits
on its socket's EOF; its children have it towards the server, so killing the
runner ends them all.

Wire (JSON datagrams): runner -> server ``ForkRequest`` with descriptors
[stdout, stderr, archive pipe, staging dir, cgroup files...]; server -> runner
``ready`` once imported, then per request ``forked`` (the child's pidfd attached)
or ``failed``, and ``exited`` with its wait status once reaped.
"""

from __future__ import annotations

import os
import select
import socket
import sys

import msgspec

from . import confine
from .extractor_child import (
    ExtractorArgs,
    Request,
    checked_request,
    prewarm,
    serve_and_exit,
)

MAX_MESSAGE_BYTES = 4096
"""A ``ForkRequest`` is about 200 bytes."""
MAX_FDS = 16
MAX_CHILDREN = 8
"""Restores at once (a runner serializes its session's; more is a runaway caller)."""


class ForkRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One restore: the runner's sequence number and the child's arguments."""

    seq: int
    args: ExtractorArgs


class Reply(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the server says: ``ready``; ``forked``/``failed`` (``seq``); ``exited`` (``pid``)."""

    op: str
    seq: int | None = None
    pid: int | None = None
    status: int | None = None
    why: str | None = None


_encode = msgspec.json.Encoder().encode
_decode_request = msgspec.json.Decoder(ForkRequest).decode


class Server:
    """The server's state: its socket and its unreaped children (pidfd -> pid)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.pid = os.getpid()
        self.poller = select.poll()
        self.poller.register(sock.fileno(), select.POLLIN)
        self.children: dict[int, int] = {}

    def send(self, reply: Reply, fds: list[int] | None = None) -> None:
        socket.send_fds(self.sock, [_encode(reply)], fds or [])

    def run(self) -> None:
        self.send(Reply(op="ready"))
        while True:
            for fd, _ in self.poller.poll():
                if fd == self.sock.fileno():
                    if not self.receive():
                        return
                else:
                    self.reap(fd)

    def receive(self) -> bool:
        """One request; False at EOF (the runner is gone or closed us)."""
        data, fds, flags, _ = socket.recv_fds(
            self.sock, MAX_MESSAGE_BYTES, MAX_FDS, socket.MSG_CMSG_CLOEXEC
        )
        try:
            if not data:
                return False
            self.fork(data, fds, truncated=bool(flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC)))
        finally:
            for fd in fds:
                os.close(fd)
        return True

    def fork(self, data: bytes, fds: list[int], *, truncated: bool) -> None:
        try:
            request, extraction = _parse(data, fds, truncated=truncated)
        except (msgspec.MsgspecError, SystemExit) as exc:
            self.send(Reply(op="failed", seq=_seq_of(data), why=f"bad request: {exc}"))
            return
        if len(self.children) >= MAX_CHILDREN:
            self.send(Reply(op="failed", seq=request.seq, why="too many restores at once"))
            return
        try:
            pid = os.fork()
        except OSError as exc:
            self.send(Reply(op="failed", seq=request.seq, why=f"fork: {exc.strerror}"))
            return
        if pid == 0:
            # Nothing of the server's: not its socket, not a sibling's pidfd.
            self.sock.close()
            for pidfd in self.children:
                os.close(pidfd)
            os.dup2(fds[0], 1)
            os.dup2(fds[1], 2)
            serve_and_exit(extraction, die_with=self.pid)
        pidfd = os.pidfd_open(pid)
        self.children[pidfd] = pid
        self.poller.register(pidfd, select.POLLIN)
        self.send(Reply(op="forked", seq=request.seq, pid=pid), [pidfd])

    def reap(self, pidfd: int) -> None:
        pid = self.children.pop(pidfd)
        self.poller.unregister(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        self.send(Reply(op="exited", pid=pid, status=status))


def _parse(data: bytes, fds: list[int], *, truncated: bool) -> tuple[ForkRequest, Request]:
    if truncated:
        raise SystemExit("request truncated")
    request = _decode_request(data)
    if len(fds) < 2:
        raise SystemExit("no stdout and stderr descriptors")
    return request, checked_request(request.args, fds[2:])


def _seq_of(data: bytes) -> int | None:
    try:
        seq = msgspec.json.decode(data, type=dict[str, object]).get("seq")
    except msgspec.MsgspecError:
        return None
    return seq if isinstance(seq, int) and not isinstance(seq, bool) else None


def _jail_self() -> None:
    """The server's own jail, after every import (children add theirs on top)."""
    confine.limit_resources(max_file_bytes=None)
    if os.geteuid() == 0 and confine.supported():
        confine.isolate_namespaces()
        confine.install_seccomp(server=True)


def main(argv: list[str]) -> int:
    """Serve the runner on fd 0 until it closes the socket."""
    confine.die_with_parent(int(argv[1]))
    sock = socket.socket(fileno=0)
    prewarm()
    _jail_self()
    os.chdir("/")
    Server(sock).run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
