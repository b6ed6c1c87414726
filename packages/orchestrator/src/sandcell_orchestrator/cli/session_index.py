"""The sessions this CLI made, kept in ``$SANDCELL_HOME/cli-sessions.json``.

No registry of the embedded default outlives the process, so the CLI keeps its
own list of the hints it was given (for ``sessions list`` and ``destroy``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from sandcell_protocol import is_runtime_session_id

__all__ = ["CliSessions"]

log = logging.getLogger(__name__)


class CliSessions:
    """The sessions this CLI made: ``$SANDCELL_HOME/cli-sessions.json`` (hint, last use).

    Read-modify-write under an ``flock``, replaced atomically, so concurrent CLI
    calls neither lose entries nor read a torn file.
    """

    def __init__(self, home: Path, *, clock: Callable[[], float] = time.time) -> None:
        self._path = home / "cli-sessions.json"
        self._clock = clock

    def entries(self) -> dict[str, dict[str, Any]]:
        with self._locked():
            return self._read()

    def touch(self, session_id: str, *, hint: str) -> None:
        with self._locked():
            entries = self._read()
            entries[session_id] = {"hint": hint, "last_used_s": self._clock()}
            self._write(entries)

    def remove(self, session_id: str) -> bool:
        with self._locked():
            entries = self._read()
            if entries.pop(session_id, None) is None:
                return False
            self._write(entries)
            return True

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self._path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with open(self._path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def _read(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads(self._path.read_text())
            sessions = data["sessions"]
            return {
                k: v
                for k, v in sessions.items()
                if is_runtime_session_id(k) and isinstance(v, dict)
            }
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            log.warning("%s is unreadable; starting a new session list", self._path)
            return {}

    def _write(self, entries: dict[str, dict[str, Any]]) -> None:
        temp = self._path.with_name(f".{self._path.name}.{os.getpid()}.tmp")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            json.dump({"sessions": entries}, handle, indent=1, sort_keys=True)
        temp.replace(self._path)
