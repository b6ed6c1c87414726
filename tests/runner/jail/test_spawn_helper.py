"""The resident spawn helper (``jail/spawnd.py``): what it holds, and what losing it costs."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import signal
import time

import httpx
import psutil
import pytest

from sandcell_runner.jail.spawn_helper import SpawnHelper
from sandcell_runner.jail.spawner import SpawnRequest
from tests.runner.conftest import StartRunner
from tests.runner.helpers import execute


def _helpers(runner_pid: int) -> list[psutil.Process]:
    return [
        child
        for child in psutil.Process(runner_pid).children()
        if any(arg.endswith("spawnd.py") for arg in child.cmdline())
    ]


def test_helper_holds_nothing_of_the_runner(runner_factory: StartRunner) -> None:
    """The helper has no environment (so no token), and no descriptor but its socket and
    stdio; a job it starts runs as its own UID with only its three standard streams."""
    runner = runner_factory()
    (helper,) = _helpers(runner.process.pid)
    assert helper.environ() == {}
    assert runner.token not in " ".join(helper.cmdline())
    links = {
        int(fd): os.readlink(f"/proc/{helper.pid}/fd/{fd}")
        for fd in os.listdir(f"/proc/{helper.pid}/fd")
    }
    extra = {fd: link for fd, link in links.items() if fd > 2}
    assert len(extra) == 1, links
    assert next(iter(extra.values())).startswith("socket:")
    assert links[0] == os.devnull

    result = execute(runner, language="bash", code="id -u; id -G; ls /proc/self/fd; env")
    assert result["status"] == "ok", result
    uid, groups, *rest = result["stdout"].split("\n")
    assert 20_000 <= int(uid) <= 20_999
    assert groups == uid  # no supplementary groups
    assert rest[:4] == ["0", "1", "2", "3"]  # ls's own directory descriptor is the 3
    assert not [line for line in rest if line.startswith("SANDCELL")]
    assert runner.token not in result["stdout"]


def test_a_lost_helper_ends_its_jobs_and_is_replaced(runner_factory: StartRunner) -> None:
    """SIGKILL of the helper kills the jobs it started (their death signal), their
    requests are answered, not left hanging, and the next job gets a new helper."""
    runner = runner_factory()
    (helper,) = _helpers(runner.process.pid)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(
            httpx.post,
            runner.url + "/v1/execute",
            json={"language": "bash", "code": "sleep 100"},
            headers=runner.headers(),
            timeout=60,
        )
        deadline = time.monotonic() + 30
        while not helper.children() and time.monotonic() < deadline:
            time.sleep(0.02)
        jails = helper.children(recursive=True)
        assert jails, "the job never started"
        os.kill(helper.pid, signal.SIGKILL)
        answer = pending.result(timeout=30)
    assert answer.status_code == 500, answer.text
    assert answer.json()["error"]["code"] == "internal"
    gone = psutil.wait_procs(jails, timeout=10)[1]
    assert not gone, gone

    again = execute(runner, language="bash", code="echo again")
    assert again["stdout"] == "again\n"
    (replacement,) = _helpers(runner.process.pid)
    assert replacement.pid != helper.pid


async def test_helper_reports_exits_and_refusals() -> None:
    """Straight to the helper: a process's exit status and rusage come back, descriptors
    land at the numbers asked for, and an exec that fails is raised as its OSError."""
    helper = SpawnHelper()
    try:
        read_end, write_end = os.pipe()
        with open(os.devnull, "rb") as null:
            # The job sees the descriptor at the runner's number (nsjail's argv names it),
            # whatever number it arrived at in the helper.
            request = SpawnRequest(
                argv=["/bin/bash", "-c", f"echo out >&{write_end}; exit 3"],
                stdin=null.fileno(),
                stdout=null.fileno(),
                stderr=null.fileno(),
                env={"PATH": "/usr/bin:/bin"},
                pass_fds=[write_end],
            )
            try:
                process = await helper.spawn(request)
            finally:
                os.close(write_end)
            status, usage = await process.wait()
            assert os.waitstatus_to_exitcode(status) == 3
            assert usage is not None
            assert usage.ru_maxrss > 0
            assert os.read(read_end, 100) == b"out\n"
            os.close(read_end)
            missing = dataclasses.replace(request, argv=["/nonexistent/binary"], pass_fds=[])
            with pytest.raises(FileNotFoundError):
                await helper.spawn(missing)
    finally:
        helper.close()
