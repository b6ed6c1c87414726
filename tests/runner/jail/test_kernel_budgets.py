"""Kernel budgets a job could exhaust for the whole host (issue 14, item 4)."""

from __future__ import annotations

import concurrent.futures
import ctypes
import os
import time
from pathlib import Path

import httpx

from sandcell_runner.jail.host_limits import HostLimit, apply_host_limits
from tests.fixtures.runner_process import RunnerProcess
from tests.runner.conftest import StartRunner
from tests.runner.helpers import execute

_libc = ctypes.CDLL(None, use_errno=True)

# Takes inotify instances until the kernel refuses (or `want`), says how many, holds them.
_HOG = """
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
want, hold_s = int(sys.argv[1]), float(sys.argv[2])
fds = []
while len(fds) < want:
    fd = libc.inotify_init1(0)
    if fd < 0:
        break
    fds.append(fd)
print(len(fds), flush=True)
time.sleep(hold_s)
"""


def _inotify_holders(minimum: int) -> list[int]:
    """Pids of job processes (pool UIDs) holding at least ``minimum`` inotify instances."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if os.stat(entry.path).st_uid < 20_000:
                continue
            fds = os.listdir(f"{entry.path}/fd")
            count = sum(os.readlink(f"{entry.path}/fd/{fd}") == "anon_inode:inotify" for fd in fds)
        except OSError:
            continue
        if count >= minimum:
            found.append(int(entry.name))
    return found


def test_a_job_cannot_take_the_hosts_inotify_instances(
    runner: RunnerProcess, runner_factory: StartRunner
) -> None:
    """A job holding every inotify instance it can get leaves root's budget, and a job of
    another runner's, untouched: its instances are charged to its own UID."""
    other = runner_factory()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        hog = pool.submit(
            execute, runner, language="python", code=_HOG, args=["4096", "8"], timeout_ms=20_000
        )
        deadline = time.monotonic() + 20
        while not _inotify_holders(100) and time.monotonic() < deadline and not hog.done():
            time.sleep(0.05)
        assert _inotify_holders(100), hog.result() if hog.done() else "the hog never got going"
        # Host root (this test runs as the runner's user) can still make one.
        fd = _libc.inotify_init1(0)
        assert fd >= 0, os.strerror(ctypes.get_errno())
        os.close(fd)
        # So can a job of another runner, to its own full budget.
        neighbour = execute(other, language="python", code=_HOG, args=["64", "0"])
        assert neighbour["stdout"].split() == ["64"], neighbour
        held = hog.result()
    assert held["status"] == "ok", held
    assert int(held["stdout"].split()[0]) >= 100


_REFUSED = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.fanotify_init(0x200, os.O_RDONLY)  # FAN_CLASS_NOTIF | FAN_REPORT_FID: unprivileged
print("fanotify_init", fd, ctypes.get_errno())
ctx = ctypes.c_ulong(0)
r = libc.syscall(206, 1, ctypes.byref(ctx))  # io_setup: counts against fs.aio-max-nr
print("io_setup", r, ctypes.get_errno())
"""


def test_fanotify_and_native_aio_are_refused(runner: RunnerProcess) -> None:
    """fanotify answers EPERM and io_setup ENOSYS (its contexts are one host-wide counter)."""
    result = execute(runner, language="python", code=_REFUSED)
    assert result["stdout"].splitlines() == ["fanotify_init -1 1", "io_setup -1 38"], result


def test_missing_host_sysctls_are_warnings(runner_factory: StartRunner) -> None:
    """A host sysctl the runner cannot raise far enough shows under /health's warnings."""
    # 4100 jobs x 1024 pids need kernel.pid_max above its largest value (2^22).
    busy = runner_factory(SANDCELL_RUNNER_MAX_JOBS="4100", SANDCELL_RUNNER_OPEN_FILES="64")
    warnings = httpx.get(busy.url + "/health", headers=busy.headers()).json()["warnings"]
    assert any(w.startswith("host sysctl kernel.pid_max=") for w in warnings), warnings
    assert execute(busy, language="bash", code="echo ok")["stdout"] == "ok\n"


def test_host_limits_raise_what_is_low_and_report_the_rest(tmp_path: Path) -> None:
    """Too low and writable: raised; never lowered; absent or not raisable: a warning."""
    (tmp_path / "kernel").mkdir()
    (tmp_path / "kernel" / "pid_max").write_text("100\n")
    (tmp_path / "kernel" / "threads-max").write_text("900\n")
    limits = [
        HostLimit("kernel.pid_max", 500, "tasks"),
        HostLimit("kernel.threads-max", 500, "tasks"),
        HostLimit("fs.file-max", 10, "files"),
        HostLimit("kernel.unprivileged_userns_clone", 1, "userns", optional=True),
    ]
    warnings = apply_host_limits(limits, root=tmp_path, may_raise=True)
    assert (tmp_path / "kernel" / "pid_max").read_text() == "500"
    assert (tmp_path / "kernel" / "threads-max").read_text() == "900\n"
    assert warnings == ["host sysctl fs.file-max not readable (files)"]
    (tmp_path / "kernel" / "pid_max").write_text("100\n")
    (warning,) = apply_host_limits(limits[:1], root=tmp_path, may_raise=False)
    assert warning.startswith("host sysctl kernel.pid_max=100 is below 500")
