"""``untouched`` finds every leftover by itself, not from the timestamps alone.

A kernel without multigrain timestamps stamps a change with the clock tick, so a job
that changes its workspace in the tick of the hand-out leaves mtime and ctime as they
were. Each case here makes its change, then judges it against the hand-out snapshot
with the times the directory has now: as if the clock had not moved. Only the listing,
mode, link count, xattrs and flags can tell then. (Through real jobs, with real times:
``test_kept_workspace.py``.)
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sandcell_runner.workspace.untouched import Snapshot, snapshot, untouched
from tests.fixtures.paths import traversable_dir


def _chattr_nodump(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        flags = int.from_bytes(fcntl.ioctl(fd, 0x80086601, bytes(8))[:4], "little")
        fcntl.ioctl(fd, 0x40086602, (flags | 0x40).to_bytes(4, "little"))
    finally:
        os.close(fd)


def _bind_socket(path: Path) -> None:
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path / "sock"))


def _hard_link(path: Path) -> None:
    (path / "a").write_bytes(b"x")
    os.link(path / "a", path / "b")
    os.unlink(path / "a")


CHANGES: dict[str, Callable[[Path], None]] = {
    "a file": lambda p: (p / "out.txt").write_bytes(b"left"),
    "a hidden file": lambda p: (p / ".hidden").write_bytes(b"left"),
    "an empty subdirectory": lambda p: (p / "sub").mkdir(),
    "a hard link": _hard_link,
    "a fifo": lambda p: os.mkfifo(p / "fifo"),
    "a socket": _bind_socket,
    "a symlink": lambda p: (p / "link").symlink_to("/etc/passwd"),
    "a chmod": lambda p: os.chmod(p, 0o755),
    "a chown": lambda p: os.chown(p, 20_996, 20_996),
    "an xattr": lambda p: os.setxattr(p, "user.left", b"by the job"),
    "a chattr flag": _chattr_nodump,
}


@pytest.fixture
def workspace() -> Iterator[Path]:
    # /var/tmp: a disk filesystem (ext4 here, as the images are), with user xattrs.
    with traversable_dir("untouched-") as base:
        path = base / "ws"
        path.mkdir(mode=0o700)
        os.chown(path, 20_995, 20_995)
        yield path


def _in_one_tick(handed: Snapshot, path: Path) -> Snapshot:
    """``handed`` with the times ``path`` has now (``Snapshot.identity`` ends in mtime)."""
    st = os.stat(path, follow_symlinks=False)
    identity = (*handed.identity[:-1], st.st_mtime_ns)
    return dataclasses.replace(handed, identity=identity, ctime_ns=st.st_ctime_ns)


def test_an_untouched_directory_is_untouched(workspace: Path) -> None:
    handed = snapshot(workspace)
    os.listdir(workspace)
    assert untouched(workspace, handed)
    assert untouched(workspace, _in_one_tick(handed, workspace))


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_change_is_found_with_the_times_unmoved(workspace: Path, change: str) -> None:
    handed = snapshot(workspace)
    CHANGES[change](workspace)
    assert not untouched(workspace, handed)  # the times moved
    assert not untouched(workspace, _in_one_tick(handed, workspace))


def test_a_directory_gone_is_not_untouched(workspace: Path) -> None:
    handed = snapshot(workspace)
    workspace.rmdir()
    assert not untouched(workspace, handed)  # False, never an error
