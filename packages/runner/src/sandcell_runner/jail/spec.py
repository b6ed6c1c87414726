"""The description of one job to run under nsjail: its command, paths, identity and limits.

Shared by the configuration renderer (``nsjail_config.py``) and the runner that
starts the job (``nsjail.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class JobLimits:
    """Resolved limits of one job (request values already capped by configuration)."""

    timeout_ms: int
    memory_bytes: int
    pids: int
    stdout_bytes: int
    stderr_bytes: int
    file_size_mib: int
    open_files: int
    tmp_mib: int


@dataclass(frozen=True, slots=True)
class JobSpec:
    """Everything nsjail needs to run one job."""

    argv: Sequence[str]
    workspace: Path
    job_dir: Path
    uid: int
    gid: int
    env: Mapping[str, str]
    limits: JobLimits
    stdin: bytes | None = None
    network: bool = False
    readonly_binds: Sequence[tuple[Path, str]] = ()
    netns_fd: int | None = None
    """Run in this network namespace (None: a fresh one, or the session's; see ``Jail``)."""
    long_running: bool = False
    """No nsjail time or CPU limit; fatal signals to nsjail are forwarded to the job."""
    pass_fds: Sequence[int] = ()
    """Extra descriptors the job inherits under the same numbers."""
    home_link: str | None = None
    """An absolute path inside the jail made a symlink to the workspace (``/home/user``)."""
    devpts: bool = False
    """Mount a devpts instance of the job's own, so it can open pseudo-terminals."""


__all__ = ["JobLimits", "JobSpec"]
