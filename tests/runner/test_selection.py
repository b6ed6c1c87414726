"""PersistentWorkspace globs: which workspace paths a checkpoint keeps."""

from __future__ import annotations

import pytest

from sandcell_runner.errors import BadRequestError
from sandcell_runner.selection import WorkspaceSelection


@pytest.mark.parametrize(
    ("include", "exclude", "path", "is_dir", "kept"),
    [
        ((), (), "anything/at/all.txt", False, True),
        (("**",), (), "a/b.txt", False, True),
        (("src/**/*.py",), (), "src/pkg/mod.py", False, True),
        (("src/**/*.py",), (), "src/mod.py", False, True),
        (("src/**/*.py",), (), "src/pkg/data.csv", False, False),
        (("src/**/*.py",), (), "docs", True, True),
        ((), ("**/node_modules",), "app/node_modules", True, False),
        ((), ("**/node_modules",), "node_modules", True, False),
        ((), ("*.log",), "run.log", False, False),
        ((), ("*.log",), "logs/run.log", False, True),
        (("*.txt",), ("secret.txt",), "secret.txt", False, False),
        (("?.txt",), (), "a.txt", False, True),
        (("?.txt",), (), "ab.txt", False, False),
    ],
)
def test_keeps(
    include: tuple[str, ...], exclude: tuple[str, ...], path: str, is_dir: bool, kept: bool
) -> None:
    assert WorkspaceSelection.parse(include, exclude).keeps(path, is_dir=is_dir) is kept


@pytest.mark.parametrize("pattern", ["", "/etc/*", "../x", "a/../b", "x" * 300, "a\x00b"])
def test_bad_patterns_rejected(pattern: str) -> None:
    with pytest.raises(BadRequestError):
        WorkspaceSelection.parse([pattern], [])


def test_everything_selects_all() -> None:
    assert WorkspaceSelection.parse(["**"], []).selects_all
    assert not WorkspaceSelection.parse([], ["*.log"]).selects_all
