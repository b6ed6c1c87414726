"""A tree nested deeper than Python's recursion limit is removed like any other.

A job can nest 2,000 directories in its workspace (a restored checkpoint may hold as
many: paths reach 4 KiB). Where the workspace is a plain directory (no image pool, no
tmpfs: a runner that cannot mount), its removal was ``shutil.rmtree``, which recurses
once per level: ``RecursionError``, which no caller's ``OSError`` handling caught, so a
session's release or a rejected restore's cleanup failed with a 500.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandcell_runner.workspace.manager import WorkspaceManager
from tests.fixtures.paths import traversable_dir

DEPTH = 2040  # "d/" per level: the deepest a 4 KiB path goes


@pytest.fixture
def manager() -> Iterator[WorkspaceManager]:
    with traversable_dir("deeptree-") as base:
        workspaces = WorkspaceManager(base / "root", quota_bytes=16 << 20)
        workspaces.prepare()
        yield workspaces


def _deep_tree(path: Path) -> None:
    """``path`` with DEPTH nested directories, a file and a symlink at the bottom."""
    path.mkdir()
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(DEPTH):
            os.mkdir("d", dir_fd=fd)
            child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
        os.close(os.open("f", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd))
        os.symlink("/etc", "l", dir_fd=fd)
    finally:
        os.close(fd)


def test_the_tree_is_deeper_than_the_recursion_limit() -> None:
    assert sys.getrecursionlimit() < DEPTH


@pytest.mark.parametrize("how", ["remove_workspace", "remove_dir", "reap"])
def test_a_deep_tree_is_removed(manager: WorkspaceManager, how: str) -> None:
    path = manager.session / "ws-1"
    _deep_tree(path)
    if how == "remove_workspace":
        manager.remove_workspace(path)
    elif how == "remove_dir":
        manager.remove_dir(path)
    else:
        assert manager.reap(older_than_s=-1, keep=set()) == [path]
    assert not path.exists()
    assert os.path.isdir("/etc")


def test_a_workspace_that_is_a_symlink_is_unlinked_not_followed(
    manager: WorkspaceManager, tmp_path: Path
) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep").write_text("kept")
    path = manager.session / "ws-2"
    path.symlink_to(target)
    manager.remove_workspace(path)
    assert not path.is_symlink()
    assert (target / "keep").read_text() == "kept"
