"""A session turn's job directory and entry file serve the next turn (``create_session_job_dir``).

Each turn used to make ``session/job-<id>`` and its entry file and remove both after,
two inodes created and freed per turn on the workspace root (what ext4 without a
journal makes costly: ``workspace/entry.py``). Now the directory is emptied but for
the entry file (mode 0) and the next turn writes over it. The checks hold the kept
file open, so "the same inode" cannot pass by the filesystem reusing a number.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

from sandcell_runner.workspace.manager import WorkspaceManager
from tests.fixtures.paths import traversable_dir
from tests.fixtures.runner_process import RunnerProcess
from tests.runner.session.helpers import SessionClient

LONG = "print('the first turn')  # " + "a secret of the first turn " * 20


def _kept(runner: RunnerProcess) -> Path:
    """The one session job directory left after a turn, once its file has mode 0."""
    deadline = time.monotonic() + 10
    while True:
        dirs = list((runner.workspace_root / "session").glob("job-*"))
        files = [p for d in dirs for p in d.iterdir()]
        if len(dirs) == 1 and len(files) == 1 and stat.S_IMODE(files[0].lstat().st_mode) == 0:
            return files[0]
        assert time.monotonic() < deadline, (dirs, files)
        time.sleep(0.02)


def test_the_next_turn_writes_over_the_kept_entry_and_sees_only_its_own(
    session_runner: RunnerProcess,
) -> None:
    with SessionClient(session_runner) as session:
        assert session.execute(LONG)["stdout"] == "the first turn\n"
        first = _kept(session_runner)
        held = os.open(first, os.O_RDONLY)
        try:
            # Another language, a shorter entry: renamed, cut to its own length.
            code = "ls -A /mnt/job; cat /mnt/job/main.sh"
            result = session.execute(code, language="bash")
            assert result["status"] == "ok", result["stderr"]
            assert result["stdout"] == f"main.sh\n{code}"

            second = _kept(session_runner)
            assert second.parent == first.parent
            assert os.stat(second).st_ino == os.fstat(held).st_ino
            assert os.pread(held, 4096, 0) == code.encode()  # nothing of the first turn
        finally:
            os.close(held)
        assert session.execute("print(open('/mnt/job/main.py').read())")["stdout"] == (
            "print(open('/mnt/job/main.py').read())\n"
        )


def test_only_a_caller_that_writes_the_entry_gets_a_kept_directory() -> None:
    with traversable_dir("sessjob-") as root:
        manager = WorkspaceManager(root / "ws", quota_bytes=1 << 20)
        manager.prepare()
        turn = manager.create_session_job_dir(reuse=True)
        (turn / "main.py").write_bytes(b"another session's code")
        manager.remove_session_job_dir(turn)
        assert stat.S_IMODE((turn / "main.py").stat().st_mode) == 0

        # An analysis (no entry written) must not see the kept file, nor its size.
        fresh = manager.create_session_job_dir()
        assert fresh != turn
        assert list(fresh.iterdir()) == []
        manager.remove_dir(fresh)

        assert manager.create_session_job_dir(reuse=True) == turn
        # A kept directory removed meanwhile (a reaper, a wiped root): a new one.
        manager.remove_session_job_dir(turn)
        manager.remove_dir(turn)
        again = manager.create_session_job_dir(reuse=True)
        assert again != turn
        assert again.is_dir()
        assert list(again.iterdir()) == []
