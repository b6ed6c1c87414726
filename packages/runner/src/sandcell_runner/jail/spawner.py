"""Spawns jailed processes from one long-lived thread, each tied to the runner's life.

``PR_SET_PDEATHSIG`` fires when the *thread* that forked the child exits, not the
process: spawning from short-lived worker threads (anyio's expire after idle)
would SIGKILL healthy jobs. One dedicated thread that lives as long as the runner
does the forking, so nsjail dies with the runner and never outlives it.

The child also joins its job cgroup before exec (writing ``0`` to ``cgroup.procs``
moves the writer), so nothing nsjail forks can escape the cgroup's accounting, and,
for a session job, ``setns``es into the session's network namespace, so nsjail (run
with ``clone_newnet: false``) puts the job there instead of in a fresh one.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import os
import queue
import resource
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from .cgroups import V1_ALL, write_small

_PR_SET_PDEATHSIG = 1
_SELF = b"0"
"""Written to a v1 ``tasks`` file: move the calling thread. Naming the thread by its
id instead takes the kernel's global threadgroup lock (~9 ms p90 here under fork
load, against 0.08 ms for ``0``)."""
_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


@dataclass(frozen=True, slots=True)
class SpawnRequest:
    """What to exec and how its standard streams are wired."""

    argv: Sequence[str]
    stdin: int
    stdout: int
    stderr: int
    env: Mapping[str, str]
    cwd: str | None = None
    pass_fds: Sequence[int] = ()
    cgroup_fds: Sequence[int] = ()
    new_session: bool = True
    user: int | None = None
    """Exec as this UID (GID ``group``, no supplementary groups); None: as the runner."""
    group: int | None = None
    netns_fd: int | None = None
    """An open ``/proc/…/ns/net`` the child joins before exec (None: stay in ours)."""
    cgroup_tasks: Sequence[Path] | None = None
    """cgroup v1 ``tasks`` files for the fast path (None: join through ``cgroup_fds``)."""
    resident_key: str | None = None
    """A pooled cgroup's key: spawn from the worker thread that lives in it."""


class SpawnedProcess(Protocol):
    """A started process, whichever spawner started it."""

    @property
    def pid(self) -> int: ...

    @property
    def floor_kib(self) -> int:
        """The ``ru_maxrss`` it reports before it has used anything (its parent's, copied)."""
        ...

    async def wait(self) -> tuple[int, resource.struct_rusage | None]:
        """(wait status, rusage) once it has exited; any number of times."""
        ...

    def send_signal(self, signum: int, *, group: bool) -> None:
        """Deliver ``signum`` to it (``group``: its process group), if it is still there."""
        ...


class ProcessSpawner(Protocol):
    """What the jail starts processes with: ``Spawner`` here, or ``SpawnHelper``."""

    @property
    def fast(self) -> bool:
        """Joins v1 job cgroups through ``tasks`` paths (else: ``cgroup.procs`` descriptors)."""
        ...

    async def spawn(self, request: SpawnRequest) -> SpawnedProcess: ...

    def close(self) -> None: ...


class PopenProcess:
    """A child of the runner itself (``Spawner``), reaped with its rusage by ``wait_process``."""

    def __init__(self, process: subprocess.Popen[bytes], floor_kib: int) -> None:
        self.process = process
        self.floor_kib = floor_kib
        self._exit: tuple[int, resource.struct_rusage | None] | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    async def wait(self) -> tuple[int, resource.struct_rusage | None]:
        if self._exit is None:
            self._exit = await wait_process(self.process)
        return self._exit

    def send_signal(self, signum: int, *, group: bool) -> None:
        if self._exit is not None:
            return  # reaped: the number may be someone else's now
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if group:
                os.killpg(self.process.pid, signum)
            else:
                os.kill(self.process.pid, signum)


def _child_setup(cgroup_fds: Sequence[int]) -> Callable[[], None]:
    parent_pid = os.getpid()

    def setup() -> None:
        # Runs in the forked child after its UID switch, before exec: raw syscalls
        # only, and nothing that needs root (the namespace was joined by the thread).
        if _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            os._exit(126)
        if os.getppid() != parent_pid:  # the runner died between fork and prctl
            os._exit(126)
        for fd in cgroup_fds:
            os.write(fd, b"0")

    return setup


_Request = tuple[SpawnRequest | None, Future[subprocess.Popen[bytes]] | None]


class _Worker:
    """One long-lived forking thread; optionally resident in one job cgroup."""

    def __init__(self, name: str, spawner: Spawner, *, resident: Sequence[Path] | None) -> None:
        self._spawner = spawner
        self._resident = list(resident) if resident is not None else None
        self._requests: queue.SimpleQueue[_Request] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, request: SpawnRequest) -> Future[subprocess.Popen[bytes]]:
        future: Future[subprocess.Popen[bytes]] = Future()
        self._requests.put((request, future))
        return future

    def stop(self) -> None:
        """Step back home (so the cgroup can be removed) and end the thread."""
        self._requests.put((None, None))
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        home = _ThreadHome()
        if self._resident is not None:
            try:
                for path in self._resident:
                    write_small(path, _SELF)
            except OSError:
                home.restore()
                self._resident = None
        while True:
            request, future = self._requests.get()
            if request is None or future is None:
                home.restore()
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(self._spawner.spawn_now(request, home, self._resident))
            except BaseException as exc:
                future.set_exception(exc)


class Spawner:
    """Forks every child from long-lived threads; ``spawn`` is safe to call from any thread.

    Two paths. The fast one avoids ``preexec_fn``, which forces a full ``fork()``
    whose cost grows with the runner's RSS (2.4 ms at 30 MiB, 12 ms at 230 MiB,
    measured here) where ``vfork()`` costs ~0.15 ms at any size: the forking thread
    is itself in the job's cgroup (v1 ``tasks``) and network namespace (``setns``
    is per thread), the child inherits both, and ``setpriv --pdeathsig`` sets the
    death signal before exec'ing nsjail. The other path (cgroup v2, no
    ``setpriv``, a UID switch) does all of it in a ``preexec_fn``.

    Moving a thread between cgroups takes the kernel's cgroup threadgroup lock,
    which cost ~8 ms per Python job here. So each pooled job cgroup (one per job
    UID) gets a worker thread that moves in once and stays: its jobs pay no
    cgroup move at all. Other requests go through a roaming worker that steps
    into the request's cgroup and back.
    """

    def __init__(self) -> None:
        found = shutil.which("setpriv", path="/usr/bin:/bin")
        self._setpriv = found if found and _setpriv_has_pdeathsig(found) else None
        self._lock = threading.Lock()
        self._roaming = _Worker("sandcell-spawner", self, resident=None)
        self._residents: dict[str, _Worker] = {}

    @property
    def fast(self) -> bool:
        return self._setpriv is not None

    def _worker_for(self, request: SpawnRequest) -> _Worker:
        if request.resident_key is None or request.cgroup_tasks is None or not self.fast:
            return self._roaming
        with self._lock:
            worker = self._residents.get(request.resident_key)
            if worker is None:
                worker = _Worker(
                    f"sandcell-spawner-{request.resident_key}", self, resident=request.cgroup_tasks
                )
                self._residents[request.resident_key] = worker
            return worker

    def spawn_now(
        self, request: SpawnRequest, home: _ThreadHome, resident: Sequence[Path] | None
    ) -> subprocess.Popen[bytes]:
        """Fork from the calling (worker) thread."""
        if self._setpriv is not None and (
            not request.cgroup_fds or request.cgroup_tasks is not None
        ):
            return self._spawn_fast(request, home, self._setpriv, resident)
        return self._spawn_forked(request, home)

    def _spawn_fast(
        self,
        request: SpawnRequest,
        home: _ThreadHome,
        setpriv: str,
        resident: Sequence[Path] | None,
    ) -> subprocess.Popen[bytes]:
        moved = request.cgroup_tasks is not None and list(request.cgroup_tasks) != (
            list(resident) if resident is not None else None
        )
        try:
            if moved:
                for path in request.cgroup_tasks or ():
                    write_small(path, _SELF)
            if request.netns_fd is not None and _libc.setns(request.netns_fd, _CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns into the session namespace: {os.strerror(err)}")
            # setpriv sets the death signal after its UID switch (which clears it).
            identity = []
            if request.user is not None:
                group = request.group if request.group is not None else request.user
                identity = [f"--reuid={request.user}", f"--regid={group}", "--clear-groups"]
            return subprocess.Popen(
                [setpriv, *identity, "--pdeathsig", "KILL", "--", *request.argv],
                stdin=request.stdin,
                stdout=request.stdout,
                stderr=request.stderr,
                env=dict(request.env),
                cwd=request.cwd,
                pass_fds=tuple(request.pass_fds),
                start_new_session=request.new_session,
                close_fds=True,
            )
        finally:
            if request.netns_fd is not None:
                home.restore_netns()
            if moved:
                if resident is not None:
                    for path in resident:
                        write_small(path, _SELF)
                else:
                    home.restore()

    def _spawn_forked(self, request: SpawnRequest, home: _ThreadHome) -> subprocess.Popen[bytes]:
        # The child drops to ``user`` before ``preexec_fn`` runs, and joining a
        # namespace needs root: the thread joins it and the child inherits it.
        if request.netns_fd is not None and _libc.setns(request.netns_fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into the session namespace: {os.strerror(err)}")
        try:
            return subprocess.Popen(
                list(request.argv),
                stdin=request.stdin,
                stdout=request.stdout,
                stderr=request.stderr,
                env=dict(request.env),
                cwd=request.cwd,
                pass_fds=tuple(request.pass_fds),
                start_new_session=request.new_session,
                preexec_fn=_child_setup(request.cgroup_fds),
                user=request.user,
                group=request.group,
                extra_groups=[] if request.group is not None else None,
                close_fds=True,
            )
        finally:
            if request.netns_fd is not None:
                home.restore_netns()

    def submit(self, request: SpawnRequest) -> Future[subprocess.Popen[bytes]]:
        return self._worker_for(request).submit(request)

    async def spawn(self, request: SpawnRequest) -> PopenProcess:
        """Fork and exec from a worker thread; returns the running process."""
        # A vforked child's ru_maxrss starts from the runner's own high-water mark.
        floor_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return PopenProcess(await asyncio.wrap_future(self.submit(request)), floor_kib)

    def close(self) -> None:
        """Move resident workers out of their cgroups (so those can be removed)."""
        with self._lock:
            residents, self._residents = self._residents, {}
        for worker in residents.values():
            worker.stop()


class _ThreadHome:
    """The spawner thread's own cgroups and network namespace, to step back into."""

    def __init__(self) -> None:
        self.netns = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        self.tasks: list[Path] = []
        try:
            lines = Path("/proc/thread-self/cgroup").read_text().splitlines()
        except OSError:
            lines = []
        for line in lines:
            _, controllers, path = line.split(":", 2)
            for controller in V1_ALL:
                if controller in controllers.split(","):
                    tasks = Path("/sys/fs/cgroup") / controller / path.lstrip("/") / "tasks"
                    if tasks.exists():
                        self.tasks.append(tasks)

    def restore(self) -> None:
        """Step back into the thread's original cgroups (its namespace is restored apart)."""
        for path in self.tasks:
            with contextlib.suppress(OSError):
                write_small(path, _SELF)

    def restore_netns(self) -> None:
        if _libc.setns(self.netns, _CLONE_NEWNET) != 0:
            # A spawner stuck in a job's namespace would leak it into later jobs.
            os.abort()


def _setpriv_has_pdeathsig(binary: str) -> bool:
    try:
        probe = subprocess.run(
            [binary, "--pdeathsig", "KILL", "--", "true"],
            capture_output=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


async def wait_process(
    process: subprocess.Popen[bytes],
) -> tuple[int, resource.struct_rusage | None]:
    """Wait for exit without blocking the loop; returns (wait status, rusage).

    A pidfd tells the loop when the child has exited; ``wait4`` then reaps it at
    once and yields the rusage of the child and every descendant it reaped (nsjail
    reaps the job), which is where ``cpu_ms`` and ``max_rss_kib`` come from.
    """
    loop = asyncio.get_running_loop()
    pidfd = os.pidfd_open(process.pid)
    try:
        exited = loop.create_future()

        def on_exit() -> None:
            if not exited.done():
                exited.set_result(None)

        loop.add_reader(pidfd, on_exit)
        try:
            await exited
        finally:
            loop.remove_reader(pidfd)
        # The pidfd became readable: the child has exited, so this reaps at once.
        _, status, rusage = os.wait4(process.pid, os.WNOHANG)  # noqa: ASYNC222
    finally:
        os.close(pidfd)
    process.returncode = os.waitstatus_to_exitcode(status)
    return status, rusage
