"""What a finished job reports: nsjail's log and wait status read, its peak memory chosen.

nsjail exits 128+N both when the job exited N and when a signal N killed it, so
the job's own status comes from nsjail's log; ``nsjail.py`` runs the job and
hands the raw figures here.
"""

from __future__ import annotations

import os
import re
import resource
import signal
from dataclasses import dataclass

from .job_cgroup import JobCgroupStats

__all__ = [
    "JobOutcome",
    "decode_status",
    "job_peak_kib",
    "job_status_from_log",
    "launch_status",
    "signal_name",
    "warnings_only",
]


@dataclass(slots=True)
class JobOutcome:
    """What happened to a job, as measured by the runner."""

    exit_code: int | None
    signal: str | None
    timed_out: bool
    stdout_limited: bool
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool
    stderr_truncated: bool
    wall_ms: int
    cpu_ms: int
    max_rss_kib: int | None
    cgroup: JobCgroupStats | None
    jail_log: str = ""
    drain_cpu_ms: int = 0
    """The runner's own CPU time spent reading (and, past a cap, discarding) the
    job's output streams."""


_EXITED_RE = re.compile(r"\) exited with status: (\d+)")
_SIGNALED_RE = re.compile(r"\) terminated with signal: \w+ \((\d+)\)")


def job_status_from_log(log_text: str) -> tuple[int | None, str | None] | None:
    """The job's own (exit code, signal) from nsjail's log; nsjail's exit code is 128+N
    for both. None when the log never says how the job ended: nsjail failed to run it
    (configuration, namespaces) or was killed first."""
    # nsjail's last line says it, as a rule: looked at first, not the ~33 lines split.
    last = log_text[log_text.rfind("\n", 0, len(log_text) - 1) + 1 :]
    if match := _EXITED_RE.search(last):
        return int(match.group(1)), None
    if match := _SIGNALED_RE.search(last):
        return None, signal_name(int(match.group(1)))
    for line in reversed(log_text.splitlines()):
        if match := _EXITED_RE.search(line):
            return int(match.group(1)), None
        if match := _SIGNALED_RE.search(line):
            return None, signal_name(int(match.group(1)))
    return None


def launch_status(log_text: str, status: int) -> tuple[int | None, str | None, bool]:
    """(exit code, signal, whether nsjail never reported the job's end) of a launched job."""
    reported = job_status_from_log(log_text)
    if reported is None:
        return (*decode_status(status), True)
    return (*reported, False)


_NOT_INFO_RE = re.compile(r"^(?!\[I\])", re.MULTILINE)
"""The start of a line that is not an info line (one regular-expression scan in C)."""


def warnings_only(log_text: str) -> str:
    """nsjail's log without its info lines, the last 8 KiB."""
    # A job's log is all info lines but for a trailing newline, as a rule: "" at once.
    if _NOT_INFO_RE.search(log_text.rstrip("\n")) is None:
        return ""
    kept = [line for line in log_text.splitlines() if not line.startswith("[I]")]
    return "\n".join(kept)[-8192:]


def job_peak_kib(
    stats: JobCgroupStats | None, rusage: resource.struct_rusage | None, floor_kib: int
) -> int | None:
    """The job's peak memory in KiB, for ``ExecuteResult.max_rss_kib``.

    Not ``ru_maxrss`` as such: nsjail is (v)forked from the process that spawns it
    (the runner, or its spawn helper), and exec records that address space's
    high-water mark as nsjail's own, so every job smaller than it would report its
    size (``floor_kib``). The job cgroup's peak is the figure (what the memory
    limit counts); without cgroups, ``ru_maxrss`` only when it passes the floor.
    """
    if stats is not None and stats.memory_peak_bytes is not None:
        return stats.memory_peak_bytes // 1024
    if rusage is not None and rusage.ru_maxrss > floor_kib:
        return rusage.ru_maxrss
    return None


def decode_status(status: int) -> tuple[int | None, str | None]:
    """(exit code, signal name) of a wait status."""
    if os.WIFSIGNALED(status):
        return None, signal_name(os.WTERMSIG(status))
    return os.WEXITSTATUS(status), None


def signal_name(number: int) -> str:
    """``SIGKILL`` for 9; ``SIG<n>`` for a number with no name."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"SIG{number}"
