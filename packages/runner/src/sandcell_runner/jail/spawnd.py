"""The resident spawn helper: a small process that forks every jailed process for the runner.

Run as ``python -I -S spawnd.py <socket fd> <runner pid> [<_vfork extension>]`` by
``spawn_helper.py``; it imports the standard library only (a few MiB of RSS, and nothing
of the runner's), and the runner's compiled ``_vfork`` module when it is given one.

Why a process of its own. The job must exec as its UID with ``PR_SET_PDEATHSIG``
set *after* the UID switch (a credential change clears it). From the runner, that
took either a full ``fork()`` of the big runner (its cost grows with RSS) or a
cheap ``vfork()`` of ``setpriv --pdeathsig``, an extra exec per job (~1.5 ms and
~1.5 CPU-ms here). This helper forks itself instead: its address space is small,
and the child does the UID switch, the death signal, the cgroup join and the
namespace join in a few system calls before it execs nsjail directly.

The runner hands it requests (``marshal``) and the job's descriptors (``SCM_RIGHTS``) over
a ``SOCK_SEQPACKET`` socketpair; it answers each with the child's pid (or why it
could not start), reaps its children and reports each exit with its rusage. It
owns its children until they are reaped, so signals go through it too: a pid is
only ever signalled while it is an unreaped child of this process, never after
the number could have been reused.

Lifetime: the helper has ``PR_SET_PDEATHSIG`` (SIGKILL) towards the runner and
exits on the socket's EOF; its children have it towards the helper (which is
single-threaded: the forking thread lives as long as the process). Kill the
runner, however, and the helper dies, and with it every nsjail it started.

Joining the cgroup costs nothing here: the child writes ``0`` to each v1 ``tasks``
descriptor the runner passed (held open by the pooled cgroup: ``JobCgroup.join_fds``),
and a single thread moving itself skips the kernel's global threadgroup lock
(measured here: 0.08 ms p90 against 9 ms for any write naming a pid). On v2 it
writes ``0`` to ``cgroup.procs`` descriptors the runner passed. (``join_paths``, files
the child opens itself, is what a request without descriptors can name.)

Two ways to start a child, the same steps in the same order either way (``spawnd_job.child``):
the ``_vfork`` extension (``_vfork.c``: the set-up in async-signal-safe C in a
``vfork()`` child, which shares this process's memory until it execs), or, when the
runner passes none (it did not build, or ``SANDCELL_RUNNER_SPAWN_VFORK=0``) or it does
not load, ``os.fork()`` and ``child`` in Python. The vfork path costs less because the
fork path copies this process's page tables, takes copy-on-write faults while the
child's Python runs, and tears the copy down at exec. Measured (``scripts/bench_spawn.py``:
500 spawns of ``/bin/true`` straight to the helper, 6 alternating pairs, 2 shared
cores at load 2.1-2.9, 2026-12-03 08:52 UTC, commit 85776e2): helper CPU per spawn
1.16 -> 0.30 ms, its children's 2.42 -> 0.86 ms (medians); 2.29-2.76 CPU-ms less per
spawn in every pair. By component through the runner (``scripts/bench_breakdown.py
--count 100 --rounds 3 --b-tree`` main 1ceb787, load 1-2.3, 10:08 UTC, medians, ms CPU
per ``bash: true``): helper 0.60 against 1.40, nsjail+job 14.9 against 15.5, tree
18.3 against 19.6.

Nothing of the runner's environment reaches it (started with an empty one), and a
child's environment is exactly the request's.

Why ``marshal`` and not JSON on the socket: both ends are the same interpreter
(the runner starts the helper with its own), the peer is the runner, and ``json``
brings in ``re`` and its compiled patterns: 0.4 MiB of the helper's 5.35 MiB of
anonymous memory, whose page tables every ``fork`` copies and whose pages then
take copy-on-write faults. Measured here (500 spawns of ``/bin/true`` straight
to the helper, 6 alternating pairs): helper CPU per spawn 0.85 -> 0.74 ms median
(-13%), its children's unchanged; loads and dumps are cheaper on both sides too.
"""

from __future__ import annotations

import array
import marshal
import os
import resource
import select
import signal
import socket
import sys

TYPE_CHECKING = False
if TYPE_CHECKING or __package__:  # imported by the runner (for its constants), and mypy
    from .spawnd_job import PR_SET_PDEATHSIG, Job, child, env_entry, libc
else:
    # Run as the helper (``python -I -S spawnd.py``): no package and no ``sys.path`` of
    # the runner's, so its one sibling is found beside it; appended, so nothing there
    # shadows the standard library.
    sys.path.append(os.path.dirname(os.path.abspath(__file__)))
    from spawnd_job import PR_SET_PDEATHSIG, Job, child, env_entry, libc

if TYPE_CHECKING:  # (``typing`` itself would bring ``re`` into the helper)
    from collections.abc import Callable

    VforkSpawn = Callable[
        [
            list[bytes],
            list[bytes],
            list[int],
            list[int],
            list[bytes],
            list[int],
            int,
            bytes | None,
            int,
            int,
            bool,
            int,
        ],
        tuple[int, str, int, int],
    ]
    """``_vfork.spawn`` (see ``_vfork.pyi``)."""

MAX_FDS = 32
"""Descriptors one request may carry (stdio, the configuration, the log, a namespace, cgroups)."""
MAX_MESSAGE_BYTES = 256 * 1024


class Helper:
    """The helper's state: its socket, its unreaped children (pidfd -> pid)."""

    def __init__(self, sock: socket.socket, *, vfork: VforkSpawn | None = None) -> None:
        self.sock = sock
        self.vfork = vfork
        """``_vfork.spawn``, or None: the fork path."""
        self.poller = select.poll()
        self.poller.register(sock.fileno(), select.POLLIN)
        self.children: dict[int, int] = {}
        self.starting: dict[int, tuple[int, int, bytearray, bool]] = {}
        """Start pipes of children not yet exec'd: read end -> (seq, pid, error so far,
        quiet)."""
        self.pids: set[int] = set()
        self.quiet: dict[int, tuple[int, int]] = {}
        """Children of quiet requests: pid -> (request number, ``floor_kib``)."""
        self.by_seq: dict[int, int] = {}
        """Their pids by request number (a quiet request is signalled by its number)."""
        self.pid = os.getpid()

    def send(self, message: dict[str, object]) -> None:
        self.sock.send(marshal.dumps(message))

    def serve(self) -> None:
        while True:
            for fd, _ in self.poller.poll():
                if fd == self.sock.fileno():
                    if not self.receive():
                        return
                elif fd in self.starting:
                    self.started(fd)
                else:
                    self.reap(fd)

    def receive(self) -> bool:
        """One request; False at EOF (the runner is gone)."""
        data, fds = _receive(self.sock)
        if not data:
            for fd in fds:
                os.close(fd)
            return False
        try:
            request = marshal.loads(data)  # noqa: S302 (from the runner, our parent)
            op = request.get("op") if isinstance(request, dict) else None
            if op == "spawn":
                self.spawn(request, fds)
            elif op == "signal":
                self.signal(request)
            elif op == "ping":
                self.send({"op": "pong", "spawn": "fork" if self.vfork is None else "vfork"})
        finally:
            for fd in fds:
                os.close(fd)
        return True

    def spawn(self, request: dict[str, object], fds: list[int]) -> None:
        try:
            job = Job(request, len(fds))
        except (KeyError, TypeError, ValueError) as exc:
            seq = request.get("seq")
            self.send({"op": "failed", "seq": seq, "errno": 0, "why": f"bad request: {exc}"})
            return
        if self.vfork is not None:
            self.spawn_vfork(self.vfork, job, fds)
            return
        seq = job.seq
        read_end, write_end = os.pipe2(os.O_CLOEXEC)
        try:
            pid = os.fork()
        except OSError as exc:
            os.close(read_end)
            os.close(write_end)
            self.send({"op": "failed", "seq": seq, "errno": exc.errno, "why": f"fork: {exc}"})
            return
        if pid == 0:
            os.close(read_end)
            child(job, fds, write_end, self.pid)
        os.close(write_end)
        # EOF on the pipe once the child has exec'd (it is close-on-exec). Waited for
        # in the poll loop, not here: a child the scheduler is slow to run (a loaded
        # machine) must not hold up the requests behind it.
        self.starting[read_end] = (seq, pid, bytearray(), job.quiet)
        if job.quiet:
            # Signalled by its number from now on, as the runner may (it is our unreaped
            # child): a kill before its exec must not wait for the exec, or be lost.
            self.by_seq[seq] = pid
            self.pids.add(pid)
        self.poller.register(read_end, select.POLLIN)

    def spawn_vfork(self, vfork: VforkSpawn, job: Job, fds: list[int]) -> None:
        """``child``'s steps in C in a vfork child: done (exec'd or failed) on return."""
        try:
            # What os.execve refuses, refused the same way (before any child exists).
            argv = [os.fsencode(arg) for arg in job.argv]
            envp = [env_entry(key, value) for key, value in job.env.items()]
            answer = vfork(
                argv,
                envp,
                fds,
                job.targets,
                [os.fsencode(path) for path in job.join_paths],
                [fds[index] for index in job.join_fds],
                -1 if job.netns is None else fds[job.netns],
                None if job.cwd is None else os.fsencode(job.cwd),
                -1 if job.uid is None else job.uid,
                -1 if job.gid is None else job.gid,
                job.setsid,
                self.pid,
            )
        except (TypeError, ValueError) as exc:
            self.send({"op": "failed", "seq": job.seq, "errno": 0, "why": f"exec: {exc}"})
            return
        pid, step, code, index = answer
        if step:
            # The message child's OSError would have made (the runner shows it).
            filename = {"exec": job.argv[0], "chdir": job.cwd}.get(step)
            if step == "cgroup" and 0 <= index < len(job.join_paths):
                filename = job.join_paths[index]
            error = OSError(code, os.strerror(code), *(() if filename is None else (filename,)))
            self.send({"op": "failed", "seq": job.seq, "errno": code, "why": f"{step}: {error}"})
            return
        self.running(job.seq, pid, quiet=job.quiet)

    def started(self, read_end: int) -> None:
        """The start pipe of a child is readable: its failure, or (EOF alone) its exec."""
        seq, pid, error, quiet = self.starting[read_end]
        chunk = os.read(read_end, 512)
        if chunk:
            error += chunk
            return
        del self.starting[read_end]
        self.poller.unregister(read_end)
        os.close(read_end)
        if error:
            os.waitpid(pid, 0)  # it exits right after saying why
            self.pids.discard(pid)
            self.by_seq.pop(seq, None)
            step, _, rest = error.decode("utf-8", "replace").partition(":")
            code, _, why = rest.partition(":")
            self.send(
                {"op": "failed", "seq": seq, "errno": int(code or 0), "why": f"{step}: {why}"}
            )
            return
        self.running(seq, pid, quiet=quiet)

    def running(self, seq: int, pid: int, *, quiet: bool) -> None:
        """A child has exec'd: watch for its exit, and answer its request."""
        pidfd = os.pidfd_open(pid)
        self.children[pidfd] = pid
        self.pids.add(pid)
        self.poller.register(pidfd, select.POLLIN)
        # The child's ru_maxrss starts from this process's own high-water mark: a forked
        # child's copy of our memory has it, and a vfork child's exec charges it the
        # high-water mark of the address space it leaves (ours) all the same.
        floor_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        if quiet:
            self.quiet[pid] = (seq, floor_kib)
            self.by_seq[seq] = pid
            return
        self.send({"op": "spawned", "seq": seq, "pid": pid, "floor_kib": floor_kib})

    def signal(self, request: dict[str, object]) -> None:
        seq = request.get("seq")
        pid = self.by_seq.get(seq, 0) if isinstance(seq, int) else request.get("pid")
        signum = request["signum"]
        if not isinstance(pid, int) or not isinstance(signum, int) or pid not in self.pids:
            return  # reaped already (or never ours): its number may be someone else's now
        try:
            if request.get("group"):
                try:
                    os.killpg(pid, signum)
                except ProcessLookupError:
                    # No such group yet: a quiet request's child signalled before its
                    # ``setsid`` (the fork path), alone in ours still, so itself.
                    os.kill(pid, signum)
            else:
                os.kill(pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def reap(self, pidfd: int) -> None:
        pid = self.children.pop(pidfd)
        self.poller.unregister(pidfd)
        os.close(pidfd)
        _, status, usage = os.wait4(pid, 0)
        self.pids.discard(pid)
        message: dict[str, object] = {
            "op": "exit",
            "pid": pid,
            "status": status,
            "rusage": list(usage),
        }
        quiet = self.quiet.pop(pid, None)
        if quiet is not None:
            message["seq"], message["floor_kib"] = quiet
            del self.by_seq[quiet[0]]
        self.send(message)


def _receive(sock: socket.socket) -> tuple[bytes, list[int]]:
    """A message and its descriptors, close-on-exec: each child gets only its targets.

    Not ``socket.recv_fds``, which drops its ``flags`` (3.11): the descriptors came
    inheritable, and every nsjail inherited the whole request's (its cgroup and
    namespace files, copies of its streams).
    """
    fd_size = array.array("i").itemsize
    data, ancillary, _, _ = sock.recvmsg(
        MAX_MESSAGE_BYTES, socket.CMSG_LEN(MAX_FDS * fd_size), socket.MSG_CMSG_CLOEXEC
    )
    fds = array.array("i")
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fd_size])
    return data, list(fds)


def _load_vfork(path: str) -> VforkSpawn | None:
    """``spawn`` of the ``_vfork`` extension at ``path``; None if it does not load.

    By file (this process has no ``sys.path`` of the runner's: ``-I -S``).
    """
    from importlib.machinery import ExtensionFileLoader, ModuleSpec

    try:
        loader = ExtensionFileLoader("_vfork", path)
        module = loader.create_module(ModuleSpec("_vfork", loader, origin=path))
        loader.exec_module(module)
        spawn: VforkSpawn = module.spawn
    except (ImportError, OSError, AttributeError):
        return None
    return spawn


def _forget_inherited_ignores() -> None:
    """Default every signal this helper's launcher left ignored, before any child.

    An ignored disposition survives fork and exec, so a runner started under
    ``nohup`` (SIGHUP) or by a non-interactive shell's ``&`` (SIGINT, SIGQUIT)
    would hand it to every job, and a code context's interrupt is a SIGINT.
    SIGPIPE and SIGXFSZ are Python's own (the children's set-up defaults those).
    """
    keep = {signal.SIGKILL, signal.SIGSTOP, signal.SIGPIPE, signal.SIGXFSZ}
    for signum in signal.valid_signals():
        if signum in keep:
            continue
        try:
            if signal.getsignal(signum) is signal.SIG_IGN:
                signal.signal(signum, signal.SIG_DFL)
        except (OSError, ValueError):  # one glibc keeps for itself
            continue


def main(argv: list[str]) -> int:
    _forget_inherited_ignores()
    sock = socket.socket(fileno=int(argv[1]))
    os.set_inheritable(sock.fileno(), False)  # inherited from the runner: not the children's
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return 1
    if os.getppid() != int(argv[2]):  # the runner died before the death signal was set
        return 1
    sock.setblocking(True)
    vfork = _load_vfork(argv[3]) if len(argv) > 3 else None
    Helper(sock, vfork=vfork).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
