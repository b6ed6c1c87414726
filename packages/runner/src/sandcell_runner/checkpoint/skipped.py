"""``SkippedEntries``: the names a checkpoint's meta gives of the entries it left out.

``CheckpointMeta.skipped`` names what an export passed over (FIFOs, sockets, devices,
links out of the workspace, names that are no workspace path). Only the first of them
are named, ``MAX_SKIPPED_LISTED_CHARS`` of names, then one line counts the rest: a
workspace of 60,000 links out of it with 3,500-character paths made the whole list
950 MB of the runner's memory (charged to no job) and a meta past ``MAX_META_BYTES``,
so the checkpoint was refused (a snapshot or pause answered 500).
"""

from __future__ import annotations

import os

__all__ = ["MAX_SKIPPED_LISTED_CHARS", "SkippedEntries"]

MAX_SKIPPED_LISTED_CHARS = 64 << 10
"""The most characters of skipped names a checkpoint's meta lists."""


class SkippedEntries:
    """The skipped entries' names as they are found, bounded; ``listed`` for the meta."""

    def __init__(self) -> None:
        self._names: list[str] = []
        self._chars = 0
        self._more = 0

    def add(self, relpath: str) -> None:
        """One more skipped entry: named while the names fit, else only counted."""
        name = _printable(relpath)
        if self._more or self._chars + len(name) > MAX_SKIPPED_LISTED_CHARS:
            self._more += 1
            return
        self._names.append(name)
        self._chars += len(name)

    def listed(self) -> list[str]:
        """The names, then ``(and N more entries not listed)`` if some were only counted."""
        more = [f"(and {self._more} more entries not listed)"] if self._more else []
        return self._names + more


def _printable(relpath: str) -> str:
    # Undecodable bytes arrive as surrogates, which JSON cannot carry.
    return os.fsencode(relpath).decode("utf-8", "backslashreplace")
