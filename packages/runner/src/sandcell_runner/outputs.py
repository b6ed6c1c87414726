"""Output collection: which workspace files a turn created or changed, bounded and paid for.

After a job the runner walks the workspace and hashes what is new or changed
(``workspace.surfaced`` holds what the caller has seen). That work happens in
the runner, after the job's timer and outside its cgroup, so it is bounded and
attributed here:

- **A per-turn budget** (``SANDCELL_RUNNER_OUTPUT_SCAN_BYTES``): files are hashed
  while their sizes fit in it; past it a file is listed with ``sha256`` and
  ``content_b64`` None (offered again by a later turn), and the result says
  ``output_scan_exhausted``. The same budget bounds the walk, one entry per
  ``ENTRY_COST_BYTES`` of it: past that the walk stops and removals are not
  reported for the turn.
- **Holes are not read**: a sparse file's data extents are found with
  ``SEEK_DATA``/``SEEK_HOLE`` and only they are read; holes are hashed from a
  buffer of zeros (hashing costs what it costs, so a hole counts in the budget).
- **No starving other sessions**: collection runs on this module's own threads
  (one per job slot, so a turn never waits for a thread), never the default
  executor the other requests' thread hops use; the hashing itself passes a FIFO
  gate in slices of ``HASH_SLICE_BYTES``, at most half the CPUs at once, so a
  turn with a small output waits a slice or two behind a flood, not for it.
- **Accounting**: the bytes hashed and the collecting thread's CPU time are
  returned for ``ExecuteResult.output_scan_bytes`` and ``runner_cpu_ms``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import errno
import hashlib
import os
import stat
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from sandcell_protocol import OutputFile, SurfacedOutput, escape_name

from .workspace import fsops
from .workspace.manager import JobWorkspace

ENTRY_COST_BYTES = 1024
"""What walking one directory entry costs of the budget (a listing and an lstat)."""
HASH_SLICE_BYTES = 4 << 20
"""Hashing passes the gate in slices this big (a few ms each)."""

_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_ZEROS = memoryview(bytes(HASH_SLICE_BYTES))


@dataclass(frozen=True, slots=True)
class Collected:
    """What one turn's collection found and what it cost."""

    files: list[OutputFile]
    removed: int
    """Files the caller had seen that are gone (0 when the walk stopped early)."""
    scan_bytes: int
    exhausted: bool
    cpu_ms: int
    disk_full: bool = False


class FairGate:
    """At most ``slots`` holders at once, admitted in arrival order (FIFO)."""

    def __init__(self, slots: int) -> None:
        self._cond = threading.Condition()
        self._free = slots
        self._queue: deque[object] = deque()

    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        ticket = object()
        with self._cond:
            self._queue.append(ticket)
            while self._queue[0] is not ticket or self._free == 0:
                self._cond.wait()
            self._queue.popleft()
            self._free -= 1
            if self._free:
                self._cond.notify_all()  # the next in line may fit too
        try:
            yield
        finally:
            with self._cond:
                self._free += 1
                self._cond.notify_all()


class _Budget:
    """One turn's budget: bytes to hash, entries to walk."""

    def __init__(self, total_bytes: int) -> None:
        self.hash_left = total_bytes
        self.entries_left = total_bytes // ENTRY_COST_BYTES
        self.hashed = 0
        self.exhausted = False
        self.walk_stopped = False

    def take_entry(self) -> bool:
        if self.entries_left <= 0:
            self.exhausted = self.walk_stopped = True
            return False
        self.entries_left -= 1
        return True

    def take_bytes(self, size: int) -> bool:
        if size > self.hash_left:
            self.exhausted = True
            return False
        self.hash_left -= size
        self.hashed += size
        return True


class OutputCollector:
    """Collects turns' outputs on its own threads, within each turn's budget."""

    def __init__(
        self,
        *,
        inline_max_bytes: int,
        max_files: int,
        scan_budget_bytes: int,
        threads: int,
        hash_slots: int | None = None,
    ) -> None:
        self._inline_max = inline_max_bytes
        self._max_files = max_files
        self._budget_bytes = scan_budget_bytes
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="sandcell-outputs")
        self._gate = FairGate(hash_slots or max(1, (os.cpu_count() or 2) // 2))

    async def collect(
        self, workspace: JobWorkspace, *, disk_full: Callable[[], bool] | None = None
    ) -> Collected:
        """New or changed files since ``workspace.surfaced`` (which it updates).

        ``disk_full`` is checked in the same thread hop (a hop costs more than a statvfs).
        """
        if not workspace.surfaced and _is_empty(workspace.path):
            # The common one-shot job leaves nothing: one scandir here (~10 us) costs
            # less than the thread hop, and there is nothing to walk, hash or remove.
            full = disk_full() if disk_full is not None else False
            return Collected(
                files=[], removed=0, scan_bytes=0, exhausted=False, cpu_ms=0, disk_full=full
            )
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._pool, self._collect, workspace, disk_full)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            # The thread goes on updating ``workspace.surfaced``: the caller's session
            # lock must outlive it (it is bounded by the budget), or the next turn's
            # collection would race this one on the same state.
            await asyncio.wait({future})
            raise

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _collect(self, workspace: JobWorkspace, disk_full: Callable[[], bool] | None) -> Collected:
        started = time.thread_time()
        full = disk_full() if disk_full is not None else False
        budget = _Budget(self._budget_bytes)
        outputs: list[OutputFile] = []
        seen: set[str] = set()
        for dir_fd, entry in fsops.walk(workspace.path, charge=budget.take_entry):
            # The wire name: a name that is not UTF-8 travels escaped (sandcell_protocol.names).
            name = escape_name(os.fsencode(entry.name))
            seen.add(name)
            known = workspace.surfaced.get(name)
            # Size and mtime unchanged: the file was not rewritten, skip the hash.
            if known and known.size == entry.size and known.mtime_ns == entry.mtime_ns:
                continue
            if len(outputs) >= self._max_files:
                continue
            content: str | None = None
            target: str | None = None
            if entry.kind == "symlink":
                raw_target = os.fsencode(entry.symlink_target or "")
                digest: str | None = hashlib.sha256(raw_target).hexdigest()
                target = escape_name(raw_target)
            elif budget.take_bytes(entry.size):
                try:
                    digest, raw = self._hash(dir_fd, entry.name.rsplit("/", 1)[-1], entry.size)
                except OSError:
                    continue  # replaced or removed by a process still running
                content = base64.b64encode(raw).decode() if raw is not None else None
            else:
                digest = None  # past the budget: listed, not hashed, not remembered
            if digest is not None and known and known.sha256 == digest and known.size == entry.size:
                workspace.surfaced[name] = SurfacedOutput(
                    name=name, size=entry.size, mtime_ns=entry.mtime_ns, sha256=digest
                )
                continue
            outputs.append(
                OutputFile(
                    name=name,
                    size=entry.size,
                    sha256=digest,
                    content_b64=content,
                    symlink_target=target,
                )
            )
            if digest is not None:
                workspace.surfaced[name] = SurfacedOutput(
                    name=name, size=entry.size, mtime_ns=entry.mtime_ns, sha256=digest
                )
        removed = 0
        if not budget.walk_stopped:  # an unfinished walk cannot tell removed from unseen
            gone = set(workspace.surfaced) - seen
            for name in gone:
                del workspace.surfaced[name]
            removed = len(gone)
        return Collected(
            files=outputs,
            removed=removed,
            scan_bytes=budget.hashed,
            exhausted=budget.exhausted,
            cpu_ms=int((time.thread_time() - started) * 1000),
            disk_full=full,
        )

    def _hash(self, dir_fd: int, name: str, size_hint: int) -> tuple[str, bytes | None]:
        """sha256 of a regular file (holes not read), and its bytes when small enough."""
        fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise fsops.UnsafePathError(errno.EISDIR, f"not a regular file: {name}")
            # Never past the size the budget was charged for (the file may be growing).
            size = min(st.st_size, size_hint)
            digest = hashlib.sha256()
            kept: bytearray | None = bytearray() if size <= self._inline_max else None
            for start, end, is_data in data_extents(fd, size):
                position = start
                while position < end:
                    length = min(HASH_SLICE_BYTES, end - position)
                    with self._gate.slot():
                        piece = os.pread(fd, length, position) if is_data else _ZEROS[:length]
                        digest.update(piece)
                    if not piece:
                        break  # shrunk under us: hash what there was
                    if kept is not None:
                        kept += piece
                    position += len(piece)
            return digest.hexdigest(), bytes(kept) if kept is not None else None
        finally:
            os.close(fd)


def _is_empty(directory: os.PathLike[str] | str) -> bool:
    """Whether ``directory`` has no entry (False when it cannot be read: walk it then)."""
    try:
        with os.scandir(directory) as entries:
            return next(entries, None) is None
    except OSError:
        return False


def data_extents(fd: int, size: int) -> Iterator[tuple[int, int, bool]]:
    """``(start, end, is_data)`` runs covering ``[0, size)``: data to read, holes to skip.

    Where the filesystem cannot say (no ``SEEK_DATA``), the whole file is data.
    """
    position = 0
    while position < size:
        try:
            data = os.lseek(fd, position, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # nothing but a hole up to the end
                yield position, size, False
                return
            yield position, size, True  # EINVAL: SEEK_DATA unsupported here
            return
        data = min(data, size)
        if data > position:
            yield position, data, False
        if data >= size:
            return
        hole = min(os.lseek(fd, data, os.SEEK_HOLE), size)
        if hole <= data:  # cannot happen on a sane filesystem; never loop on it
            hole = size
        yield data, hole, True
        position = hole


__all__ = ["ENTRY_COST_BYTES", "HASH_SLICE_BYTES", "Collected", "FairGate", "OutputCollector"]
