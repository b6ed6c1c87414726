"""The runner's side of the resident spawn helper (``spawnd.py``): requests out, pids and exits in.

A job costs one ``sendmsg`` from the event loop and one message back, with no
thread hop and no extra exec (the in-process spawner it replaced, and the A/B that
retired it, are described in ``spawner.py``).

Everything here runs on the event loop: the socket is read by ``add_reader``, and
sends are small datagrams the helper drains at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import marshal
import os
import resource
import signal
import socket
import subprocess
import sys
from importlib.machinery import ExtensionFileLoader
from pathlib import Path

from ..errors import JailError
from . import spawnd
from .helper_socket import PendingRequests, helper_socketpair, stop_reading
from .spawner import SpawnRequest

log = logging.getLogger(__name__)

_KILLED_STATUS = signal.SIGKILL
"""The wait status of a process killed by SIGKILL (reported when the helper is lost)."""

Exit = tuple[int, resource.struct_rusage | None]


class _Child:
    """What every process the helper starts has: an exit any number of waiters await."""

    def __init__(self, helper: SpawnHelper) -> None:
        self._helper = helper
        self.floor_kib = 0
        """Its ``ru_maxrss`` starts from the helper's own peak (fork copies the helper)."""
        self._exit: asyncio.Future[Exit] = asyncio.get_running_loop().create_future()

    async def wait(self) -> Exit:
        """(wait status, rusage) once it has exited (for a ``QuietProcess``, or why it
        did not start); any number of times, cancel-safe."""
        return await asyncio.shield(self._exit)

    def _settle(self, status: int, usage: resource.struct_rusage | None) -> bool:
        if self._exit.done():
            return False
        self._exit.set_result((status, usage))
        return True


class HelperProcess(_Child):
    """A process the helper started: its pid, its exit (status, rusage), and signals."""

    def __init__(self, helper: SpawnHelper, pid: int, floor_kib: int) -> None:
        super().__init__(helper)
        self.pid = pid
        self.floor_kib = floor_kib
        self.returncode: int | None = None

    def send_signal(self, signum: int, *, group: bool) -> None:
        """Signal it (``group``: its process group) while it is the helper's unreaped child."""
        if not self._exit.done():
            self._helper.signal(self.pid, signum, group=group)

    def exited(self, status: int, usage: resource.struct_rusage | None) -> None:
        if self._settle(status, usage):
            self.returncode = os.waitstatus_to_exitcode(status)


class QuietProcess(_Child):
    """A process asked of the helper with ``start``: known by its request's number, its
    start reported only when it failed, its exit (and ``floor_kib``) when it ends."""

    def __init__(self, helper: SpawnHelper, seq: int) -> None:
        super().__init__(helper)
        self.seq = seq

    def send_signal(self, signum: int, *, group: bool) -> None:
        """Signal it through the helper, which knows its pid while it is an unreaped child."""
        if not self._exit.done():
            self._helper.signal_request(self.seq, signum, group=group)

    def exited(self, status: int, usage: resource.struct_rusage | None, floor_kib: int) -> None:
        if not self._exit.done():
            self.floor_kib = floor_kib
            self._settle(status, usage)

    def failed(self, error: BaseException) -> None:
        if not self._exit.done():
            self._exit.set_exception(error)


class SpawnHelper:
    """Starts and talks to one helper process; restarts it when it was lost."""

    def __init__(
        self, *, python: str = sys.executable, vfork: bool = True, wait: bool = True
    ) -> None:
        """``vfork``: start children through the compiled ``_vfork`` module when it was
        built (``SANDCELL_RUNNER_SPAWN_VFORK``); False, or not built: the fork path.
        ``wait=False``: return once the helper is launched; ``wait_started`` (or the first
        spawn) waits for its answer, so the caller's own start-up runs meanwhile."""
        self._python = python
        self._vfork = vfork
        self.spawn_method = "fork"
        """How the helper starts children: ``vfork`` (``_vfork.c``) or ``fork`` (Python)."""
        self._process: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: PendingRequests[HelperProcess] = PendingRequests()
        self._running: dict[int, HelperProcess] = {}
        self._quiet: dict[int, QuietProcess] = {}
        """``start``ed processes by request number, until their exit or failure."""
        self._starting: socket.socket | None = None
        """Our end of a launched helper's socket until its ``pong`` has been read."""
        self._extension: str | None = None
        self._launch()
        if wait:
            self.wait_started()

    def _start(self) -> None:
        self._launch()
        self.wait_started()

    def _launch(self) -> None:
        self._extension = extension = _vfork_extension() if self._vfork else None
        with helper_socketpair() as (ours, theirs):
            argv = [self._python, "-I", "-S", str(Path(spawnd.__file__))]
            argv += [str(theirs.fileno()), str(os.getpid())]
            if extension is not None:
                argv.append(extension)
            # Its own session (a signal to the runner's group is the runner's to
            # handle); no environment of the runner's; only its end of the socket.
            self._process = subprocess.Popen(
                argv,
                pass_fds=[theirs.fileno()],
                env={},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                start_new_session=True,
                close_fds=True,
            )
        ours.settimeout(30)
        try:
            ours.send(marshal.dumps({"op": "ping"}))
        except OSError as exc:
            ours.close()
            raise JailError(f"spawn helper did not start: {exc}") from None
        self._starting = ours

    def wait_started(self) -> None:
        """Wait for a launched helper's answer (a no-op once it came); ``JailError`` if
        it did not start."""
        ours, self._starting = self._starting, None
        if ours is None:
            return
        try:
            answer = ours.recv(spawnd.MAX_MESSAGE_BYTES)
        except OSError as exc:
            ours.close()
            raise JailError(f"spawn helper did not start: {exc}") from None
        pong = _loads(answer)
        if pong.get("op") != "pong":
            ours.close()
            raise JailError("spawn helper did not start")
        self.spawn_method = "vfork" if pong.get("spawn") == "vfork" else "fork"
        if self._extension is not None and self.spawn_method != "vfork":
            log.warning("spawn helper could not load %s; it forks in Python", self._extension)
        ours.setblocking(True)
        self._sock = ours

    @property
    def pid(self) -> int | None:
        """The helper process's pid; None once it is lost (until the next spawn)."""
        return None if self._process is None else self._process.pid

    def _attach(self) -> socket.socket:
        loop = asyncio.get_running_loop()
        self.wait_started()
        if self._sock is None:
            log.warning("spawn helper was lost; starting a new one")
            self._start()
        assert self._sock is not None
        if self._loop is not loop:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._sock.fileno())
            loop.add_reader(self._sock.fileno(), self._on_readable)
            self._loop = loop
        return self._sock

    async def spawn(self, request: SpawnRequest) -> HelperProcess:
        """Have the helper fork and exec ``request``; the running process."""
        sock = self._attach()
        seq, data, fds = self._request(request, quiet=False)
        return await self._pending.send(
            sock,
            seq,
            data,
            fds,
            unreachable=lambda exc: JailError(f"spawn helper unreachable: {exc}"),
            # The helper starts it anyway: kill it the moment its pid is known.
            kill_when_answered=_kill_when_started,
        )

    def start(self, request: SpawnRequest) -> QuietProcess:
        """Have the helper fork and exec ``request`` without answering it unless it fails:
        its failure and its exit come to ``QuietProcess.wait``.

        Why: the helper's answer to ``spawn`` (the pid) woke the event loop and resumed
        the job's coroutine once more per job, for a pid a one-shot job never uses
        (it is signalled by request number). ~3 % of the runner's Python per
        ``bash: true`` at 16 clients (cProfile, issue #21).
        """
        sock = self._attach()
        seq, data, fds = self._request(request, quiet=True)
        process = QuietProcess(self, seq)
        self._quiet[seq] = process
        try:
            socket.send_fds(sock, [data], fds)
        except OSError as exc:
            self._quiet.pop(seq, None)
            raise JailError(f"spawn helper unreachable: {exc}") from None
        return process

    def _request(self, request: SpawnRequest, *, quiet: bool) -> tuple[int, bytes, list[int]]:
        """The next request number, the message and the descriptors it carries."""
        fds = [request.stdin, request.stdout, request.stderr, *request.pass_fds]
        targets = [0, 1, 2, *request.pass_fds]
        join_fds = list(range(len(fds), len(fds) + len(request.cgroup_fds)))
        fds += request.cgroup_fds
        netns = None
        if request.netns_fd is not None:
            netns = len(fds)
            fds.append(request.netns_fd)
        seq = self._pending.next_seq()
        # Plain str and int only: marshal refuses their subclasses (an IntEnum, a
        # StrEnum), where JSON wrote them out as their values.
        message = {
            "op": "spawn",
            "seq": seq,
            "argv": [str(arg) for arg in request.argv],
            "env": {str(key): str(value) for key, value in request.env.items()},
            "targets": [int(fd) for fd in targets],
            "join_paths": [str(path) for path in request.cgroup_tasks or ()],
            "join_fds": join_fds,
            "netns": netns,
            "cwd": None if request.cwd is None else str(request.cwd),
            "uid": None if request.user is None else int(request.user),
            "gid": None if request.group is None else int(request.group),
            "setsid": bool(request.new_session),
            "quiet": quiet,
        }
        data = marshal.dumps(message)
        if len(data) > spawnd.MAX_MESSAGE_BYTES or len(fds) > spawnd.MAX_FDS:
            raise JailError("job start request too large (environment or descriptors)")
        return seq, data, fds

    def signal(self, pid: int, signum: int, *, group: bool) -> None:
        self._send_signal({"pid": int(pid)}, signum, group=group)

    def signal_request(self, seq: int, signum: int, *, group: bool) -> None:
        """Signal the process of request ``seq`` (a ``start``), if it runs."""
        self._send_signal({"seq": int(seq)}, signum, group=group)

    def _send_signal(self, target: dict[str, int], signum: int, *, group: bool) -> None:
        if self._sock is None:
            return
        # int(): a signal.Signals is an IntEnum, which marshal refuses.
        message = {"op": "signal", **target, "signum": int(signum), "group": bool(group)}
        with contextlib.suppress(OSError):
            self._sock.send(marshal.dumps(message))

    def _on_readable(self) -> None:
        sock = self._sock
        while sock is not None:
            try:
                data = sock.recv(spawnd.MAX_MESSAGE_BYTES, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self._lost()
                return
            self._dispatch(_loads(data))

    def _dispatch(self, message: dict[str, object]) -> None:
        op = message.get("op")
        seq = message.get("seq")
        if op == "exit":
            pid, status, usage = message["pid"], message["status"], message["rusage"]
            assert isinstance(pid, int)
            assert isinstance(status, int)
            assert isinstance(usage, list)
            quiet = self._quiet.pop(seq, None) if isinstance(seq, int) else None
            if quiet is not None:
                floor_kib = message.get("floor_kib", 0)
                assert isinstance(floor_kib, int)
                quiet.exited(status, resource.struct_rusage(usage), floor_kib)
                return
            process = self._running.pop(pid, None)
            if process is not None:
                process.exited(status, resource.struct_rusage(usage))
            return
        if op == "failed" and isinstance(seq, int) and seq in self._quiet:
            self._quiet.pop(seq).failed(_start_error(message))
            return
        future = self._pending.pop(seq)
        if future is None:
            return
        if op == "spawned":
            pid, floor_kib = message["pid"], message["floor_kib"]
            assert isinstance(pid, int)
            assert isinstance(floor_kib, int)
            process = HelperProcess(self, pid, floor_kib)
            self._running[pid] = process
            if not future.done():
                future.set_result(process)
        elif not future.done():
            future.set_exception(_start_error(message))

    def _lost(self) -> None:
        """The helper is gone: its children are too (their death signal); say so to every waiter."""
        if self._sock is not None:
            stop_reading(self._sock, self._loop)
            self._sock = None
        self._loop = None
        if self._process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(timeout=5)
            self._process = None
        self._pending.fail_all(lambda: JailError("spawn helper exited"))
        running, self._running = self._running, {}
        for process in running.values():
            process.exited(_KILLED_STATUS, None)
        # Asked for without an answer: each started (its nsjail died with the helper)
        # unless its failure was still on the way; reported as killed either way.
        quiet, self._quiet = self._quiet, {}
        for started in quiet.values():
            started.exited(_KILLED_STATUS, None, 0)

    def close(self) -> None:
        """Stop the helper (at shutdown; its children, if any are left, die with it).

        Safe from any thread: the socket is shut down, not closed, so the loop's
        reader sees the end and cleans up on the loop's own thread.
        """
        if self._starting is not None:
            self._starting.close()  # never waited for: the helper sees EOF and exits
            self._starting = None
            if self._process is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._process.wait(timeout=5)
        if self._sock is None:
            return
        if self._loop is None or self._loop.is_closed():
            self._lost()
            return
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        if self._process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(timeout=5)


def _vfork_extension() -> str | None:
    """The built ``_vfork`` extension's file (the helper loads it by path), if any."""
    spec = importlib.util.find_spec(f"{__package__}._vfork")
    if spec is None or spec.origin is None or not isinstance(spec.loader, ExtensionFileLoader):
        return None
    return spec.origin


def _loads(data: bytes) -> dict[str, object]:
    """A helper message; an empty dict for anything that is not one (a helper that
    died mid-start). marshal, not JSON: see ``spawnd.py``."""
    try:
        message = marshal.loads(data)  # noqa: S302 (from our own helper: no code runs)
    except (EOFError, ValueError, TypeError):
        return {}
    return message if isinstance(message, dict) else {}


def _start_error(message: dict[str, object]) -> BaseException:
    """The error a helper's ``failed`` answer describes."""
    code = message.get("errno")
    why = str(message.get("why", "unknown"))
    return OSError(code, why) if isinstance(code, int) and code else JailError(why)


def _kill_when_started(future: asyncio.Future[HelperProcess]) -> None:
    if not future.cancelled() and future.exception() is None:
        future.result().send_signal(signal.SIGKILL, group=True)


__all__ = ["HelperProcess", "QuietProcess", "SpawnHelper"]
