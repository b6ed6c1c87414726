"""The work a runner does after a job is bounded and attributed (issue 14, item 3).

Real runners under nsjail over HTTP. Output files are hashed within a per-turn
budget (``SANDCELL_RUNNER_OUTPUT_SCAN_BYTES``; past it they are listed unhashed
and the result says so), holes of sparse files are not read, scanning cannot
starve another session's request, and the runner's own CPU for a turn is
reported in ``runner_cpu_ms``.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fixtures.paths import traversable_dir
from tests.fixtures.runner_process import RunnerProcess, running_runner
from tests.runner.helpers import execute

MIB = 1 << 20
SMALL_BUDGET = 2 * MIB + MIB // 2  # two 1 MiB files fit, a third does not; 2,560 entries
SESSION = "rt_" + "c" * 64


@pytest.fixture(scope="module")
def small() -> Iterator[RunnerProcess]:
    """A session-enabled runner with a 2.5 MiB output-scan budget."""
    with (
        traversable_dir() as root,
        running_runner(
            root,
            env={
                "SANDCELL_RUNNER_SESSIONS": "1",
                "SANDCELL_RUNNER_OUTPUT_SCAN_BYTES": str(SMALL_BUDGET),
            },
        ) as process,
    ):
        yield process


@pytest.fixture(scope="module")
def large() -> Iterator[RunnerProcess]:
    """A runner whose budget lets it hash gigabytes: the scanning is long on purpose."""
    with (
        traversable_dir() as root,
        running_runner(root, env={"SANDCELL_RUNNER_OUTPUT_SCAN_BYTES": str(8 << 30)}) as process,
    ):
        yield process


def _session_execute(runner: RunnerProcess, code: str) -> dict[str, Any]:
    response = httpx.post(
        runner.url + "/v1/execute",
        json={"language": "bash", "code": code},
        headers=runner.headers(**{"X-Runtime-Session-Id": SESSION}),
        timeout=120,
    )
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def test_eight_sparse_gigabytes_are_listed_not_hashed(small: RunnerProcess) -> None:
    """8x ``truncate -s 1G``: each file is past the budget, so listed with no hash and
    no content, the turn says its budget ran out, and nothing was hashed."""
    result = execute(
        small, language="bash", code="for i in 1 2 3 4 5 6 7 8; do truncate -s 1G f$i; done"
    )
    assert result["status"] == "ok"
    assert sorted(f["name"] for f in result["files"]) == [f"f{i}" for i in range(1, 9)]
    assert all(f["size"] == 1 << 30 for f in result["files"])
    assert all(f["sha256"] is None and f["content_b64"] is None for f in result["files"])
    assert result["output_scan_exhausted"] is True
    assert result["output_scan_bytes"] == 0


def test_files_are_hashed_while_they_fit_and_offered_again_later(small: RunnerProcess) -> None:
    """Three 1 MiB files, 2.5 MiB of budget: two hashed, one listed unhashed; a later
    turn that writes nothing hashes the third (it was never remembered as seen)."""
    first = _session_execute(small, "for f in a b c; do head -c 1048576 /dev/zero > $f; done")
    assert first["output_scan_exhausted"] is True
    assert first["output_scan_bytes"] == 2 * MIB
    hashed = [f for f in first["files"] if f["sha256"] is not None]
    unhashed = [f for f in first["files"] if f["sha256"] is None]
    assert len(hashed) == 2
    assert len(unhashed) == 1
    assert all(f["sha256"] == hashlib.sha256(bytes(MIB)).hexdigest() for f in hashed)
    second = _session_execute(small, "true")
    assert [f["name"] for f in second["files"]] == [unhashed[0]["name"]]
    assert second["files"][0]["sha256"] == hashlib.sha256(bytes(MIB)).hexdigest()
    assert second["output_scan_bytes"] == MIB
    assert second["output_scan_exhausted"] is False


def test_the_walk_is_bounded_by_the_budget_too(small: RunnerProcess) -> None:
    """5,000 empty files against a budget worth 2,560 entries: the walk stops, the turn
    says so, and at most that many are listed."""
    result = execute(small, language="bash", code="mkdir d; cd d; touch $(seq 5000)")
    assert result["status"] == "ok"
    assert result["output_scan_exhausted"] is True
    assert 0 < len(result["files"]) <= 1000  # SANDCELL_RUNNER_MAX_OUTPUT_FILES
    assert result["output_scan_bytes"] == 0


def _rchar(pid: int) -> int:
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/<pid>/io")


def test_holes_are_hashed_but_never_read(large: RunnerProcess) -> None:
    """A 64 MiB file with 4 KiB of data at each end: the digest is the whole file's,
    and the runner read (rchar) far less than the file's size."""
    code = (
        "f = open('sparse', 'wb'); f.write(b'a' * 4096)\n"
        "f.seek((64 << 20) - 4096); f.write(b'z' * 4096); f.close()"
    )
    before = _rchar(large.process.pid)
    result = execute(large, language="python", code=code)
    read = _rchar(large.process.pid) - before
    (item,) = result["files"]
    expected = hashlib.sha256(b"a" * 4096 + bytes((64 << 20) - 8192) + b"z" * 4096)
    assert item["sha256"] == expected.hexdigest()
    assert result["output_scan_bytes"] == 64 << 20
    assert read < 16 * MIB, read
    assert result["runner_cpu_ms"] > 0


def test_scanning_never_starves_another_sessions_request(large: RunnerProcess) -> None:
    """Eight turns each leave a 768 MiB sparse file to hash (seconds of work in all,
    more turns than the default executor has threads); a trivial job sent while they
    scan finishes before any of them does."""
    done: list[tuple[str, float]] = []
    scanned: list[int] = []
    lock = threading.Lock()

    def scanning_turn() -> None:
        result = execute(large, language="bash", code="truncate -s 768M big", timeout_s=300)
        with lock:
            done.append(("scan", time.monotonic()))
            scanned.append(result.get("output_scan_bytes", 0))

    threads = [threading.Thread(target=scanning_turn) for _ in range(8)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)  # the eight jobs ran (a truncate) and their outputs are being hashed
    trivial = execute(large, language="sh", code="echo quick")
    with lock:
        finished_before = list(done)
        done.append(("trivial", time.monotonic()))
    for thread in threads:
        thread.join(timeout=300)
    assert trivial["stdout"] == "quick\n"
    assert finished_before == [], "a scanning turn finished before the trivial job"
    assert scanned == [768 * MIB] * 8


def test_a_stderr_flood_is_drained_and_paid_for(small: RunnerProcess) -> None:
    """Past its cap stderr is discarded in the kernel; the runner's time is reported."""
    code = (
        "import sys, time\nt = time.time()\n"
        "while time.time() - t < 1: sys.stderr.write('e' * 65536)"
    )
    result = execute(small, language="python", code=code, limits={"stderr_bytes": 1000})
    assert result["status"] == "ok"
    assert result["stderr"] == "e" * 1000
    assert result["stderr_truncated"] is True
    assert result["runner_cpu_ms"] > 0
