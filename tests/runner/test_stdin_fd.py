"""A job's stdin is a sealed memfd (``jail/stdin.py``): its bytes, read-only, off disk."""

from __future__ import annotations

import os

import pytest

from sandcell_runner.jail.stdin import sealed_memfd
from tests.fixtures.runner_process import RunnerProcess
from tests.runner.helpers import execute

PROBE = """
import errno, os, sys
print(os.readlink("/proc/self/fd/0"))
calls = (("write", lambda: os.write(0, b"x")), ("grow", lambda: os.ftruncate(0, 1 << 20)))
for what, call in calls:
    try:
        call()
        print(what, "allowed")
    except OSError as exc:
        print(what, errno.errorcode[exc.errno])
print(repr(sys.stdin.read()[:20]))
"""


def test_the_job_reads_its_stdin_from_a_memfd_it_cannot_change(runner: RunnerProcess) -> None:
    result = execute(runner, language="python", code=PROBE, stdin="héllo\n")
    assert result["status"] == "ok", result["stderr"]
    # A host path of the workspace root (``jobs/<id>/job.stdin (deleted)``) before.
    assert result["stdout"].splitlines() == [
        "/memfd:stdin (deleted)",
        "write EPERM",
        "grow EPERM",
        repr("héllo\n"),
    ]


def test_large_stdin_arrives_whole(runner: RunnerProcess) -> None:
    data = "0123456789abcdef" * (256 * 1024 // 16) + "end"  # past a pipe's 64 KiB
    code = "import sys; b = sys.stdin.buffer.read(); print(len(b), b[-3:].decode())"
    result = execute(runner, language="python", code=code, stdin=data)
    assert result["status"] == "ok", result["stderr"]
    assert result["stdout"] == f"{len(data)} end\n"


def test_each_job_sees_only_its_own_stdin(runner: RunnerProcess) -> None:
    for text in ("a" * 5000, "b", ""):
        result = execute(
            runner, language="bash", code="cat; echo; stat -L -c %s /dev/stdin", stdin=text
        )
        assert result["stdout"] == f"{text}\n{len(text.encode())}\n"


@pytest.mark.parametrize("data", [b"", b"x", bytes(range(256)) * 300])
def test_sealed_memfd_holds_the_bytes_at_offset_zero(data: bytes) -> None:
    fd = sealed_memfd(data)
    try:
        assert os.get_inheritable(fd) is False
        assert os.lseek(fd, 0, os.SEEK_CUR) == 0
        assert os.read(fd, len(data) + 1) == data
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"y", 0)
        for size in {0, len(data) // 2, len(data) + 1} - {len(data)}:
            with pytest.raises(PermissionError):
                os.ftruncate(fd, size)
    finally:
        os.close(fd)
