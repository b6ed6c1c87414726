"""``WorkspaceFs``: sandbox filesystem calls never follow a planted link or leave the workspace.

Run directly on a real directory (the calls are blocking functions the route runs
in a thread); the golden sandbox paths are the protocol's.
"""

from __future__ import annotations

import os
import tracemalloc
from pathlib import Path

import pytest

from sandcell_protocol import sandbox_messages as sm
from sandcell_runner.errors import BadRequestError, InvalidPathError, NotFoundError
from sandcell_runner.sandbox.fs import WorkspaceFs, run_fs
from tests.golden import load_golden

GOLDEN = load_golden()["sandbox_path"]


@pytest.fixture
def fs(tmp_path: Path) -> WorkspaceFs:
    root = tmp_path / "ws"
    root.mkdir()
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.txt").write_text("host secret")
    return WorkspaceFs(root, uid=os.getuid(), max_entries=50)


@pytest.mark.parametrize("raw", [r for r in GOLDEN["rejected"] if r])
def test_paths_outside_home_are_refused(fs: WorkspaceFs, raw: str) -> None:
    with pytest.raises(InvalidPathError):
        fs.stat(raw)


def test_a_planted_link_is_reported_never_followed(fs: WorkspaceFs, tmp_path: Path) -> None:
    """A link in the workspace, and a link as a parent directory, to outside it."""
    os.symlink(tmp_path / "outside", fs.root / "out")
    os.symlink(tmp_path / "outside" / "secret.txt", fs.root / "leak")
    entry = fs.stat("/home/user/leak").entry
    assert entry is not None
    assert entry.type == "symlink"
    assert entry.symlink_target == str(tmp_path / "outside" / "secret.txt")
    with pytest.raises(NotFoundError):
        fs.stat("out/secret.txt")
    with pytest.raises(InvalidPathError):
        fs.make_dir("out/new")
    with pytest.raises(NotFoundError):
        fs.remove("out/secret.txt")
    with pytest.raises((InvalidPathError, NotFoundError)):
        fs.move("out/secret.txt", "stolen.txt")
    with pytest.raises((InvalidPathError, NotFoundError)):
        fs.move("leak", "out/moved")
    listed = fs.list_dir("/home/user", depth=5).entries or []
    assert {e.path for e in listed} == {"/home/user/out", "/home/user/leak"}
    assert (tmp_path / "outside" / "secret.txt").read_text() == "host secret"
    assert not (tmp_path / "outside" / "new").exists()


def test_make_dir_move_remove_and_depth(fs: WorkspaceFs) -> None:
    assert fs.make_dir("a/b/c").created is True
    assert fs.make_dir("/home/user/a/b/c").created is False
    (fs.root / "a" / "f.txt").write_text("x")
    with pytest.raises(BadRequestError):
        fs.make_dir("a/f.txt")
    names = {e.path for e in fs.list_dir("a", depth=1).entries or []}
    assert names == {"/home/user/a/b", "/home/user/a/f.txt"}
    deep = {e.path for e in fs.list_dir("a", depth=3).entries or []}
    assert "/home/user/a/b/c" in deep
    with pytest.raises(BadRequestError):
        fs.move("a", "a/b/inside")
    moved = fs.move("a/f.txt", "z/y/g.txt").entry
    assert moved is not None
    assert moved.path == "/home/user/z/y/g.txt"
    fs.remove("a")
    with pytest.raises(NotFoundError):
        fs.remove("a")
    with pytest.raises(BadRequestError):
        fs.remove("/home/user")


def test_listings_are_bounded(fs: WorkspaceFs) -> None:
    for index in range(60):
        (fs.root / f"f{index}").write_text("")
    with pytest.raises(BadRequestError):
        run_fs(fs, sm.FsSnapshot(path="~", recursive=True))


def _breadth_first(root: Path, depth: int) -> list[str]:
    """The listing's order, independently: each directory's names sorted, breadth first."""
    found: list[str] = []
    queue: list[tuple[Path, str, int]] = [(root, "", 1)]
    while queue:
        here, prefix, level = queue.pop(0)
        for name in sorted(os.listdir(here)):
            relative = f"{prefix}{name}"
            found.append(relative)
            if (here / name).is_dir() and not (here / name).is_symlink() and level < depth:
                queue.append((here / name, relative + "/", level + 1))
    return found


def _tree(root: Path) -> None:
    for top in ("b", "a", "c"):
        (root / top).mkdir()
        for index in (3, 1, 2, 10):
            (root / top / f"f{index}").write_text("x")
    (root / "a" / "deep").mkdir()
    (root / "a" / "deep" / "z").write_text("")
    (root / "m.txt").write_text("")
    os.symlink("a", root / "link")


def test_a_listing_is_each_directory_sorted_breadth_first(fs: WorkspaceFs) -> None:
    """The order and the entries are the same as a full sort of each directory gives."""
    _tree(fs.root)
    for depth in (1, 2, 3):
        listed = run_fs(fs, sm.FsListDir(path="~", depth=depth)).entries or []
        assert [e.path.removeprefix("/home/user/") for e in listed] == _breadth_first(
            fs.root, depth
        )
    snapshot = run_fs(fs, sm.FsSnapshot(path="~", recursive=True)).entries or []
    assert [e.path.removeprefix("/home/user/") for e in snapshot] == _breadth_first(fs.root, 64)


def test_the_cap_is_exact_across_the_tree(fs: WorkspaceFs) -> None:
    """``max_entries`` (50) entries across directories list; one more is the error."""
    for top in ("x", "y"):
        (fs.root / top).mkdir()
        for index in range(24):
            (fs.root / top / f"f{index:02}").write_text("")
    listed = run_fs(fs, sm.FsListDir(path="~", depth=2)).entries or []
    assert len(listed) == 50
    assert [e.path.removeprefix("/home/user/") for e in listed] == _breadth_first(fs.root, 2)
    (fs.root / "y" / "one-more").write_text("")
    with pytest.raises(BadRequestError, match="more than 50 entries"):
        run_fs(fs, sm.FsListDir(path="~", depth=2))
    # Within the first level alone it is still under the cap.
    assert len(run_fs(fs, sm.FsListDir(path="~", depth=1)).entries or []) == 2


def test_a_huge_directory_is_not_read_whole_before_the_cap(fs: WorkspaceFs) -> None:
    """40,000 names and a cap of 50: the listing fails at the 51st name, holding about
    that many (Python's own allocations, traced), not the whole sorted directory (the
    old code's peak here was several MB: every ``DirEntry`` at once)."""
    big = fs.root / "big"
    big.mkdir()
    for index in range(40_000):
        (big / f"{index:05}").touch()
    tracemalloc.start()
    try:
        with pytest.raises(BadRequestError, match="more than 50 entries"):
            run_fs(fs, sm.FsListDir(path="~/big", depth=1))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak
