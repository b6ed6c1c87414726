"""What an extraction costs grows with the archive, not with its depth squared.

Run in this process (``extract`` itself, no child or chroot) so that the system
calls it makes can be counted: no timing.
"""

from __future__ import annotations

import os
import tarfile
from pathlib import Path

import pytest

from sandcell_runner.checkpoint.export import ArchiveLimits
from sandcell_runner.checkpoint.extractor import extract
from tests.runner.checkpoint import archive, compress, member

DEPTH = 300  # under the recursion limit, so that pytest's cleanup removes the tree


def _source(data: bytes) -> object:
    position = 0

    def read(size: int) -> bytes:
        nonlocal position
        chunk = data[position : position + size]
        position += len(chunk)
        return chunk

    return read


def test_nested_directories_are_extracted_without_resolving_their_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tree in the exporter's order, DEPTH directories deep: no path is resolved.

    tarfile's data filter ran ``os.path.realpath`` on every member's name: an
    ``lstat`` of each of its prefixes, ~DEPTH²/2 of them in all here (minutes of the
    extractor's CPU for a 50 KB archive of 2,000 nested directories).
    """
    limits = ArchiveLimits()
    names = ["workspace/" + "/".join(["d"] * level) for level in range(1, DEPTH + 1)]
    data = archive(
        member("workspace", type_=tarfile.DIRTYPE, mode=0o755),
        *(member(name, type_=tarfile.DIRTYPE, mode=0o755) for name in names),
        member(names[-1] + "/f", b"deep"),
    )
    staging = tmp_path / "staging"
    staging.mkdir()
    monkeypatch.chdir(staging)
    lstats = 0
    real_lstat = os.lstat

    def counting_lstat(*args: object, **kwargs: object) -> os.stat_result:
        nonlocal lstats
        lstats += 1
        return real_lstat(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "lstat", counting_lstat)
    fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY)
    try:
        extract(
            _source(compress(data, "gzip")),  # type: ignore[arg-type]
            fd,
            encoding="gzip",
            max_bytes=limits.max_bytes,
            max_members=limits.max_members,
        )
    finally:
        os.close(fd)
    monkeypatch.undo()
    assert lstats <= DEPTH, lstats
    assert (staging / Path(*names[-1].split("/")[1:]) / "f").read_bytes() == b"deep"
