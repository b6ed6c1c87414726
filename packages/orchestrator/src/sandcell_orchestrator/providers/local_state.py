"""A local runner's facts, kept in its root's ``sandbox.json``, and whether it still lives.

``LocalRunner`` is what the local provider knows about one runner process: pid,
port, token, root, the session it serves, and the process's start time. They sit in
a 0600 ``sandbox.json`` under the runner's root, so that another orchestrator
process (each ``sandcell exec`` is one) can connect to or destroy it.

A pid alone does not name a runner: once the runner is gone and reaped, the kernel
may give the pid to any process, another sandbox's runner included (which passes the
cmdline check). The pid's start time, read when the runner was launched, is what
tells them apart (``is_this_runner``).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from .local_zygote import ForkedRunner

__all__ = [
    "LaunchedProcess",
    "LocalRunner",
    "forget_state",
    "is_this_runner",
    "read_state",
    "runner_alive",
    "start_ticks",
    "write_state",
]

LaunchedProcess = subprocess.Popen[bytes] | ForkedRunner
"""A runner process as its launch holds it: this process's child, or the zygote's."""


@dataclass(frozen=True, slots=True)
class LocalRunner:
    """One local runner process: where it listens, its token, its root and session."""

    sandbox_id: str
    pid: int
    port: int
    token: str = field(repr=False)
    root: Path
    session_id: str | None = None
    started: int | None = None
    """The process's start time (``/proc/<pid>/stat`` field 22, clock ticks since boot):
    with the pid, what names *this* runner. A pid alone is reused, maybe by another
    sandbox's runner, which the cmdline check passes. None in a ``sandbox.json`` written
    before it was recorded: then only the cmdline check is made."""

    @property
    def url(self) -> str:
        """The runner's base URL (loopback)."""
        return f"http://127.0.0.1:{self.port}"


def read_state(sandbox_id: str, root: Path) -> LocalRunner | None:
    """The runner ``root``'s ``sandbox.json`` names; None when it is missing or unreadable
    (a launch that never finished, a destroy that forgot it)."""
    try:
        data = json.loads((root / "sandbox.json").read_text())
        session = data.get("session_id")
        started = data.get("started")
        return LocalRunner(
            sandbox_id,
            int(data["pid"]),
            int(data["port"]),
            str(data["token"]),
            root,
            str(session) if session is not None else None,
            int(started) if started is not None else None,
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_state(runner: LocalRunner) -> None:
    """Write (or replace) ``runner``'s ``sandbox.json``: 0600, as it holds the token."""
    path = runner.root / "sandbox.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(
            {
                "pid": runner.pid,
                "port": runner.port,
                "token": runner.token,
                "session_id": runner.session_id,
                "started": runner.started,
            },
            out,
        )


def forget_state(root: Path) -> None:
    """Remove the root's ``sandbox.json``, so nothing signals its pid again."""
    with contextlib.suppress(FileNotFoundError):
        (root / "sandbox.json").unlink()


def runner_alive(runner: LocalRunner) -> bool:
    """Whether ``runner``'s process is running: this runner (by start time), not a
    zombie, and a ``sandcell_runner`` by its cmdline."""
    try:
        process = psutil.Process(runner.pid)
        return (
            is_this_runner(runner)
            and process.status() != psutil.STATUS_ZOMBIE
            and "sandcell_runner" in " ".join(process.cmdline())
        )
    except psutil.Error:
        return False


def is_this_runner(runner: LocalRunner) -> bool:
    """The pid's process started when this runner did (True when that was not recorded)."""
    return runner.started is None or start_ticks(runner.pid) == runner.started


def start_ticks(pid: int) -> int | None:
    """Field 22 of ``/proc/<pid>/stat``, exact (psutil's ``create_time`` is a float
    derived from it and the boot time); None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            # The command name (field 2) may hold spaces and parentheses: split after it.
            fields = stat.read().rpartition(b")")[2].split()
        return int(fields[19])  # fields[0] is field 3
    except (OSError, ValueError, IndexError):
        return None
