"""The pool of unprivileged UIDs jobs run as; one UID is never shared by two live jobs.

Not by two jobs of this runner, and not by jobs of two runners on one host: the
kernel keeps some budgets per UID (inotify instances and watches, user namespaces,
epoll watches, pending signals), and a job's are charged to its own UID (``nsjail.py``
runs nsjail as that UID), so a UID shared by two tenants would be a shared budget.
Each UID in use is leased host-wide by an ``flock`` on ``<lease_dir>/<uid>``; the
kernel drops the lock when the runner dies, however it dies, so a killed runner
never strands its UIDs.

A released UID keeps its lease while it waits in the pool (up to ``keep_leased``
of them; ``close`` drops them all), and is the first handed out again: a job then
takes a UID with no system call at all, where re-leasing it was an ``open``, a
``flock`` and a ``close`` per job, and another runner never sees it free in between.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from ..errors import BusyError

LEASE_DIR = Path("/run/sandcell/uid-leases")


class UidPool:
    """Hands out UIDs from ``[uid_min, uid_max]``; GID equals UID.

    As an ordinary user the runner cannot map other UIDs into a user namespace, so
    every job runs as the invoking user: weaker separation between concurrent jobs,
    which ``/health`` reports.

    ``keep_leased``: released UIDs that keep their lease (the runner's job slots: at
    its busiest it leases that many anyway); one released past that drops its lease.
    """

    def __init__(
        self,
        uid_min: int,
        uid_max: int,
        *,
        lease_dir: Path | None = LEASE_DIR,
        keep_leased: int = 32,
    ) -> None:
        self.shared = os.geteuid() != 0
        self._free = [os.geteuid()] if self.shared else list(range(uid_max, uid_min - 1, -1))
        """Free UIDs this runner holds no lease on, highest first (popped lowest first)."""
        self._kept: list[int] = []
        """Free UIDs whose lease this runner still holds, the last released last."""
        self._keep_leased = keep_leased
        self._in_use: set[int] = set()
        self._leases: dict[int, int] = {}
        self._lease_dir = None if self.shared else lease_dir
        if self._lease_dir is not None:
            self._lease_dir.mkdir(mode=0o700, parents=True, exist_ok=True)

    def allocate(self) -> int:
        """Take a free UID: the last released one still leased, else the lowest this
        host lets us lease; ``BusyError`` when none is left."""
        if self.shared:
            return self._free[0]
        if self._kept:
            # Why it pays: no open/flock/close per job (allocate + release 12-17 us
            # re-leasing, 0.2 us kept: a timing loop of 5 x 5000, two runs,
            # 2026-12-03), and the same UID as the last job means the workspace it
            # left untouched needs no chown either. The three levers together,
            # through the runner: ``ImagePool._untouched`` (workspace/images.py).
            uid = self._kept.pop()
            self._in_use.add(uid)
            return uid
        skipped: list[int] = []
        try:
            while self._free:
                uid = self._free.pop()
                if self._lease(uid):
                    self._in_use.add(uid)
                    return uid
                skipped.append(uid)  # another runner on this host holds it
        finally:
            if skipped:
                self._free.extend(skipped)
                self._free.sort(reverse=True)
        raise BusyError("no free job UID; retry shortly")

    def _lease(self, uid: int) -> bool:
        if self._lease_dir is None:
            return True
        fd = os.open(self._lease_dir / str(uid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._leases[uid] = fd
        return True

    def release(self, uid: int) -> None:
        """Return a UID once nothing of its job is left (processes dead, files gone)."""
        if self.shared or uid not in self._in_use:
            return
        self._in_use.discard(uid)
        if len(self._kept) < self._keep_leased:
            self._kept.append(uid)  # still leased: the next job takes it
            return
        self._unlease(uid)
        self._free.append(uid)
        self._free.sort(reverse=True)

    def _unlease(self, uid: int) -> None:
        fd = self._leases.pop(uid, None)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)  # closing the only descriptor drops the lock

    def close(self) -> None:
        """Drop the leases of the free UIDs (at shutdown; the kernel drops them all when
        the runner dies anyway). UIDs still in use keep theirs until released."""
        while self._kept:
            uid = self._kept.pop()
            self._unlease(uid)
            self._free.append(uid)
        self._free.sort(reverse=True)
        self._keep_leased = 0

    @property
    def in_use(self) -> frozenset[int]:
        return frozenset(self._in_use)
