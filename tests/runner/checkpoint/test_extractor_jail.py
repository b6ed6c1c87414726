"""The restore extractor runs under a job's jail settings (issue 14, item 9): real runner."""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil

from sandcell_runner.jail.cgroup_reaper import instance_key
from tests.fixtures.paths import traversable_dir
from tests.fixtures.runner_process import RunnerProcess, running_runner
from tests.runner.session.helpers import SessionClient


def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {key: value.strip() for key, _, value in (line.partition(":") for line in lines)}


def _extractor(runner: RunnerProcess, *, deadline_s: float) -> psutil.Process:
    """The extractor serving the restore: the fork server's child that has jailed itself
    (the server, root under a filter of its own, sits above it)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        for child in psutil.Process(runner.process.pid).children(recursive=True):
            try:
                if "sandcell_runner.checkpoint.extractor" not in " ".join(child.cmdline()):
                    continue
                status = _status(child.pid)
                if status.get("Seccomp") == "2" and status["Uid"].split()[0] != "0":
                    return child
            except (psutil.Error, FileNotFoundError):
                continue
        time.sleep(0.02)
    raise AssertionError("no jailed extractor process appeared")


def test_the_extractor_is_jailed_like_a_job() -> None:
    """While it waits for the archive's body, the extractor has a seccomp filter and
    no_new_privs, an empty network namespace of its own, no core dumps, the pinned UID,
    and sits in a cgroup under the runner's instance (memory, pids, the session's CPU)."""
    with (
        traversable_dir() as root,
        running_runner(root, env={"SANDCELL_RUNNER_SESSIONS": "1"}) as runner,
        SessionClient(runner) as session,
    ):
        session.execute("open('kept.txt', 'w').write('kept')")
        archive = session.checkpoint()
        go_on = threading.Event()

        def body() -> Iterator[bytes]:
            yield archive[:64]
            go_on.wait(30)
            yield archive[64:]

        def restore() -> httpx.Response:
            return session.http.post("/v1/session/restore", content=body(), timeout=60)

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(restore)
            try:
                child = _extractor(runner, deadline_s=20)
                deadline = time.monotonic() + 15
                status = _status(child.pid)
                while status.get("Seccomp") != "2" and time.monotonic() < deadline:
                    time.sleep(0.02)
                    status = _status(child.pid)
                own_netns = os.readlink(f"/proc/{runner.process.pid}/ns/net")
                its_netns = os.readlink(f"/proc/{child.pid}/ns/net")
                # Every thread (the inflater too): on v1 the extractor joins through
                # ``tasks``, which moves only the thread that writes.
                threads = {
                    task.name: (task / "cgroup").read_text()
                    for task in Path(f"/proc/{child.pid}/task").iterdir()
                }
                limits = Path(f"/proc/{child.pid}/limits").read_text()
            finally:
                go_on.set()
            response = answer.result()
        assert response.status_code == 200, response.text
        assert status["Seccomp"] == "2", status
        assert status["NoNewPrivs"] == "1"
        assert status["Uid"].split()[0] != "0"
        assert its_netns != own_netns
        key = instance_key(runner.workspace_root)
        assert len(threads) == 2, threads  # the extractor and its inflater, both waiting
        for cgroups in threads.values():
            # v1: the memory and pids controllers' lines; v2: the one unified line ("0::"),
            # which a v1 host shows too, unused.
            lines = [
                line for line in cgroups.splitlines() if ":memory:" in line or ":pids:" in line
            ]
            lines = lines or [line for line in cgroups.splitlines() if line[:3] == "0::"]
            assert lines, cgroups
            assert all(f"/sandcell/{key}/job-" in line for line in lines), cgroups
        core = next(line for line in limits.splitlines() if line.startswith("Max core file size"))
        assert core.split()[4:6] == ["0", "0"], core
        assert session.execute("print(open('kept.txt').read())")["stdout"] == "kept\n"
