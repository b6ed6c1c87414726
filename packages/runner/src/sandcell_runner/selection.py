"""Which workspace paths a checkpoint keeps: ``include`` / ``exclude`` globs.

Globs are relative POSIX patterns: ``*`` and ``?`` stay within one path component,
``**`` spans any number of them (``src/**/*.py``, ``**/node_modules``). A file or
symlink is kept when it matches an include and no exclude; a directory is walked
unless an exclude matches it (so ``**/node_modules`` prunes whole trees).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from .errors import BadRequestError

MAX_PATTERNS = 64
MAX_PATTERN_CHARS = 256


def _compile(pattern: str) -> re.Pattern[str]:
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


@dataclass(frozen=True, slots=True)
class WorkspaceSelection:
    """Compiled include/exclude globs; ``everything()`` keeps the whole workspace."""

    include: tuple[re.Pattern[str], ...]
    exclude: tuple[re.Pattern[str], ...]

    @classmethod
    def everything(cls) -> WorkspaceSelection:
        return cls((), ())

    @classmethod
    def parse(cls, include: Sequence[str], exclude: Sequence[str]) -> WorkspaceSelection:
        """Validate and compile; ``BadRequestError`` names the offending pattern."""
        if len(include) + len(exclude) > MAX_PATTERNS:
            raise BadRequestError(f"at most {MAX_PATTERNS} include/exclude patterns")
        for pattern in (*include, *exclude):
            if not pattern or len(pattern) > MAX_PATTERN_CHARS or "\x00" in pattern:
                raise BadRequestError(f"invalid pattern {pattern[:64]!r}")
            if pattern.startswith("/") or ".." in pattern.split("/"):
                raise BadRequestError(f"patterns are relative, without '..': {pattern[:64]!r}")
        include = [p for p in include if p not in ("**", "**/*")]
        return cls(tuple(map(_compile, include)), tuple(map(_compile, exclude)))

    @property
    def selects_all(self) -> bool:
        return not self.include and not self.exclude

    def keeps(self, relpath: str, *, is_dir: bool) -> bool:
        """Whether ``relpath`` goes into the checkpoint (a directory: whether to walk it)."""
        if any(p.fullmatch(relpath) for p in self.exclude):
            return False
        if is_dir or not self.include:
            return True
        return any(p.fullmatch(relpath) for p in self.include)
