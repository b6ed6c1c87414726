"""A process's merged output as lines: a bounded ring for ``logs``, queues for ``follow``.

Memory is bounded twice over: the ring keeps the last ``max_lines`` lines, and a
line longer than ``max_line_chars`` is cut (the rest, up to its newline, dropped),
so neither a chatty server nor a minified bundle printed on one line grows it.
A follower that falls ``max_backlog`` lines behind is cut off rather than buffered
without end; its stream says so.
"""

from __future__ import annotations

import asyncio
import codecs
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

CUT_MARK = " …[line cut]"
FELL_BEHIND = "[sandcell] log follower fell behind; lines were skipped, reconnect to resume"


@dataclass(frozen=True, slots=True)
class Tail:
    """The last lines asked for, and whether the buffer could not give all it was asked."""

    lines: list[str]
    truncated: bool


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The ring's lines at one moment: (text, whether it was cut), oldest first."""

    items: list[tuple[str, bool]]
    dropped: int

    @property
    def texts(self) -> list[str]:
        return [text for text, _ in self.items]

    def tail(self, count: int, mask: list[bool] | None = None) -> Tail:
        """The last ``count`` lines (of those ``mask`` selects, when given)."""
        chosen = self.items
        if mask is not None:
            chosen = [item for item, kept in zip(self.items, mask, strict=True) if kept]
        picked = chosen[-count:] if count else []
        reached_start = len(chosen) <= count
        truncated = (reached_start and self.dropped > 0) or any(cut for _, cut in picked)
        return Tail(lines=[text for text, _ in picked], truncated=truncated)


class Follower:
    """One ``follow`` stream: new lines until the buffer closes (or it falls behind)."""

    def __init__(self, max_backlog: int) -> None:
        self._lines: deque[str] = deque()
        self._max = max_backlog
        self._wake = asyncio.Event()
        self.closed = False
        self.fell_behind = False

    def push(self, line: str) -> None:
        if self.closed:
            return
        if len(self._lines) >= self._max:
            self.fell_behind = True
            self.close()
            return
        self._lines.append(line)
        self._wake.set()

    def close(self) -> None:
        self.closed = True
        self._wake.set()

    async def lines(self) -> AsyncIterator[str]:
        """Lines as they come; ends when the process's output ends."""
        while True:
            while self._lines:
                yield self._lines.popleft()
            if self.closed:
                if self.fell_behind:
                    yield FELL_BEHIND
                return
            self._wake.clear()
            await self._wake.wait()


class LineBuffer:
    """Splits a byte stream into lines (UTF-8, invalid bytes replaced) and keeps the last ones."""

    def __init__(
        self,
        *,
        max_lines: int = 2000,
        max_line_chars: int = 4096,
        max_backlog: int = 2000,
        on_line: Callable[[str], None] | None = None,
    ) -> None:
        self._ring: deque[tuple[str, bool]] = deque(maxlen=max_lines)
        self._max_chars = max_line_chars
        self._max_backlog = max_backlog
        self._on_line = on_line
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._partial = ""
        self._skipping = False
        self._followers: set[Follower] = set()
        self.dropped = 0
        """Lines that fell out of the ring."""
        self.closed = False

    def feed(self, data: bytes) -> None:
        """Add output as it arrives (any chunking)."""
        self._take(self._decoder.decode(data))

    def write_line(self, line: str) -> None:
        """Add a line of the runner's own (a status note), kept apart from partial output."""
        self._add(line)

    def close(self) -> None:
        """End of output: flush the last partial line and end every follower."""
        if self.closed:
            return
        self._take(self._decoder.decode(b"", final=True))
        if self._partial and not self._skipping:
            self._add(self._partial)
        self._partial = ""
        self.closed = True
        for follower in self._followers:
            follower.close()
        self._followers.clear()

    def _take(self, text: str) -> None:
        if not text:
            return
        pieces = (self._partial + text).split("\n")
        self._partial = pieces.pop()
        for piece in pieces:
            if self._skipping:
                self._skipping = False
                continue
            self._add(piece.removesuffix("\r"))
        if len(self._partial) > self._max_chars and not self._skipping:
            self._add(self._partial)
            self._skipping = True
        if self._skipping:
            self._partial = ""

    def _add(self, line: str) -> None:
        cut = len(line) > self._max_chars
        if cut:
            line = line[: self._max_chars] + CUT_MARK
        if len(self._ring) == self._ring.maxlen:
            self.dropped += 1
        self._ring.append((line, cut))
        if self._on_line is not None:
            self._on_line(line)
        for follower in list(self._followers):
            follower.push(line)
            if follower.closed:
                self._followers.discard(follower)

    def snapshot(self) -> Snapshot:
        """The lines held now (filter them, then ``Snapshot.tail``)."""
        return Snapshot(items=list(self._ring), dropped=self.dropped)

    def follow(self) -> Follower:
        """A follower of lines added from now on (already closed when output has ended)."""
        follower = Follower(self._max_backlog)
        if self.closed:
            follower.close()
        else:
            self._followers.add(follower)
        return follower


__all__ = ["CUT_MARK", "FELL_BEHIND", "Follower", "LineBuffer", "Snapshot", "Tail"]
