"""How a job's outcome becomes the CLI's exit code."""

from __future__ import annotations

import pytest

from sandcell_orchestrator.cli import job_exit_code
from sandcell_protocol import ExecuteResult, RunStatus


def result(status: RunStatus, exit_code: int | None, signal: str | None = None) -> ExecuteResult:
    return ExecuteResult(
        status=status,
        exit_code=exit_code,
        signal=signal,
        stdout="",
        stderr="",
        stdout_truncated=False,
        stderr_truncated=False,
        wall_ms=1,
        cpu_ms=1,
        max_rss_kib=None,
        files=[],
    )


@pytest.mark.parametrize(
    ("status", "exit_code", "expected"),
    [
        (RunStatus.OK, 0, 0),
        (RunStatus.ERROR, 3, 3),
        (RunStatus.ERROR, 256, 1),
        (RunStatus.ERROR, -9, 247),
        (RunStatus.TIMEOUT, None, 124),
        (RunStatus.TIMEOUT, 0, 124),
        (RunStatus.MEMORY_LIMIT, None, 137),
        (RunStatus.SIGNALED, None, 137),
        (RunStatus.OUTPUT_LIMIT, None, 1),
        (RunStatus.OUTPUT_LIMIT, 0, 1),
        (RunStatus.DISK_LIMIT, 1, 1),
        (RunStatus.INTERNAL_ERROR, None, 1),
    ],
)
def test_job_exit_code(status: RunStatus, exit_code: int | None, expected: int) -> None:
    assert job_exit_code(result(status, exit_code)) == expected
