"""The resident spawn helper (``jail/spawnd.py``): what it holds, what losing it costs,
and what its children get, on both of its paths (``vfork`` through ``_vfork.c``, and
``fork`` in Python: ``SANDCELL_RUNNER_SPAWN_VFORK``)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import os
import signal
import time
from pathlib import Path

import httpx
import psutil
import pytest

from sandcell_runner.errors import JailError
from sandcell_runner.jail.spawn_helper import SpawnHelper
from sandcell_runner.jail.spawner import SpawnRequest
from tests.runner.conftest import StartRunner
from tests.runner.helpers import execute
from tests.runner.jail.real_jail import SPAWN_METHODS, helper_method, spawn_helper

ENV_OF = {"vfork": "1", "fork": "0"}


def _helpers(runner_pid: int) -> list[psutil.Process]:
    return [
        child
        for child in psutil.Process(runner_pid).children()
        if any(arg.endswith("spawnd.py") for arg in child.cmdline())
    ]


@pytest.mark.parametrize("method", SPAWN_METHODS)
def test_helper_holds_nothing_of_the_runner(runner_factory: StartRunner, method: str) -> None:
    """The helper has no environment (so no token), and no descriptor but its socket and
    stdio; a job it starts runs as its own UID with only its three standard streams."""
    runner = runner_factory(SANDCELL_RUNNER_SPAWN_VFORK=ENV_OF[method])
    (helper,) = _helpers(runner.process.pid)
    assert helper_method(helper.pid) == method
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


@pytest.mark.parametrize("method", SPAWN_METHODS)
def test_a_lost_helper_ends_its_jobs_and_is_replaced(
    runner_factory: StartRunner, method: str
) -> None:
    """SIGKILL of the helper kills the jobs it started (their death signal), their
    requests are answered, not left hanging, and the next job gets a new helper."""
    runner = runner_factory(SANDCELL_RUNNER_SPAWN_VFORK=ENV_OF[method])
    (helper,) = _helpers(runner.process.pid)
    assert helper_method(helper.pid) == method
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
    assert helper_method(replacement.pid) == method


@pytest.mark.parametrize("method", SPAWN_METHODS)
async def test_helper_reports_exits_and_refusals(method: str) -> None:
    """Straight to the helper: a process's exit status and rusage come back, descriptors
    land at the numbers asked for, and an exec that fails is raised as its OSError."""
    helper = spawn_helper(method)
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


def _sleeper(**changes: object) -> SpawnRequest:
    null = os.open(os.devnull, os.O_RDONLY)  # the caller closes it
    request = SpawnRequest(
        argv=["/bin/sleep", "100"],
        stdin=null,
        stdout=null,
        stderr=null,
        env={"PATH": "/usr/bin:/bin", "ONLY": "this"},
    )
    return dataclasses.replace(request, **changes)  # type: ignore[arg-type]


def _asleep(pid: int) -> None:
    """Wait until ``sleep`` sleeps: at start-up it opens (and closes) locale files."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/wchan") as wchan:
            if "nanosleep" in wchan.read():
                return
        time.sleep(0.01)
    raise AssertionError(f"{pid} never went to sleep")


def _status_field(pid: int, name: str) -> str:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(name + ":"):
                return line.split()[1]
    raise AssertionError(f"no {name} in /proc/{pid}/status")


@pytest.mark.parametrize("method", SPAWN_METHODS)
async def test_a_child_gets_its_targets_its_env_and_nothing_else(method: str) -> None:
    """The child has exactly the descriptors asked for, at their numbers, none of the
    request's others (a cgroup file, a namespace, the sources as they arrived) nor the
    helper's socket; exactly the request's environment; no signal ignored or blocked
    (Python ignores SIGPIPE and SIGXFSZ, and an ignored one would survive the exec);
    its own session; the UID and GID asked for with no supplementary groups."""
    helper = spawn_helper(method)
    read_end, write_end = os.pipe()
    netns = os.open("/proc/self/ns/net", os.O_RDONLY)
    extra = os.open(os.devnull, os.O_WRONLY)  # an unused cgroup fd would leak the same way
    target = 47
    request = _sleeper(pass_fds=[write_end], netns_fd=netns, user=61_237, group=61_238)
    try:
        process = await helper.spawn(dataclasses.replace(request, cgroup_fds=[extra]))
        pid = process.pid
        # Not the one this process has at that number: the child's own pass-through.
        moved = dataclasses.replace(request, pass_fds=[target])
        os.dup2(write_end, target)
        second = await helper.spawn(moved)
        try:
            _asleep(pid)
            _asleep(second.pid)
            fds = {
                int(fd): os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")
            }
            assert sorted(fds) == [0, 1, 2, write_end], fds
            assert fds[0] == fds[1] == fds[2] == os.devnull
            assert fds[write_end] == os.readlink(f"/proc/self/fd/{write_end}")
            assert sorted(os.listdir(f"/proc/{second.pid}/fd")) == ["0", "1", "2", str(target)]
            with open(f"/proc/{pid}/environ", "rb") as environ:
                assert environ.read() == b"PATH=/usr/bin:/bin\0ONLY=this\0"
            assert int(_status_field(pid, "SigIgn"), 16) == 0
            assert int(_status_field(pid, "SigBlk"), 16) == 0
            assert os.getsid(pid) == pid
            assert _status_field(pid, "Uid") == "61237"
            assert _status_field(pid, "Gid") == "61238"
            with open(f"/proc/{pid}/status") as status:
                groups = next(line for line in status if line.startswith("Groups:"))
            assert groups.split() == ["Groups:"]
            assert _status_field(pid, "PPid") == str(_helper_pid(helper))
        finally:
            for started in (process, second):
                started.send_signal(signal.SIGKILL, group=True)
                status, _ = await started.wait()
                assert os.WTERMSIG(status) == signal.SIGKILL
    finally:
        helper.close()
        for fd in (read_end, write_end, netns, extra, target, request.stdin):
            os.close(fd)


@pytest.mark.parametrize("method", SPAWN_METHODS)
async def test_a_failed_step_is_raised_with_its_name(method: str) -> None:
    """A child that cannot start is reported (and reaped) with the step that failed and
    its errno, the same on both paths; the helper goes on serving."""
    helper = spawn_helper(method)
    not_a_netns = os.open(os.devnull, os.O_RDONLY)
    request = _sleeper()
    try:
        cases = [
            (_sleeper(cwd="/nonexistent/dir"), FileNotFoundError, "chdir: .*'/nonexistent/dir'"),
            (
                _sleeper(cgroup_tasks=[Path("/nonexistent/tasks")]),
                FileNotFoundError,
                "cgroup: .*'/nonexistent/tasks'",
            ),
            (_sleeper(netns_fd=not_a_netns), OSError, "setns: .*Invalid argument"),
            (_sleeper(argv=["/nonexistent/bin"]), FileNotFoundError, "exec: .*'/nonexistent/bin'"),
            (_sleeper(argv=["/"]), PermissionError, "exec: .*Permission denied"),
            # (uid_t)-1 would mean "leave it": the child would run as root.
            (_sleeper(user=2**32 - 1), JailError, "bad request: uid or gid out of range"),
        ]
        for failing, error, message in cases:
            with pytest.raises(error, match=message):
                await helper.spawn(failing)
            os.close(failing.stdin)
        process = await helper.spawn(dataclasses.replace(request, argv=["/bin/true"]))
        status, _ = await process.wait()
        assert os.waitstatus_to_exitcode(status) == 0
        # Every failed child was reaped by the helper: none is left a zombie.
        assert not psutil.Process(_helper_pid(helper)).children()
    finally:
        helper.close()
        os.close(not_a_netns)
        os.close(request.stdin)


@pytest.mark.parametrize("method", SPAWN_METHODS)
async def test_a_child_dies_with_the_helper(method: str) -> None:
    """The death signal, on both paths: SIGKILL of the helper kills what it started,
    even a child that ignores every catchable signal and runs as another UID."""
    helper = spawn_helper(method)
    request = _sleeper(user=61_239, group=61_239)
    try:
        process = await helper.spawn(request)
        child = psutil.Process(process.pid)
        assert child.uids().real == 61_239
        os.kill(_helper_pid(helper), signal.SIGKILL)
        _, alive = psutil.wait_procs([child], timeout=10)
        assert not alive, alive
    finally:
        helper.close()
        os.close(request.stdin)


def _helper_pid(helper: SpawnHelper) -> int:
    assert helper.pid is not None
    return helper.pid


@pytest.mark.parametrize("method", SPAWN_METHODS)
async def test_a_signal_the_runners_launcher_ignored_is_not_the_jobs(method: str) -> None:
    """``nohup`` ignores SIGHUP and a non-interactive shell's ``&`` SIGINT and SIGQUIT;
    ignored dispositions survive fork and exec, but a job (and a code context, whose
    interrupt is a SIGINT) starts with every signal at its default."""
    launched_with = (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT)
    before = {signum: signal.signal(signum, signal.SIG_IGN) for signum in launched_with}
    try:
        helper = spawn_helper(method)  # inherits this process's ignores, as from nohup
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)
    try:
        with open(f"/proc/{_helper_pid(helper)}/status") as status:
            ignored = next(line for line in status if line.startswith("SigIgn:"))
        inherited = int(ignored.split()[1], 16)
        request = _sleeper()
        try:
            process = await helper.spawn(request)
            try:
                _asleep(process.pid)
                assert int(_status_field(process.pid, "SigIgn"), 16) == 0
            finally:
                process.send_signal(signal.SIGKILL, group=True)
                await process.wait()
        finally:
            os.close(request.stdin)
    finally:
        helper.close()
    # Python's own two are all the helper ignores: the launcher's three are gone.
    assert inherited == (1 << (signal.SIGPIPE - 1)) | (1 << (signal.SIGXFSZ - 1))


@pytest.mark.parametrize("method", SPAWN_METHODS)
async def test_a_helper_launched_without_waiting_answers_at_its_first_spawn(method: str) -> None:
    """``wait=False`` (the runner's start-up, which does its other set-up meanwhile):
    the helper is running when the constructor returns, its way of starting children is
    known only once it answered, and the first spawn waits for that answer itself."""
    helper = SpawnHelper(vfork=method == "vfork", wait=False)
    request = _sleeper()
    try:
        assert helper.pid is not None
        assert psutil.Process(helper.pid).is_running()
        assert helper.spawn_method == "fork"  # not answered yet: the default
        process = await helper.spawn(request)
        assert helper.spawn_method == method == helper_method(_helper_pid(helper))
        process.send_signal(signal.SIGKILL, group=True)
        status, _ = await process.wait()
        assert os.waitstatus_to_exitcode(status) == -signal.SIGKILL
    finally:
        helper.close()
        os.close(request.stdin)


def test_a_helper_closed_before_it_answered_exits() -> None:
    """A start-up that failed after the launch closes the helper: it sees EOF and exits
    (none is left behind for the process's lifetime)."""
    helper = SpawnHelper(wait=False)
    child = psutil.Process(_helper_pid(helper))
    helper.close()
    _, alive = psutil.wait_procs([child], timeout=10)
    assert not alive, alive
    helper.wait_started()  # nothing to wait for once closed


@pytest.mark.parametrize("method", SPAWN_METHODS)
async def test_a_quiet_start_reports_its_failure_signal_and_exit_by_request(method: str) -> None:
    """``start`` (a job's path: no answer to wait for): a child that cannot start raises
    its error from ``wait``, as ``spawn`` would; a running one is signalled by its
    request number and reports its exit with the helper's ``ru_maxrss`` floor; another
    request's signal never reaches it; the helper goes on answering ``spawn``."""
    helper = spawn_helper(method)
    request = _sleeper()
    try:
        failing = _sleeper(argv=["/nonexistent/bin"])
        refused = helper.start(failing)
        with pytest.raises(FileNotFoundError, match=r"exec: .*'/nonexistent/bin'"):
            await refused.wait()
        with pytest.raises(FileNotFoundError):
            await refused.wait()  # any number of times
        os.close(failing.stdin)
        first = helper.start(request)
        second = helper.start(request)
        helper.signal_request(10_000, signal.SIGKILL, group=True)  # no such request
        first.send_signal(signal.SIGKILL, group=True)
        status, usage = await first.wait()
        assert os.WIFSIGNALED(status)
        assert os.WTERMSIG(status) == signal.SIGKILL
        assert usage is not None
        assert first.floor_kib > 0
        # The second, signalled by nothing, still sleeps: the helper knows it by its
        # request number alone, and the exit named the first.
        sleeping = [p for p in psutil.Process(_helper_pid(helper)).children() if p.is_running()]
        assert len(sleeping) == 1
        second.send_signal(signal.SIGTERM, group=False)
        status, _ = await second.wait()
        assert os.WIFSIGNALED(status)
        assert os.WTERMSIG(status) == signal.SIGTERM
        process = await helper.spawn(dataclasses.replace(request, argv=["/bin/true"]))
        status, _ = await process.wait()
        assert os.waitstatus_to_exitcode(status) == 0
        assert not psutil.Process(_helper_pid(helper)).children()
    finally:
        helper.close()
        os.close(request.stdin)


@pytest.mark.parametrize("method", SPAWN_METHODS)
async def test_a_quiet_start_ends_as_killed_when_the_helper_is_lost(method: str) -> None:
    """A ``start``ed child dies with the helper (its death signal), and its waiter is
    told it was killed rather than left waiting for an exit nobody will report."""
    helper = spawn_helper(method)
    request = _sleeper()
    try:
        started = helper.start(request)
        deadline = time.monotonic() + 30
        while not psutil.Process(_helper_pid(helper)).children():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        (child,) = psutil.Process(_helper_pid(helper)).children()
        os.kill(_helper_pid(helper), signal.SIGKILL)
        async with asyncio.timeout(30):
            status, usage = await started.wait()
        assert os.WIFSIGNALED(status)
        assert os.WTERMSIG(status) == signal.SIGKILL
        assert usage is None
        _, alive = psutil.wait_procs([child], timeout=10)
        assert not alive, alive
    finally:
        helper.close()
        os.close(request.stdin)
