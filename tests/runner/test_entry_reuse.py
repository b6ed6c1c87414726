"""A reused job directory's entry file keeps its inode from job to job.

``recycle_job_dir`` empties a finished job's directory but for one regular file (mode 0);
``write_entry`` writes the next job's entry over it (renamed when the language names
its entry otherwise) and cuts it to its length, instead of unlinking and creating a
file, whose inode search is what costs on ext4 without a journal. Each check holds the kept
file open: the same inode then shows the new bytes through that descriptor, where a
file made anew (even one the filesystem gave the same inode number) would not.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandcell_runner.workspace.entry import recycle_job_dir, write_entry
from tests.fixtures.paths import traversable_dir


@pytest.fixture
def job_dir() -> Iterator[Path]:
    with traversable_dir("entry-") as base:
        path = base / "job"
        path.mkdir()
        yield path


def _finished_job(job_dir: Path, name: str, code: bytes) -> int:
    """A job's entry as the runner writes it, its directory recycled for the next job;
    a descriptor held on its inode."""
    write_entry(job_dir, name, code, mode=0o444)
    held = os.open(job_dir / name, os.O_RDONLY)
    recycle_job_dir(job_dir)
    return held


def test_the_next_job_of_the_same_language_writes_over_the_kept_inode(job_dir: Path) -> None:
    held = _finished_job(job_dir, "main.sh", b"echo a long first job's code")
    try:
        assert os.listdir(job_dir) == ["main.sh"]
        # Kept, the last job's code is root's alone until the next job's replaces it.
        assert stat.S_IMODE(os.stat(job_dir / "main.sh").st_mode) == 0

        write_entry(job_dir, "main.sh", b"true", mode=0o444)

        # The same inode, reused, not made anew; and nothing of the longer first code.
        assert os.pread(held, 100, 0) == b"true"
        st = os.stat(job_dir / "main.sh")
        assert st.st_ino == os.fstat(held).st_ino
        assert stat.S_IMODE(st.st_mode) == 0o444
        assert (job_dir / "main.sh").read_bytes() == b"true"
    finally:
        os.close(held)


def test_another_language_renames_the_kept_file_and_sees_only_its_entry(job_dir: Path) -> None:
    held = _finished_job(job_dir, "main.py", b"print('first')")
    try:
        write_entry(job_dir, "main.sh", b"echo second", mode=0o444)

        assert os.listdir(job_dir) == ["main.sh"]
        assert os.pread(held, 100, 0) == b"echo second"
        assert (job_dir / "main.sh").read_bytes() == b"echo second"
    finally:
        os.close(held)


def test_recycling_keeps_one_file_and_removes_everything_else(job_dir: Path) -> None:
    write_entry(job_dir, "main.sh", b"true", mode=0o444)
    (job_dir / "other").write_bytes(b"x")
    (job_dir / "sub").mkdir()
    (job_dir / "sub" / "deep").write_bytes(b"y")
    (job_dir / "link").symlink_to("/etc/hostname")

    recycle_job_dir(job_dir)

    left = os.listdir(job_dir)
    assert len(left) == 1
    assert left[0] in ("main.sh", "other")
    write_entry(job_dir, "main.py", b"pass", mode=0o444)
    assert os.listdir(job_dir) == ["main.py"]
    assert (job_dir / "main.py").read_bytes() == b"pass"


@pytest.mark.parametrize("what", ["symlink", "directory", "two files"])
def test_what_recycling_did_not_keep_is_replaced_not_followed(
    job_dir: Path, tmp_path: Path, what: str
) -> None:
    target = tmp_path / "outside"
    target.write_bytes(b"untouched")
    if what == "symlink":
        (job_dir / "main.sh").symlink_to(target)
    elif what == "directory":
        (job_dir / "main.sh").mkdir()
        (job_dir / "main.sh" / "inner").write_bytes(b"x")
    else:
        (job_dir / "a").write_bytes(b"a")
        (job_dir / "b").write_bytes(b"b")

    write_entry(job_dir, "main.sh", b"true", mode=0o444)

    assert os.listdir(job_dir) == ["main.sh"]
    assert (job_dir / "main.sh").is_file()
    assert not (job_dir / "main.sh").is_symlink()
    assert (job_dir / "main.sh").read_bytes() == b"true"
    assert target.read_bytes() == b"untouched"
