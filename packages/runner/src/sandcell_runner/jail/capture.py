"""A job's output streams as the runner keeps them: up to a cap, then drained unread.

``Capture`` keeps a stream's bytes up to its cap and notes the truncation; past
it, ``widen`` grows the flooding pipe and ``discard`` splices what is in it to
/dev/null in the kernel, paced by ``DRAIN_INTERVAL_S`` (``nsjail.Jail`` reads the
pipes on the event loop and calls these).
"""

from __future__ import annotations

import asyncio
import fcntl
import os
from collections.abc import Callable

__all__ = ["DRAIN_INTERVAL_S", "Capture", "OutputCallback", "discard", "widen"]

OutputCallback = Callable[[str, bytes], None]


class Capture:
    """Keeps a stream's bytes up to its cap; past it, notes truncation and drops the rest."""

    def __init__(self, name: str, cap: int, on_output: OutputCallback | None) -> None:
        self.name = name
        self.cap = cap
        self.chunks: list[bytes] = []
        self.size = 0
        self.truncated = False
        self.draining = False
        self.eof = asyncio.Event()
        self._on_output = on_output

    def feed(self, data: bytes) -> bool:
        """Store ``data``; return True when this is the first chunk that did not fit.

        Past the cap means a byte was dropped: output that ends exactly at the cap is
        whole (not truncated), and the chunk after a chunk that filled it exactly
        is the one that passes it.
        """
        room = max(self.cap - self.size, 0)
        kept = data[:room]
        if kept:
            self.chunks.append(kept)
            self.size += len(kept)
            if self._on_output is not None:
                self._on_output(self.name, kept)
        if len(data) > len(kept):
            first = not self.truncated
            self.truncated = True
            return first
        return False

    def value(self) -> bytes:
        return b"".join(self.chunks)


_DEVNULL_FD: list[int] = []


_DRAIN_PIPE_BYTES = 1 << 20


DRAIN_INTERVAL_S = 0.01
"""A stream past its cap is drained a pipeful (1 MiB) per 10 ms at most: 100 MiB/s."""


def widen(fd: int) -> bool:
    """Grow a flooding pipe to a megabyte (the default ceiling of pipe-max-size): one
    wake-up per megabyte instead of per 64 KiB. Its pages are charged to the writer."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, _DRAIN_PIPE_BYTES)
    except (OSError, AttributeError):
        return False
    return True


def discard(fd: int) -> int | None:
    """Splice what is in the pipe ``fd`` to /dev/null: bytes moved (0 at EOF), or None
    where splice is unavailable (the caller reads instead)."""
    if not hasattr(os, "splice"):
        return None
    if not _DEVNULL_FD:
        _DEVNULL_FD.append(os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC))
    try:
        return os.splice(fd, _DEVNULL_FD[0], 1 << 20, flags=os.SPLICE_F_NONBLOCK)
    except BlockingIOError:
        raise
    except OSError:
        return None
