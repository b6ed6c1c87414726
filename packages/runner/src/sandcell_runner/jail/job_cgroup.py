"""One job's cgroup: its limits, its counters read apart per job, its join, its leftovers.

A pooled cgroup (``CgroupManager.acquire``) serves one job slot's jobs in turn, so
everything read per job is made cheap here: counter files held open and read with
``pread``, their paths made once, counters baselined at each ``begin`` (they are
cumulative), and the v1 ``tasks`` files the job's child joins through held open
(``join_fds``). The hierarchy, the pool and the instance's CPU quota are
``cgroups.py``'s.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

_WRITTEN = frozenset({"memory.max_usage_in_bytes"})


@dataclass(frozen=True, slots=True)
class JobCgroupStats:
    """What the cgroup saw of a finished job."""

    oom_killed: bool
    pids_exhausted: bool
    memory_peak_bytes: int | None
    """Peak memory charged to the cgroup during the job, above the charge it began with
    (a session's workspace files, cache left by earlier jobs): the job's anonymous
    memory, the tmpfs files it wrote, the page cache it brought in. What the memory
    limit counts. None where the kernel keeps no resettable peak (cgroup v2 before 6.12)."""


class JobCgroup:
    """One job's cgroup (a directory per controller on v1, one directory on v2)."""

    def __init__(self, dirs: list[Path], *, version: int) -> None:
        self._dirs = dirs
        self._version = version
        # The files read per job, their paths made once: finding them through
        # ``.parent.parent.parent`` on every read was ~0.1 ms of the event loop per job.
        memory = _controller_dir(dirs, version, "memory")
        pids = _controller_dir(dirs, version, "pids")
        self._memory = memory
        v1 = version == 1
        # As text, not ``Path``: each is a key of ``_held`` and an ``open`` argument,
        # and a ``Path`` costs a Python-level ``__hash__`` or ``__fspath__`` call for
        # each (nine a job).
        self._oom_file = (
            None
            if memory is None
            else str(memory / ("memory.oom_control" if v1 else "memory.events"))
        )
        self._usage_file = (
            None
            if memory is None
            else str(memory / ("memory.usage_in_bytes" if v1 else "memory.current"))
        )
        self._max_usage_file = None if memory is None else str(memory / "memory.max_usage_in_bytes")
        self._pids_events = None if pids is None else str(pids / "pids.events")
        self._pids_current_file = None if pids is None else str(pids / "pids.current")
        # Counters are cumulative; a reused cgroup reports what changed since begin().
        self._baseline = (0, 0)
        self._limits: tuple[int, int] | None = None
        """(memory_bytes, pids) as last written: a pooled cgroup's next job rarely differs."""
        self._memory_start: int | None = None
        self._peak_fd: int | None = None
        """v2: ``memory.peak`` held open; a write resets the peak this fd reports (6.12+)."""
        self._held: dict[str, int] = {}
        """Counter files held open (read with ``pread`` at 0, which makes the kernel
        render them afresh): a pooled cgroup reads or writes seven of them per job, and
        an open is a path walk through kernfs plus a seq_file set up and torn down.
        With ``pids.current`` for the leftover check, a job's cgroup work (begin, stats,
        leftovers) went from ~128 to ~56-69 us of CPU here (3 alternating pairs), and
        with the file paths made once (``__init__``) from 170-184 to 23-25 us.
        ``cgroup.procs`` is never held: v1 caches the pid list of an open file.
        """
        self._join_paths = [d / "tasks" for d in dirs] if version == 1 else None
        self._join_fds: list[int] | None = None
        """v1 ``tasks`` held open for writing (``join_fds``), until ``destroy``."""

    def _fd(self, path: str) -> int:
        fd = self._held.get(path)
        if fd is None:
            # Read-only files refuse a writable open (kernfs), so only the one file
            # written through this (the peak reset) is opened for writing.
            mode = os.O_RDWR if os.path.basename(path) in _WRITTEN else os.O_RDONLY
            fd = os.open(path, mode | os.O_CLOEXEC)
            self._held[path] = fd
        return fd

    def _read(self, path: str) -> str:
        """A counter file's text; raises OSError as an open and read would."""
        try:
            return os.pread(self._fd(path), 65536, 0).decode("ascii", "replace")
        except OSError:
            self._drop(path)  # a cgroup made again under us: the next read opens afresh
            raise

    def _write(self, path: str, data: bytes) -> None:
        try:
            os.write(self._fd(path), data)
        except OSError:
            self._drop(path)
            raise

    def _drop(self, path: str) -> None:
        fd = self._held.pop(path, None)
        if fd is not None:
            os.close(fd)

    def _keyed(self, path: str, key: str) -> int:
        """``key``'s value in a flat-keyed file ("name value" lines); 0 when absent."""
        try:
            return keyed_value(self._read(path), key)
        except OSError:
            return 0

    def _int(self, path: str) -> int | None:
        try:
            return int(self._read(path).strip())
        except (OSError, ValueError):
            return None

    def open_procs_fds(self) -> list[int]:
        """File descriptors a freshly forked child writes ``0`` into to join the cgroup."""
        return [os.open(d / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC) for d in self._dirs]

    def join_fds(self) -> list[int] | None:
        """v1 ``tasks`` descriptors, held open, a freshly forked child writes ``0`` into
        to move itself in; the cgroup's own (closed by ``destroy``, never by the caller).
        None on v2 (``open_procs_fds``).

        Held, not opened per job: the two opens (a kernfs path walk each) were most of
        the join's cost, 0.27-0.29 ms against 0.08 ms for writes to held descriptors
        (0.16-0.2 ms a job). Still ``tasks`` and ``0``: a single thread moving itself is
        the cheapest join measured (``cgroup.procs`` +0.7 CPU-ms a job, a join before
        the fork +1.7; ``spawnd.py``).
        """
        if self._join_paths is None:
            return None
        if self._join_fds is None:
            fds: list[int] = []
            try:
                for path in self._join_paths:
                    fds.append(os.open(path, os.O_WRONLY | os.O_CLOEXEC))
            except BaseException:
                for fd in fds:
                    os.close(fd)
                raise
            self._join_fds = fds
        return list(self._join_fds)

    def thread_join_paths(self) -> list[Path] | None:
        """v1 ``tasks`` files a *thread* can move itself into (None on v2, which has none).

        A child inherits the cgroup of the thread that forked it, so the spawner
        thread steps into the job cgroup, forks without ``preexec_fn`` (cheap vfork),
        and steps back.
        """
        return None if self._join_paths is None else list(self._join_paths)

    def _counters(self) -> tuple[int, int]:
        """(oom kills, pids-limit hits) so far."""
        oom_file, events = self._oom_file, self._pids_events
        oom = self._keyed(oom_file, "oom_kill") if oom_file is not None else 0
        hits = self._keyed(events, "max") if events is not None else 0
        return oom, hits

    def has_limits(self, *, memory_bytes: int, pids: int) -> bool:
        """Whether ``begin`` with these limits would write no limit files."""
        return self._limits == (memory_bytes, pids)

    def begin(self, *, memory_bytes: int, pids: int) -> None:
        """Prepare a reused cgroup for its next job: limits set, counters baselined.

        With unchanged limits this is a few small sysfs reads and one write
        (~60 us), cheap enough for the event loop; writing a lower memory limit
        may reclaim, so callers run a limit change in a thread.
        """
        if not self.has_limits(memory_bytes=memory_bytes, pids=pids):
            for directory in self._dirs:
                apply_limits(directory, self._version, memory_bytes=memory_bytes, pids=pids)
        self._limits = (memory_bytes, pids)
        self._baseline = self._counters()
        self._reset_peak()

    def _reset_peak(self) -> None:
        memory, usage = self._memory, self._usage_file
        if memory is None or usage is None:
            return
        if self._version == 1:
            assert self._max_usage_file is not None
            with contextlib.suppress(OSError):
                self._write(self._max_usage_file, b"0")
            self._memory_start = self._int(usage)
            return
        try:
            if self._peak_fd is None:
                self._peak_fd = os.open(memory / "memory.peak", os.O_RDWR | os.O_CLOEXEC)
            os.write(self._peak_fd, b"reset")
        except OSError:
            # Read-only before Linux 6.12: the peak would be the cgroup's lifetime's.
            self._memory_start = None
            return
        self._memory_start = self._int(usage)

    def stats(self) -> JobCgroupStats:
        oom, hits = self._counters()
        peak = self._peak()
        return JobCgroupStats(
            oom_killed=oom > self._baseline[0],
            pids_exhausted=hits > self._baseline[1],
            memory_peak_bytes=peak,
        )

    def _peak(self) -> int | None:
        if self._memory is None or self._memory_start is None:
            return None
        if self._version == 1:
            assert self._max_usage_file is not None
            peak = self._int(self._max_usage_file)
        else:
            assert self._peak_fd is not None
            try:
                peak = int(os.pread(self._peak_fd, 64, 0).decode("ascii").strip())
            except (OSError, ValueError):
                peak = None
        return None if peak is None else max(0, peak - self._memory_start)

    def signal_leftovers(self) -> bool:
        """SIGKILL what is in the cgroup now; False when it was already empty.

        The common case after a job (nothing left) is one ``pread`` of ``pids.current``
        (every process of the job is in the pids cgroup too); ``cgroup.procs`` is read
        only when something is counted there. ``kill_all`` waits.
        """
        count = self._pids_current()
        if count == 0:
            return False
        own = os.getpid()
        found = False
        for directory in self._dirs:
            for pid in read_pids(directory / "cgroup.procs"):
                if pid != own:
                    found = True
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
        return found

    def _pids_current(self) -> int | None:
        """Tasks charged to the pids cgroup now (None: no pids cgroup to ask)."""
        path = self._pids_current_file
        return None if path is None else self._int(path)

    def kill_all(self) -> None:
        """SIGKILL every process left in the cgroup (a timeout, or leftovers)."""
        for directory in self._dirs:
            if self._version == 2 and (directory / "cgroup.kill").exists():
                with contextlib.suppress(OSError):
                    (directory / "cgroup.kill").write_text("1")
                continue
            own = os.getpid()
            for _ in range(50):
                # A resident spawner thread puts the runner itself in cgroup.procs.
                pids = [pid for pid in read_pids(directory / "cgroup.procs") if pid != own]
                if not pids:
                    break
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                time.sleep(0.002)

    def destroy(self) -> None:
        """Kill what is left and remove the directories; idempotent."""
        self.kill_all()
        if self._peak_fd is not None:
            os.close(self._peak_fd)
            self._peak_fd = None
        for path in list(self._held):
            self._drop(path)
        join, self._join_fds = self._join_fds, None
        for fd in join or ():
            os.close(fd)
        for directory in self._dirs:
            for _ in range(100):
                try:
                    directory.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:
                    if exc.errno != errno.EBUSY:
                        log.warning("cgroup %s not removed: %s", directory, exc)
                        break
                    time.sleep(0.005)


def apply_limits(directory: Path, version: int, *, memory_bytes: int, pids: int) -> None:
    """Write the memory (swap disabled) and pids limits into one controller's directory."""
    controller = directory.parent.parent.parent.name
    if version == 1:
        if controller == "memory":
            limit = directory / "memory.limit_in_bytes"
            memsw = directory / "memory.memsw.limit_in_bytes"
            # memory <= memory+swap at every step: raise memsw first, lower it last.
            try:
                limit.write_text(str(memory_bytes))
            except OSError:
                memsw.write_text(str(memory_bytes))
                limit.write_text(str(memory_bytes))
            if memsw.exists():
                memsw.write_text(str(memory_bytes))
            with contextlib.suppress(OSError):
                (directory / "memory.swappiness").write_text("0")
        elif controller == "pids":
            (directory / "pids.max").write_text(str(pids))
        return
    (directory / "memory.max").write_text(str(memory_bytes))
    with contextlib.suppress(OSError):
        (directory / "memory.swap.max").write_text("0")
    (directory / "pids.max").write_text(str(pids))


def _controller_dir(dirs: list[Path], version: int, controller: str) -> Path | None:
    """The directory of ``controller`` among a job cgroup's (v2: its only one)."""
    if version == 2:
        return dirs[0] if dirs else None
    return next((d for d in dirs if d.parent.parent.parent.name == controller), None)


def keyed_value(text: str, key: str) -> int:
    """``key``'s value in a flat-keyed cgroup file's text; 0 when absent or not a number.

    Found, not parsed into a dict: two of these a job, twice, and a dict of every line
    was ~10 us each on the event loop."""
    needle = key + " "
    if text.startswith(needle):
        start = len(needle)
    else:
        found = text.find("\n" + needle)
        if found < 0:
            return 0
        start = found + 1 + len(needle)
    end = text.find("\n", start)
    try:
        return int(text[start:] if end < 0 else text[start:end])
    except ValueError:
        return 0


def read_pids(path: Path) -> list[int]:
    """The pids a ``cgroup.procs`` file lists ([] when it cannot be read)."""
    try:
        return [int(line) for line in path.read_text().split()]
    except (OSError, ValueError):
        return []


__all__ = ["JobCgroup", "JobCgroupStats", "apply_limits", "keyed_value", "read_pids"]
