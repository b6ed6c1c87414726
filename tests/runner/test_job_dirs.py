"""One-shot jobs reuse the runner's emptied job directories, and never see another job's."""

from __future__ import annotations

import time

from tests.fixtures.runner_process import RunnerProcess
from tests.runner.helpers import execute

PYTHON = "import os\nprint(*sorted(os.listdir('/mnt/job')), open(__file__).read().count(chr(35)))"
BASH = "echo $(ls /mnt/job) $(tr -cd '\\043' < \"$0\" | wc -c)"


def _job_bases(runner: RunnerProcess) -> set[str]:
    return {path.name for path in (runner.workspace_root / "jobs").iterdir()}


def _settled_bases(runner: RunnerProcess, count: int) -> set[str]:
    """The ``jobs/<id>`` entries once removals after the answers are done (or after 10 s)."""
    deadline = time.monotonic() + 10
    while len(bases := _job_bases(runner)) > count and time.monotonic() < deadline:
        time.sleep(0.02)
    return bases


def test_sequential_jobs_reuse_one_job_directory_and_see_only_their_own_entry(
    runner: RunnerProcess,
) -> None:
    """Ten jobs one after another, python and bash in turn (their entry files have other
    names), run in the same emptied ``jobs/<id>``: each finds in its read-only job
    directory exactly one file, its own, and nothing of the job before."""
    _settled_bases(runner, 1)
    seen = []
    for turn in range(10):
        language, code = ("python", PYTHON) if turn % 2 == 0 else ("bash", BASH)
        marked = code + "\n" + "#" * (turn + 1)  # each entry file differs
        result = execute(runner, language=language, code=marked)
        assert result["status"] == "ok", result
        seen.append(result["stdout"].split())
        bases = _settled_bases(runner, 1)
    assert all(len(words) == 2 for words in seen), seen  # one entry file, and its count
    assert [int(words[-1]) for words in seen] == list(range(1, 11))  # its own file
    assert len(bases) == 1, bases
