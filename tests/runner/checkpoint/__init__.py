"""Helpers for checkpoint archive tests: an arena on disk, hand-built tar bytes, restore calls."""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shutil
import stat
import tarfile
import zlib
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import zstandard

from sandcell_protocol import PROTOCOL_VERSION, CheckpointMeta, encode
from sandcell_protocol.routes import CHECKPOINT_META_MEMBER
from sandcell_runner.checkpoint.compression import Encoding
from sandcell_runner.checkpoint.export import ArchiveLimits
from sandcell_runner.checkpoint.restore import restore_checkpoint
from tests.fixtures.paths import traversable_dir

UID = 1500
GID = 1500
META = CheckpointMeta(session_id="rt_" + "ab" * 32, protocol=PROTOCOL_VERSION)
EXTRACTOR_MODULE = "sandcell_runner.checkpoint.extractor_server"

Snapshot = dict[str, tuple[object, ...]]


@dataclass(frozen=True)
class Arena:
    """A world-writable directory holding staging, a live workspace and a sentinel.

    World-writable on purpose: if an extractor running as ``UID`` escaped
    staging, its writes here would succeed and the snapshot would show them.
    """

    root: Path
    staging: Path
    live: Path
    sentinel: Path

    def snapshot(self) -> Snapshot:
        """Everything under the arena except staging, by lstat and content."""
        return snapshot_tree(self.root, exclude=self.staging)


@contextlib.contextmanager
def make_arena() -> Iterator[Arena]:
    with traversable_dir(prefix="archive-") as root:
        os.chmod(root, 0o777)
        staging = root / "staging"
        staging.mkdir(mode=0o700)
        os.chown(staging, UID, GID)
        live = root / "live"
        (live / "sub").mkdir(parents=True)
        (live / "sub" / "data.txt").write_bytes(b"live workspace data\n")
        (live / "x").write_bytes(b"live x\n")
        os.symlink("sub/data.txt", live / "link")
        for path in (live, live / "sub", live / "sub" / "data.txt", live / "x"):
            os.chmod(path, 0o777 if path.is_dir() else 0o666)
        sentinel = root / "sentinel"
        sentinel.write_bytes(b"do not touch\n")
        os.chmod(sentinel, 0o666)
        yield Arena(root=root, staging=staging, live=live, sentinel=sentinel)


def snapshot_tree(root: Path, *, exclude: Path | None = None) -> Snapshot:
    """Map relpath -> (type, mode, uid, gid, size, mtime_ns, content digest or link target)."""
    found: Snapshot = {}
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        if exclude is not None and here == exclude:
            dirnames.clear()
            continue
        for name in sorted(dirnames + filenames):
            path = here / name
            if exclude is not None and path == exclude:
                continue
            st = path.lstat()
            if stat.S_ISLNK(st.st_mode):
                content: object = os.readlink(path)
            elif stat.S_ISREG(st.st_mode):
                content = hashlib.sha256(path.read_bytes()).hexdigest()
            else:
                content = None
            size = st.st_size if not stat.S_ISDIR(st.st_mode) else 0
            found[str(path.relative_to(root))] = (
                stat.S_IFMT(st.st_mode),
                stat.S_IMODE(st.st_mode),
                st.st_uid,
                st.st_gid,
                size,
                st.st_mtime_ns,
                content,
            )
    return found


def compress(data: bytes, encoding: Encoding) -> bytes:
    if encoding == "gzip":
        packer = zlib.compressobj(6, zlib.DEFLATED, 31)
        return packer.compress(data) + packer.flush()
    return zstandard.ZstdCompressor(write_checksum=True).compress(data)


def member(
    name: str,
    data: bytes = b"",
    *,
    type_: bytes = tarfile.REGTYPE,
    mode: int = 0o644,
    linkname: str = "",
    size: int | None = None,
    mtime: int = 1_700_000_000,
) -> bytes:
    """One raw tar member; ``size`` may lie about ``data``."""
    info = tarfile.TarInfo(name)
    info.type = type_
    info.mode = mode
    info.linkname = linkname
    info.mtime = mtime
    info.size = len(data) if size is None else size
    if type_ in (tarfile.CHRTYPE, tarfile.BLKTYPE):
        info.devmajor, info.devminor = 1, 3
    header = info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")
    return header + data + bytes(-len(data) % tarfile.BLOCKSIZE)


def meta_member(meta: CheckpointMeta = META) -> bytes:
    return member(CHECKPOINT_META_MEMBER, encode(meta))


def archive(*members: bytes, with_meta: bool = True, end: bool = True) -> bytes:
    """Raw tar bytes: the meta member first (unless told not), then ``members``."""
    body = (meta_member() if with_meta else b"") + b"".join(members)
    if end:
        body += bytes(2 * tarfile.BLOCKSIZE)
        body += bytes(-len(body) % tarfile.RECORDSIZE)
    return body


def tar_with(members: Iterable[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    """A tar written by tarfile itself, for well-formed but hostile members."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return out.getvalue()


async def chunked(data: bytes, chunk_bytes: int = 64 << 10) -> AsyncIterator[bytes]:
    for start in range(0, len(data), chunk_bytes):
        yield data[start : start + chunk_bytes]


async def restore_bytes(
    data: bytes,
    staging: Path,
    *,
    encoding: Encoding,
    limits: ArchiveLimits | None = None,
    expected_sha256: str | None = None,
    chunk_bytes: int = 64 << 10,
) -> CheckpointMeta:
    return await restore_checkpoint(
        chunked(data, chunk_bytes),
        staging,
        uid=UID,
        gid=GID,
        encoding=encoding,
        limits=limits or ArchiveLimits(),
        expected_sha256=expected_sha256,
    )


def reset_staging(staging: Path) -> None:
    shutil.rmtree(staging)
    staging.mkdir(mode=0o700)
    os.chown(staging, UID, GID)


def own_extractor_servers() -> list[psutil.Process]:
    """The extractor fork servers this test process started, and only those.

    Not ``children(recursive=True)``: runners that session-scoped fixtures started
    are children too, and their servers (same command line) are grandchildren
    that have nothing to do with the test.
    """
    found: list[psutil.Process] = []
    for child in psutil.Process().children():
        try:
            if EXTRACTOR_MODULE in " ".join(child.cmdline()):
                found.append(child)
        except psutil.NoSuchProcess:
            continue  # exited (or a zombie, whose command line is gone) since listed
    return found


def own_extractors() -> list[psutil.Process]:
    """The extractor children (one per restore) of the servers this test process started."""
    found: list[psutil.Process] = []
    for server in own_extractor_servers():
        with contextlib.suppress(psutil.NoSuchProcess):
            found += server.children()
    return found
