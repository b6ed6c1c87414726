"""``DirectorySnapshotStore``: snapshots as files under one local directory.

Each object is a regular file at ``root/<key>`` whose sha256 sits in the extended
attribute ``user.sandcell.sha256``. A put writes a hidden temp file beside the
target, sets the attribute, fsyncs, renames it over the target and fsyncs the
directory: the attribute travels with the inode, so object and digest change
together in one rename and a crash never leaves a half-written object.
"""

from __future__ import annotations

import bisect
import errno
import hashlib
import os
import stat
import tempfile
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from io import FileIO
from pathlib import Path
from types import TracebackType
from typing import Self

import anyio

from ..errors import CheckpointError
from ..to_the_end import to_the_end
from .base import (
    Snapshot,
    SnapshotEntry,
    SnapshotInfo,
    SnapshotNotFoundError,
    _enforce_cap,
    _is_sha256_hex,
    _validate_max_bytes,
    _validate_page,
    _validate_prefix,
    _VerifiedChunks,
)
from .keys import KEY_COMPONENT, validate_snapshot_key

SHA256_XATTR = "user.sandcell.sha256"
_WRITE_BATCH_BYTES = 1 << 20


class DirectorySnapshotStore:
    """A ``SnapshotStore`` on the local filesystem; all disk work runs in worker threads.

    The filesystem must support ``user.*`` extended attributes (ext4, xfs, btrfs,
    tmpfs on Linux >= 6.6); a put on one that does not fails with ``CheckpointError``.
    """

    def __init__(self, root: Path) -> None:
        self._root = Path(root).absolute()
        self._closed = False

    @property
    def root(self) -> Path:
        """The directory objects live under."""
        return self._root

    def __repr__(self) -> str:
        return f"DirectorySnapshotStore(root={str(self._root)!r})"

    async def put(self, key: str, stream: AsyncIterable[bytes], *, max_bytes: int) -> SnapshotInfo:
        """Store ``stream`` at ``root/key`` atomically; see ``SnapshotStore.put``."""
        path = self._path(key)
        _validate_max_bytes(max_bytes)
        # Every hop to its end: a native cancellation (the checkpoint budget's
        # asyncio.timeout) passes anyio's thread wait, and the discard then closed the
        # file under a write or commit still running, or a temp file made after the
        # cancellation stayed for ever (a hidden name nothing lists).
        writer = await to_the_end(
            anyio.to_thread.run_sync(_TempWriter.create, path, key), undo=_discard
        )
        try:
            size = 0
            batch: list[bytes] = []
            batch_bytes = 0
            async for chunk in stream:
                size += len(chunk)
                _enforce_cap(size, max_bytes=max_bytes, key=key)
                batch.append(chunk)
                batch_bytes += len(chunk)
                # Batching keeps thread hops per megabyte, not per (possibly tiny) chunk.
                if batch_bytes >= _WRITE_BATCH_BYTES:
                    await to_the_end(anyio.to_thread.run_sync(writer.write, batch))
                    batch, batch_bytes = [], 0
            if batch:
                await to_the_end(anyio.to_thread.run_sync(writer.write, batch))
            sha256 = await to_the_end(anyio.to_thread.run_sync(writer.commit))
        except BaseException:
            await to_the_end(_discard(writer))
            raise
        return SnapshotInfo(key=key, size=size, sha256=sha256)

    @asynccontextmanager
    async def get(self, key: str, *, max_bytes: int) -> AsyncIterator[Snapshot]:
        """Open ``root/key``; the size is checked on the open file before any read."""
        path = self._path(key)
        _validate_max_bytes(max_bytes)
        file, info = await anyio.to_thread.run_sync(_open_snapshot, path, key)
        try:
            if info.size > max_bytes:
                raise CheckpointError(
                    f"snapshot get of {key!r}: {info.size} bytes is over the cap of {max_bytes}"
                )
            yield Snapshot(info=info, chunks=_VerifiedChunks(_reader(file, key), info=info))
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(file.close)

    async def delete(self, key: str) -> None:
        """Remove ``root/key``; a missing object is not an error."""
        path = self._path(key)
        await anyio.to_thread.run_sync(_delete, path, key)

    async def exists(self, key: str) -> bool:
        """Whether ``root/key`` is a regular file."""
        path = self._path(key)
        return await anyio.to_thread.run_sync(_is_file, path, key)

    async def list(
        self, prefix: str, *, start_after: str | None = None, limit: int | None = None
    ) -> list[SnapshotEntry]:
        """Regular files under ``root`` whose key starts with ``prefix``, by key.

        Hidden names (temp files) and symlinks are never listed; only directories
        a matching key could lie under are walked. A page (``start_after``, ``limit``)
        is cut from that walk: a local directory is read whole either way, but its
        callers' work stays a page's.
        """
        _validate_prefix(prefix)
        _validate_page(prefix, start_after, limit)
        if self._closed:
            raise CheckpointError("snapshot store is closed")
        found = await anyio.to_thread.run_sync(_list, self._root, prefix)
        if start_after is not None:
            found = found[bisect.bisect_right([e.key for e in found], start_after) :]
        return found if limit is None else found[:limit]

    async def close(self) -> None:
        """Mark the store closed; it holds no open resources between calls."""
        self._closed = True

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def _path(self, key: str) -> Path:
        validate_snapshot_key(key)
        if self._closed:
            raise CheckpointError("snapshot store is closed")
        return self._root.joinpath(*key.split("/"))


class _TempWriter:
    """A hidden temp file beside the target, hashed as it is written."""

    def __init__(self, final: Path, temp: Path, file: FileIO, key: str) -> None:
        self._final = final
        self._temp = temp
        self._file = file
        self._key = key
        self._digest = hashlib.sha256()
        self._committed = False

    @classmethod
    def create(cls, final: Path, key: str) -> _TempWriter:
        with _os_errors("put", key):
            final.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            # A leading dot can never match a key component, so no key names a temp file.
            fd, name = tempfile.mkstemp(dir=final.parent, prefix=f".{final.name}.", suffix=".tmp")
        return cls(final, Path(name), FileIO(fd, "wb"), key)

    def write(self, chunks: list[bytes]) -> None:
        with _os_errors("put", self._key):
            for chunk in chunks:
                self._digest.update(chunk)
                view = memoryview(chunk)
                while view:
                    written = self._file.write(view)
                    view = view[written or 0 :]

    def commit(self) -> str:
        sha256 = self._digest.hexdigest()
        with _os_errors("put", self._key):
            try:
                os.setxattr(self._file.fileno(), SHA256_XATTR, sha256.encode("ascii"))
            except OSError as exc:
                if exc.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
                    raise CheckpointError(
                        f"snapshot directory {str(self._final.parent)!r} does not support "
                        "user extended attributes"
                    ) from exc
                raise
            os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self._temp, self._final)
            self._committed = True
            _fsync_dir(self._final.parent)
        return sha256

    def discard(self) -> None:
        self._file.close()
        if not self._committed:
            self._temp.unlink(missing_ok=True)


async def _discard(writer: _TempWriter) -> None:
    await anyio.to_thread.run_sync(writer.discard)


def _open_snapshot(path: Path, key: str) -> tuple[FileIO, SnapshotInfo]:
    try:
        # O_NOFOLLOW: never read through a planted symlink; O_NONBLOCK: a FIFO
        # planted under the key cannot hang the worker thread in open().
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        raise SnapshotNotFoundError(f"no snapshot under {key!r}") from None
    except OSError as exc:
        raise CheckpointError(f"snapshot get of {key!r} failed: {_reason(exc)}") from exc
    try:
        info = _describe(fd, key)
    except BaseException:
        os.close(fd)
        raise
    return FileIO(fd, "rb"), info


def _describe(fd: int, key: str) -> SnapshotInfo:
    with _os_errors("get", key):
        status = os.fstat(fd)
        try:
            recorded = os.getxattr(fd, SHA256_XATTR).decode("ascii", "replace")
        except OSError as exc:
            if exc.errno not in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP):
                raise
            recorded = ""
    if not stat.S_ISREG(status.st_mode):
        raise CheckpointError(f"snapshot {key!r} is not a regular file")
    if not _is_sha256_hex(recorded):
        raise CheckpointError(f"snapshot {key!r} has no recorded sha256")
    return SnapshotInfo(key=key, size=status.st_size, sha256=recorded)


def _reader(file: FileIO, key: str) -> Callable[[int], bytes]:
    def read(size: int) -> bytes:
        with _os_errors("get", key):
            return file.read(size) or b""

    return read


def _delete(path: Path, key: str) -> None:
    with _os_errors("delete", key):
        try:
            path.unlink()
        except (FileNotFoundError, NotADirectoryError):
            return


def _is_file(path: Path, key: str) -> bool:
    with _os_errors("exists", key):
        try:
            return stat.S_ISREG(path.lstat().st_mode)
        except (FileNotFoundError, NotADirectoryError):
            return False


def _list(root: Path, prefix: str) -> list[SnapshotEntry]:
    head = prefix.rpartition("/")[0]
    start = root.joinpath(*head.split("/")) if head else root
    found: list[SnapshotEntry] = []
    with _os_errors("list", prefix):
        # os.walk skips what it cannot read (a missing start yields nothing).
        for directory, subdirs, files in os.walk(start, followlinks=False):
            here = Path(directory).relative_to(root).as_posix()
            base = "" if here == "." else here + "/"
            subdirs[:] = [
                name
                for name in subdirs
                if KEY_COMPONENT.fullmatch(name) and _may_hold(base + name + "/", prefix)
            ]
            for name in files:
                key = base + name
                if not KEY_COMPONENT.fullmatch(name) or not key.startswith(prefix):
                    continue
                try:
                    status = os.lstat(os.path.join(directory, name))
                except FileNotFoundError:
                    continue  # deleted while we looked
                if stat.S_ISREG(status.st_mode):
                    found.append(SnapshotEntry(key, status.st_size, status.st_mtime))
    return sorted(found, key=lambda entry: entry.key)


def _may_hold(directory_key: str, prefix: str) -> bool:
    """Whether keys under ``directory_key`` (ending in ``/``) can start with ``prefix``."""
    return directory_key.startswith(prefix) or prefix.startswith(directory_key)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _reason(exc: OSError) -> str:
    # strerror, not str(exc): the message names the key, not absolute host paths.
    return exc.strerror or type(exc).__name__


@contextmanager
def _os_errors(action: str, key: str) -> Iterator[None]:
    try:
        yield
    except CheckpointError:
        raise
    except OSError as exc:
        raise CheckpointError(f"snapshot {action} of {key!r} failed: {_reason(exc)}") from exc
