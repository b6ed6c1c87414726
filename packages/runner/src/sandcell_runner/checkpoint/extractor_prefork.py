"""The extractor fork server of a runner forked from the zygote: forked, not exec'd.

Why. A runner starts its fork server (``extractor_server.py``) as a fresh
``python -I -X utf8 -m ...extractor_server``: an interpreter start and its imports,
~80 CPU-ms for every runner, half of a cold session's whole-tree CPU
(``bench_orchestrator.py --cold-only``, 2026-12-04: 160 CPU-ms a session with the
server against 80 with none started). A runner forked from the zygote
(``zygote.py``) already holds every module the server needs, so ``become_runner``
forks the server first of all (``prefork``) and the runner's ``ExtractorServer``
adopts it (``take``) where it would have launched one.

What the server gets is what the fresh one had. It is forked while the process has
one thread and no event loop, before it is a runner: before its token is read from
its pipe. It closes every descriptor but its socket, /dev/null and its stderr (the
runner's log, as the fresh one's): not the token's pipe, the listener or the
launcher's pidfd. It has an empty environment (its block zeroed too), ``/`` as its
directory and a session of its own, and is a child of the runner with
``PR_SET_PDEATHSIG`` towards it; then it jails itself as the fresh one does
(``extractor_server.main``). Its memory is the zygote's: imported modules and the
runner's settings from the environment the zygote was started with, which hold no
credential (the token travels on its pipe, and a runner holds no other). Only where
the process runs in UTF-8 mode, as ``-X utf8`` would have it (always, for a runner's
C-locale environment); otherwise, and for a server lost later, the fresh launch
remains.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys

__all__ = ["PreforkedServer", "prefork", "take"]

_preforked: PreforkedServer | None = None


class PreforkedServer:
    """A fork server this process forked: its pid (our child) and our end of its socket."""

    def __init__(self, pid: int, sock: socket.socket) -> None:
        self.pid = pid
        self.sock = sock
        self.returncode: int | None = None

    def kill(self) -> None:
        if self.returncode is None:
            os.kill(self.pid, signal.SIGKILL)

    def wait(self) -> int:
        """Reap it (once; later calls answer the same code)."""
        if self.returncode is None:
            try:
                _, status = os.waitpid(self.pid, 0)
            except ChildProcessError:
                status = 0
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


def prefork() -> None:
    """Fork the server now, for ``take``: only in a single-threaded process that holds
    no secret yet (``zygote.become_runner``, before the token is read)."""
    global _preforked
    if not sys.flags.utf8_mode or _preforked is not None:
        return
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    parent = os.getpid()
    try:
        pid = os.fork()
    except OSError:
        ours.close()
        theirs.close()
        return
    if pid == 0:
        code = 1
        try:
            code = _serve(ours, theirs, parent)
        finally:
            os._exit(code)
    theirs.close()
    _preforked = PreforkedServer(pid, ours)


def take() -> PreforkedServer | None:
    """The server ``prefork`` forked, once; None if there is none."""
    global _preforked
    server, _preforked = _preforked, None
    return server


def _serve(ours: socket.socket, theirs: socket.socket, parent: int) -> int:
    """In the forked child: nothing of the runner's but memory, then the server's main."""
    from . import extractor_server  # imported already (the zygote's preimports)

    ours.detach()  # closed below with everything else; never closed twice by its object
    sock_fd = theirs.detach()
    os.setsid()
    os.dup2(sock_fd, 0)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 1)  # stderr stays the runner's log, as the fresh server's
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    os.environ.clear()  # unsetenv each: as the fresh server's env={}
    _blank_environ_block()
    os.chdir("/")
    return extractor_server.main(["extractor_server", str(parent)])


def _blank_environ_block() -> None:
    """Zero the environment block ``/proc/<pid>/environ`` shows (the zygote's, inherited;
    nothing points into it once ``os.environ`` is cleared): it shows none, as a fresh
    server's ``env={}``."""
    with open("/proc/self/stat", "rb") as stat:
        fields = stat.read().rpartition(b")")[2].split()
    start, end = int(fields[47]), int(fields[48])  # fields 50, 51: env_start, env_end
    if start and end > start:
        ctypes.memset(start, 0, end - start)
