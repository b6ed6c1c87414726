"""What the jail asks of whatever forks its processes: a request, and the started process.

One implementation: the resident spawn helper (``spawn_helper.py`` / ``spawnd.py``).
The child joins the job's cgroup before exec (writing ``0`` to v1 ``tasks``, or to
v2 ``cgroup.procs`` descriptors), so nothing nsjail forks escapes the cgroup's
accounting, and, for a session job, ``setns``es into the session's network
namespace, so nsjail (run with ``clone_newnet: false``) puts the job there.

Why only the helper. Until this change the runner could also fork from its own
threads (``vfork`` of ``setpriv --pdeathsig``, a thread resident in each pooled
cgroup), kept behind ``SANDCELL_RUNNER_SPAWN_HELPER=0`` for an A/B. On a quiet
machine (load ~0-7, 5 rounds, ``bench_runner.py --b-env``) the two were even on
throughput and latency (old/new: ``bash: true`` p50 1.01x, 16 clients 0.97x,
whole-tree CPU per exec 19.2 / 19.2 ms) and the old path spent 3-12% more of the
runner's own CPU per request; under load (19-27) it was slower (p50 1.13-1.15x)
and once collapsed at 16 clients (0.09x). The helper also has the safer
semantics: a cancelled spawn is killed when its pid arrives instead of orphaned,
a pid is signalled only while it is an unreaped child, and one process forks.
So the threads, ``setpriv`` and their switch were removed.
"""

from __future__ import annotations

import resource
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


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
    """cgroup v1 ``tasks`` files the child writes ``0`` to (None: ``cgroup_fds``, v2)."""


class StartedProcess(Protocol):
    """A process asked for, whose start may not be confirmed yet (``ProcessSpawner.start``)."""

    @property
    def floor_kib(self) -> int:
        """The ``ru_maxrss`` it reports before it has used anything (its parent's, copied)."""
        ...

    async def wait(self) -> tuple[int, resource.struct_rusage | None]:
        """(wait status, rusage) once it has exited; any number of times. For a start
        that failed, its error (``OSError`` or ``JailError``), each time."""
        ...

    def send_signal(self, signum: int, *, group: bool) -> None:
        """Deliver ``signum`` to it (``group``: its process group), if it is still there."""
        ...


class SpawnedProcess(StartedProcess, Protocol):
    """A started process, whichever spawner started it."""

    @property
    def pid(self) -> int: ...


class ProcessSpawner(Protocol):
    """What the jail starts processes with (``SpawnHelper``; tests may bring their own)."""

    async def spawn(self, request: SpawnRequest) -> SpawnedProcess:
        """Start ``request`` and wait until it runs (its pid is known)."""
        ...

    def start(self, request: SpawnRequest) -> StartedProcess:
        """Ask for ``request`` to start and return at once: for a job the caller only
        waits for and signals, a wake-up less than ``spawn`` (no pid comes back)."""
        ...

    def close(self) -> None: ...


__all__ = ["ProcessSpawner", "SpawnRequest", "SpawnedProcess", "StartedProcess"]
