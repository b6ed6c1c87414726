"""Which workspace paths a checkpoint keeps: ``include`` / ``exclude`` globs.

Globs are relative POSIX patterns: ``*`` and ``?`` stay within one path component,
``**`` spans any number of them (``src/**/*.py``, ``**/node_modules``). A file or
symlink is kept when it matches an include and no exclude; a directory is walked
unless an exclude matches it (so ``**/node_modules`` prunes whole trees).

In detail, a glob matches a whole relative path, and:

- ``**/`` matches nothing or any run of characters ending in ``/``, so at the
  start or after a ``/`` it is zero or more whole components: ``**/x`` matches
  ``x`` and ``a/b/x``; ``src/**/*.py`` matches ``src/m.py`` and ``src/p/m.py``;
- any other ``**`` matches any run of characters, slashes included: ``src/**``
  matches everything below ``src`` but not ``src`` itself, ``**.py`` is ``*.py``
  at any depth and ``a**b`` matches ``ab`` and ``a/x/b``;
- ``*`` matches any run of characters but ``/``, ``?`` one character but ``/``;
- every other character, ``[`` included, matches only itself.

A pattern is read left to right, the longest token first: ``***/x`` is ``**``
then ``*/x`` (so it does not match ``x``), as the earlier regex translation read it.

``**`` matches newlines like any other character (a backtracking ``.*`` would
not, letting a name with a newline slip past ``**/secret``).

Patterns come from the caller and file names from the sandbox, and matching
runs under the session lock, so globs are not turned into backtracking regexes
(``*a*a*a*b`` against a long name of ``a`` s takes exponential time there).
The include (and the exclude) patterns form one NFA whose set of live states
is an integer bit mask, stepped once per character of the path: a match costs
O(len(path)) integer operations on masks of one bit per pattern character,
whatever the patterns look like.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ..errors import BadRequestError

MAX_PATTERNS = 64
MAX_PATTERN_CHARS = 256

# One NFA state per token; state ``i`` is "about to match token i", and a pattern
# of n tokens has one more state, n, that accepts.
_LITERAL = 0  # one given character
_ONE = 1  # ``?``
_STAR = 2  # ``*``: stays on any character but '/', may leave without consuming
_DSTAR = 3  # ``**``: stays on any character, may leave without consuming
_SUBDIRS = 4  # ``**/``: stays on any character, leaves on '/', or skips itself


def _tokens(pattern: str) -> list[tuple[int, str]]:
    tokens: list[tuple[int, str]] = []
    index = 0
    while index < len(pattern):
        if pattern.startswith("**/", index):
            tokens.append((_SUBDIRS, ""))
            index += 3
        elif pattern.startswith("**", index):
            tokens.append((_DSTAR, ""))
            index += 2
        elif pattern[index] == "*":
            tokens.append((_STAR, ""))
            index += 1
        elif pattern[index] == "?":
            tokens.append((_ONE, ""))
            index += 1
        else:
            tokens.append((_LITERAL, pattern[index]))
            index += 1
    return tokens


def _carry(run_mask: int, live: int) -> int:
    """States reached by ε-moves from ``live`` (a subset of ``run_mask``) through ``run_mask``.

    Each run of consecutive set bits in ``run_mask`` passes activity upward to the
    first bit past the run. Adding the live bits to the mask carries from the
    lowest live bit of each run to that bit, so the bits the addition flips are
    exactly the states reached: one addition, however long the run. A run ends
    at a clear bit and the carry stops there, so runs never disturb each other.
    """
    return (run_mask + live) ^ run_mask


@dataclass(frozen=True, slots=True)
class _GlobSet:
    """Patterns compiled side by side into one NFA; ``matches`` is "any of them".

    Bit ``i`` of a state set is NFA state ``i``. For a character ``c``, a state
    in ``advance[c]`` moves to the next state and one in ``stay`` keeps itself;
    then ε-moves run forward through ``skippable`` states. ``**/`` may only be
    skipped on entry (skipping it after it consumed characters would let ``.*``
    end without its ``/``), so a state that merely stayed propagates only
    through ``skippable_after_stay``.
    """

    patterns: tuple[str, ...]
    start: int = field(repr=False, compare=False)
    accept: int = field(repr=False, compare=False)
    skippable: int = field(repr=False, compare=False)
    skippable_after_stay: int = field(repr=False, compare=False)
    advance: Mapping[str, int] = field(repr=False, compare=False)
    advance_other: int = field(repr=False, compare=False)
    stay_slash: int = field(repr=False, compare=False)
    stay_other: int = field(repr=False, compare=False)

    @classmethod
    def compile(cls, patterns: Iterable[str]) -> _GlobSet:
        patterns = tuple(patterns)
        start = accept = one = star = dstar = subdirs = 0
        literal: dict[str, int] = {}
        state = 0
        for pattern in patterns:
            start |= 1 << state
            for kind, char in _tokens(pattern):
                bit = 1 << state
                if kind == _LITERAL:
                    literal[char] = literal.get(char, 0) | bit
                elif kind == _ONE:
                    one |= bit
                elif kind == _STAR:
                    star |= bit
                elif kind == _DSTAR:
                    dstar |= bit
                else:
                    subdirs |= bit
                state += 1
            accept |= 1 << state
            state += 1
        advance = {char: bits | one for char, bits in literal.items()}
        advance["/"] = literal.get("/", 0) | subdirs
        skippable = star | dstar | subdirs
        return cls(
            patterns,
            start=start | _carry(skippable, start & skippable),
            accept=accept,
            skippable=skippable,
            skippable_after_stay=star | dstar,
            advance=advance,
            advance_other=one,
            stay_slash=dstar | subdirs,
            stay_other=star | dstar | subdirs,
        )

    def matches(self, path: str) -> bool:
        """Whether any of the patterns matches all of ``path``."""
        states = self.start
        advance = self.advance
        skippable = self.skippable
        skippable_after_stay = self.skippable_after_stay
        for char in path:
            stay = self.stay_slash if char == "/" else self.stay_other
            moved = (states & advance.get(char, self.advance_other)) << 1
            stayed = states & stay
            live = (moved & skippable) | (stayed & skippable_after_stay)
            states = moved | stayed | _carry(skippable, live)
            if not states:
                return False
        return bool(states & self.accept)


@dataclass(frozen=True, slots=True)
class WorkspaceSelection:
    """Compiled include/exclude globs; ``everything()`` keeps the whole workspace."""

    include: _GlobSet
    exclude: _GlobSet

    @classmethod
    def everything(cls) -> WorkspaceSelection:
        return cls(_GlobSet.compile(()), _GlobSet.compile(()))

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
        return cls(_GlobSet.compile(include), _GlobSet.compile(exclude))

    @property
    def selects_all(self) -> bool:
        return not self.include.patterns and not self.exclude.patterns

    def keeps(self, relpath: str, *, is_dir: bool) -> bool:
        """Whether ``relpath`` goes into the checkpoint (a directory: whether to walk it)."""
        if self.exclude.matches(relpath):
            return False
        if is_dir or not self.include.patterns:
            return True
        return self.include.matches(relpath)
