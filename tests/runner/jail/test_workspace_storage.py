"""Workspace bytes are disk, not job memory; inodes are bounded (issue 14, item 2).

One session runner with a small quota (128 MiB, 2000 inodes) and a 128 MiB memory
limit, so each scenario is a few MiB of real writes through real nsjail jobs.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.fixtures.paths import traversable_dir
from tests.fixtures.runner_process import RunnerProcess, running_runner
from tests.runner.helpers import execute
from tests.runner.session.helpers import SessionClient

MEMORY = {"memory_mib": 128}

FILL = """
import errno, os
n = 0
try:
    while True:
        with open(f"fill-{n}.bin", "wb") as out:
            out.write(os.urandom(8 << 20))
        n += 1
except OSError as exc:
    print(n, errno.errorcode[exc.errno], flush=True)
    raise
"""

ALLOCATE = "block = bytearray(80 << 20)\nprint('allocated', len(block) >> 20)"


@pytest.fixture(scope="module")
def small_runner() -> Iterator[RunnerProcess]:
    with (
        traversable_dir() as root,
        running_runner(
            root,
            env={
                "SANDCELL_RUNNER_SESSIONS": "1",
                "SANDCELL_RUNNER_WORKSPACE_QUOTA_MIB": "128",
                "SANDCELL_RUNNER_WORKSPACE_INODES": "2000",
            },
        ) as process,
    ):
        yield process


@pytest.fixture
def session(small_runner: RunnerProcess) -> Iterator[SessionClient]:
    with SessionClient(small_runner) as client:
        yield client
        client.http.delete("/v1/session")


def test_a_full_workspace_is_disk_limit_not_memory(session: SessionClient) -> None:
    """Writing past the quota gives the job ENOSPC and the turn ``disk_limit``; the next
    job of the session runs."""
    result = session.execute(FILL, limits=MEMORY)
    assert result["status"] == "disk_limit", result
    assert result["stdout"].split()[1] == "ENOSPC", result
    assert session.execute("print('next')")["stdout"] == "next\n"


def test_a_job_that_exits_0_on_a_full_workspace_is_ok(session: SessionClient) -> None:
    """The full disk is named only as the cause of a failure (the runner looks at the
    disk only after a non-zero exit): a job that caught its ENOSPC and exited 0 is ok,
    and the same full workspace fails the next job that exits non-zero as disk_limit."""
    caught = session.execute(FILL.replace("    raise\n", "") + "print('handled')\n", limits=MEMORY)
    assert caught["status"] == "ok", caught
    assert caught["stdout"].split()[1:] == ["ENOSPC", "handled"], caught
    failed = session.execute("open('more.bin', 'wb').write(b'x' * (16 << 20))", limits=MEMORY)
    assert failed["status"] == "disk_limit", failed


def test_kept_bytes_do_not_shrink_a_later_jobs_memory(
    small_runner: RunnerProcess, session: SessionClient
) -> None:
    """80 MiB kept in the workspace, then an 80 MiB allocation under a 128 MiB limit:
    in the same session and in a stateless job on the same runner."""
    kept = session.execute(
        "import os\nopen('kept.bin', 'wb').write(os.urandom(80 << 20))", limits=MEMORY
    )
    assert kept["status"] == "ok", kept
    later = session.execute(ALLOCATE, limits=MEMORY)
    assert later["status"] == "ok", later
    assert later["stdout"] == "allocated 80\n"
    other = execute(small_runner, language="python", code=ALLOCATE, limits=MEMORY)
    assert other["status"] == "ok", other


def test_inodes_are_bounded_and_a_full_workspace_stays_usable(session: SessionClient) -> None:
    """Files past the inode count get ENOSPC (``disk_limit``, never a 500); the full
    workspace can then be listed, checkpointed, restored and cleaned by a job."""
    many = (
        "import errno\nn = 0\ntry:\n"
        "    while True:\n        open(f'f{n}', 'w').close(); n += 1\n"
        "except OSError as exc:\n    print(n, errno.errorcode[exc.errno]); raise\n"
    )
    result = session.execute(many)
    assert result["status"] == "disk_limit", result
    count, code = result["stdout"].split()
    assert code == "ENOSPC", result
    assert 1000 < int(count) <= 2000, result
    listing = session.http.get("/v1/session/files/")
    assert listing.status_code == 200, listing.text
    assert len(listing.json()["entries"]) >= 1000
    archive = session.checkpoint()
    restored = session.restore(archive)
    assert restored.status_code == 200, restored.text
    assert session.execute("import os\nprint(len(os.listdir('.')))")["stdout"] == f"{count}\n"
    cleaned = session.execute("rm -rf -- ./* && ls | wc -l", language="bash")
    assert (cleaned["status"], cleaned["stdout"]) == ("ok", "0\n"), cleaned
    assert session.execute("open('again', 'w').write('x')")["status"] == "ok"
