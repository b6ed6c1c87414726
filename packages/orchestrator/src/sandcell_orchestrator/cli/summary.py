"""What ``sandcell exec`` says on stderr after the job's own output.

Every limit a job can hit is named with the flag or variable that changes it,
so "status timeout, signal SIGKILL" never leaves a user guessing which limit it
was. The runner reads its ``SANDCELL_RUNNER_*`` limits at start; the local
provider passes them on from this process's environment.
"""

from __future__ import annotations

from typing import TextIO

from sandcell_protocol import ExecuteRequest, ExecuteResult, RunStatus

__all__ = ["limit_notes", "print_summary"]

_LIMITS = {
    RunStatus.MEMORY_LIMIT: (
        "the job was killed at its memory limit"
        " (SANDCELL_RUNNER_MEMORY_MIB, default 512 MiB; cap SANDCELL_RUNNER_MAX_MEMORY_MIB)"
    ),
    RunStatus.OUTPUT_LIMIT: (
        "the job was stopped at an output limit"
        " (SANDCELL_RUNNER_STDOUT_BYTES / SANDCELL_RUNNER_STDERR_BYTES, default 1 MiB each)"
    ),
    RunStatus.DISK_LIMIT: (
        "the job ran out of disk"
        " (SANDCELL_RUNNER_WORKSPACE_QUOTA_MIB, default 1024 MiB;"
        " one file at most SANDCELL_RUNNER_FILE_SIZE_MIB, SANDCELL_RUNNER_TMP_MIB for /tmp)"
    ),
}


def limit_notes(result: ExecuteResult, request: ExecuteRequest) -> list[str]:
    """One line per limit the job hit, naming the limit and what changes it."""
    notes: list[str] = []
    if result.status == RunStatus.TIMEOUT:
        notes.append(
            f"the job was stopped at its time limit of {request.timeout_ms / 1000:g} s"
            " (--timeout-s N changes it; at most SANDCELL_RUNNER_MAX_TIMEOUT_MS, default 600 s)"
        )
    elif result.status in _LIMITS:
        notes.append(_LIMITS[result.status])
    for stream, truncated in (
        ("stdout", result.stdout_truncated),
        ("stderr", result.stderr_truncated),
    ):
        if truncated:
            variable = f"SANDCELL_RUNNER_{stream.upper()}_BYTES"
            notes.append(
                f"{stream} was cut at the runner's limit ({variable}, default 1 MiB);"
                " write large output to a file instead"
            )
    return notes


def print_summary(
    result: ExecuteResult, request: ExecuteRequest, err: TextIO, *, hint: str | None
) -> None:
    """The lines after the job's own output: status, limits, session state, files."""
    notes = []
    if result.status != RunStatus.OK:
        exit_text = "" if result.exit_code is None else f", exit code {result.exit_code}"
        signal_text = "" if result.signal is None else f", signal {result.signal}"
        notes.append(f"status {result.status}{exit_text}{signal_text}")
    notes += limit_notes(result, request)
    if result.status == RunStatus.TIMEOUT and hint is not None:
        notes.append(f"session {hint!r} keeps what the job wrote before it was stopped")
    if result.files:
        notes.append("files: " + ", ".join(f.name for f in result.files))
    for note in notes:
        err.write(f"sandcell: {note}\n")
    err.flush()
