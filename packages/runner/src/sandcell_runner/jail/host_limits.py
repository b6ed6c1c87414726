"""Host sysctls the jail's budgets rely on: checked at runner start, raised when allowed.

Some kernel budgets are one counter for the whole host (``kernel.pid_max``,
``kernel.threads-max``, ``fs.file-max``), others are per UID in the initial user
namespace (inotify, user namespaces). Jobs are charged to their own UID (``nsjail.py``)
and that UID is leased host-wide (``uidpool.py``), so the per-UID ones need only be
large enough for one job; the host-wide ones must hold every job the runner may run at
once (``SANDCELL_RUNNER_MAX_JOBS`` jobs plus the session's long-lived processes, each up
to ``SANDCELL_RUNNER_MAX_PIDS`` tasks) with the host's own processes on top.

A root runner raises a value that is too low (never lowers one); what it can neither
find nor raise is returned as a warning, which ``/health`` lists under ``warnings``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

PROC_SYS = Path("/proc/sys")
HOST_RESERVE_TASKS = 16_384
"""Tasks left for the host itself beyond what the runner's jobs may use."""


@dataclass(frozen=True, slots=True)
class HostLimit:
    """One sysctl and the least value the jail needs of it."""

    name: str
    """Dotted sysctl name, e.g. ``kernel.pid_max``."""
    minimum: int
    why: str
    optional: bool = False
    """Absent on some kernels; only a present value below the minimum is a problem."""

    @property
    def relpath(self) -> str:
        return self.name.replace(".", "/")


def required_limits(
    *, max_jobs: int, max_pids: int, open_files: int, session_processes: int
) -> list[HostLimit]:
    """What a runner with these settings needs of its host."""
    tasks = (max_jobs + session_processes) * max_pids + HOST_RESERVE_TASKS
    return [
        HostLimit("kernel.pid_max", tasks, "every job's pids limit at once, plus the host's"),
        HostLimit("kernel.threads-max", tasks, "every job's pids limit at once, plus the host's"),
        HostLimit(
            "fs.file-max",
            (max_jobs + session_processes) * max_pids * open_files,
            "every job task's open-files limit at once",
        ),
        # Per UID: one job (or one session) needs these, nobody shares them.
        HostLimit("user.max_user_namespaces", 64, "nsjail makes one user namespace per job"),
        # Debian's switch: nsjail runs as the job's UID, an unprivileged user.
        HostLimit(
            "kernel.unprivileged_userns_clone", 1, "nsjail runs as the job's UID", optional=True
        ),
        HostLimit("fs.inotify.max_user_instances", 128, "file watchers of a dev server"),
        HostLimit("fs.inotify.max_user_watches", 65_536, "file watchers of a dev server"),
    ]


def apply_host_limits(
    limits: list[HostLimit], *, root: Path = PROC_SYS, may_raise: bool
) -> list[str]:
    """Raise what is too low (when ``may_raise``); warnings for what is missing or stays low."""
    warnings: list[str] = []
    for limit in limits:
        path = root / limit.relpath
        current = _read(path)
        if current is None:
            if limit.optional and not path.exists():
                continue
            warnings.append(f"host sysctl {limit.name} not readable ({limit.why})")
            continue
        if current >= limit.minimum:
            continue
        if may_raise:
            try:
                path.write_text(str(limit.minimum))
            except OSError as exc:
                reason = exc.strerror or str(exc)
            else:
                if (_read(path) or 0) >= limit.minimum:
                    log.info(
                        "raised host sysctl %s from %d to %d", limit.name, current, limit.minimum
                    )
                    continue
                reason = "the kernel kept a lower value"
        else:
            reason = "the runner is not root"
        warnings.append(
            f"host sysctl {limit.name}={current} is below {limit.minimum} ({limit.why}) "
            f"and could not be raised: {reason}"
        )
    return warnings


def _read(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


__all__ = ["HOST_RESERVE_TASKS", "HostLimit", "apply_host_limits", "required_limits"]
