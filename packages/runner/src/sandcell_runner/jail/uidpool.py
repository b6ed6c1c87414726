"""The pool of unprivileged UIDs jobs run as; one UID is never shared by two live jobs."""

from __future__ import annotations

import os

from ..errors import BusyError


class UidPool:
    """Hands out UIDs from ``[uid_min, uid_max]``; GID equals UID.

    As an ordinary user the runner cannot map other UIDs into a user namespace, so
    every job runs as the invoking user: weaker separation between concurrent jobs,
    which ``/health`` reports.
    """

    def __init__(self, uid_min: int, uid_max: int) -> None:
        self.shared = os.geteuid() != 0
        self._free = [os.geteuid()] if self.shared else list(range(uid_max, uid_min - 1, -1))
        self._in_use: set[int] = set()

    def allocate(self) -> int:
        """Take a free UID (the lowest first); ``BusyError`` when none is left."""
        if self.shared:
            return self._free[0]
        if not self._free:
            raise BusyError("no free job UID; retry shortly")
        uid = self._free.pop()
        self._in_use.add(uid)
        return uid

    def release(self, uid: int) -> None:
        """Return a UID once nothing of its job is left (processes dead, files gone)."""
        if self.shared or uid not in self._in_use:
            return
        self._in_use.discard(uid)
        self._free.append(uid)
        self._free.sort(reverse=True)

    @property
    def in_use(self) -> frozenset[int]:
        return frozenset(self._in_use)
