"""PersistentWorkspace globs: which workspace paths a checkpoint keeps."""

from __future__ import annotations

import re

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from sandcell_runner.checkpoint.selection import MAX_PATTERN_CHARS, MAX_PATTERNS, WorkspaceSelection
from sandcell_runner.errors import BadRequestError


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
        (("src/**",), (), "src/a/b.py", False, True),
        (("src/**",), (), "src", False, False),
        (("**.py",), (), "a/b/c.py", False, True),
        (("a**b",), (), "a/x/b", False, True),
        (("[ab].txt",), (), "[ab].txt", False, True),
        (("[ab].txt",), (), "a.txt", False, False),
        (("*.txt", "*.md"), ("b*",), "a.md", False, True),
        (("*.txt", "*.md"), ("b*",), "b.md", False, False),
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


def test_too_many_patterns_rejected() -> None:
    with pytest.raises(BadRequestError):
        WorkspaceSelection.parse(["a"] * MAX_PATTERNS, ["b"])


def test_everything_selects_all() -> None:
    assert WorkspaceSelection.parse(["**"], []).selects_all
    assert WorkspaceSelection.everything().selects_all
    assert WorkspaceSelection.everything().keeps("a/b", is_dir=False)
    assert not WorkspaceSelection.parse([], ["*.log"]).selects_all


def _regex_glob(pattern: str) -> re.Pattern[str]:
    """The translation the matcher replaced, kept as the reference for its meaning."""
    out = []
    index = 0
    while index < len(pattern):
        if pattern.startswith("**/", index):
            out.append("(?:.*/)?")
            index += 3
        elif pattern.startswith("**", index):
            out.append(".*")
            index += 2
        elif pattern[index] == "*":
            out.append("[^/]*")
            index += 1
        elif pattern[index] == "?":
            out.append("[^/]")
            index += 1
        else:
            out.append(re.escape(pattern[index]))
            index += 1
    return re.compile("".join(out))


_pattern = st.text(alphabet="ab/*?", min_size=1, max_size=10).filter(
    lambda p: not p.startswith("/")
)


@given(
    patterns=st.lists(_pattern, min_size=1, max_size=3),
    path=st.text(alphabet="ab/*?", max_size=12),
)
@example(patterns=["**/*"], path="a/b")
@example(patterns=["a**/b"], path="ab")
@example(patterns=["a**/b"], path="a/")
@example(patterns=["*/**/"], path="a//")
@example(patterns=["***/a"], path="b/a")
@example(patterns=["?**/**/?"], path="a/b")
def test_matches_like_the_regex_translation(patterns: list[str], path: str) -> None:
    """Any pattern set and path (well-formed or not): same answer as the old regexes."""
    expected = any(_regex_glob(p).fullmatch(path) for p in patterns)
    # Through exclude: include drops '**' and '**/*' as "everything".
    assert WorkspaceSelection.parse([], patterns).keeps(path, is_dir=True) is not expected


@pytest.mark.parametrize(
    ("pattern", "path", "matched"),
    [
        ("*a" * 30 + "b", "a" * 250, False),
        ("*a" * 30 + "b", "a" * 250 + "b", True),
        ("**a" * 30 + "b", "/".join(["a" * 200] * 20), False),
        ("**a" * 30 + "b", "/".join(["a" * 200] * 20) + "b", True),
        ("**/a" * 40 + "/b", "/".join(["a"] * 1000), False),
        ("**/a" * 40 + "/b", "/".join(["a"] * 1000 + ["b"]), True),
    ],
    ids=["stars-miss", "stars-hit", "dstars-miss", "dstars-hit", "subdirs-miss", "subdirs-hit"],
)
def test_pathological_patterns_answer(pattern: str, path: str, matched: bool) -> None:
    """Patterns that make a backtracking regex run (practically) forever still answer."""
    selection = WorkspaceSelection.parse([], [pattern] * MAX_PATTERNS)
    assert selection.keeps(path, is_dir=True) is not matched


def test_longest_patterns_compile_and_match() -> None:
    pattern = ("*?" * MAX_PATTERN_CHARS)[:MAX_PATTERN_CHARS]
    selection = WorkspaceSelection.parse([pattern] * (MAX_PATTERNS - 1), ["**/x"])
    assert selection.keeps("a" * (MAX_PATTERN_CHARS // 2), is_dir=False)
    assert not selection.keeps("a" * (MAX_PATTERN_CHARS // 2 - 1), is_dir=False)


def test_double_star_crosses_newlines() -> None:
    """A newline in a name cannot slip past '**' (a regex '.*' stops at one)."""
    selection = WorkspaceSelection.parse([], ["**/secret", "logs/**"])
    assert not selection.keeps("a\nb/secret", is_dir=False)
    assert not selection.keeps("logs/x\ny/z", is_dir=False)
    assert selection.keeps("a\nb", is_dir=False)
