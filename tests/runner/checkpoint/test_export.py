"""Export: archive layout, what is skipped and listed, limits enforced before streaming."""

from __future__ import annotations

import io
import os
import stat
import subprocess
import tarfile
import time
import zlib
from pathlib import Path

import msgspec
import pytest
import zstandard

from sandcell_protocol import CheckpointMeta, decode
from sandcell_runner.checkpoint.compression import Encoding
from sandcell_runner.checkpoint.export import ArchiveLimits, export_checkpoint, stream_checkpoint
from sandcell_runner.checkpoint.skipped import MAX_SKIPPED_LISTED_CHARS
from sandcell_runner.errors import ArchiveRejectedError
from tests.runner.checkpoint import META

TiB = 1 << 40


def export(workspace: Path, *, encoding: Encoding = "gzip", **limits: int) -> bytes:
    return b"".join(
        export_checkpoint(workspace, META, encoding=encoding, limits=ArchiveLimits(**limits))
    )


def members(data: bytes, encoding: Encoding = "gzip") -> list[tarfile.TarInfo]:
    raw = (
        zlib.decompress(data, 31)
        if encoding == "gzip"
        else zstandard.ZstdDecompressor().decompressobj().decompress(data)
    )
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tar:
        return tar.getmembers()


def exported_meta(data: bytes) -> CheckpointMeta:
    with tarfile.open(fileobj=io.BytesIO(zlib.decompress(data, 31)), mode="r:") as tar:
        first = tar.extractfile(tar.getmembers()[0])
        assert first is not None
        return decode(first.read(), CheckpointMeta)


@pytest.mark.parametrize("encoding", ["gzip", "zstd"])
def test_archive_layout(tmp_path: Path, encoding: Encoding) -> None:
    """Meta first, then the root, parents before children; owners zeroed, special bits gone."""
    (tmp_path / "b" / "c").mkdir(parents=True)
    (tmp_path / "b" / "c" / "f").write_bytes(b"x")
    (tmp_path / "a").write_bytes(b"y")
    os.chmod(tmp_path / "a", 0o6755)
    os.chown(tmp_path / "a", 1234, 5678)

    infos = members(export(tmp_path, encoding=encoding), encoding)

    assert [info.name for info in infos] == [
        ".sandcell-checkpoint.json",
        "workspace",
        "workspace/a",
        "workspace/b",
        "workspace/b/c",
        "workspace/b/c/f",
    ]
    assert {(i.uid, i.gid, i.uname, i.gname) for i in infos} == {(0, 0, "", "")}
    assert all(info.mode & 0o7000 == 0 for info in infos)
    assert infos[2].mode == 0o755


def test_gnu_tar_reads_the_archive(tmp_path: Path) -> None:
    """The archive is plain PAX tar in gzip: operators can inspect it with standard tools."""
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "ünï.txt").write_bytes(b"hello")
    archive_path = tmp_path / "ckpt.tar.gz"
    archive_path.write_bytes(export(tmp_path / "ws"))

    listing = subprocess.run(
        ["tar", "-tzf", str(archive_path)], check=True, capture_output=True, text=True
    ).stdout.split()

    assert listing == [".sandcell-checkpoint.json", "workspace/", "workspace/ünï.txt"]


def test_special_files_are_skipped_and_listed(tmp_path: Path) -> None:
    """FIFOs, sockets and devices are left out and named in meta.skipped."""
    (tmp_path / "sub").mkdir()
    os.mkfifo(tmp_path / "sub" / "fifo")
    os.mknod(tmp_path / "sock", stat.S_IFSOCK | 0o600)
    expected = ["sock", "sub/fifo"]
    try:
        os.mknod(tmp_path / "null", stat.S_IFCHR | 0o600, os.makedev(1, 3))
        expected.insert(0, "null")
    except PermissionError:
        pass  # a container without CAP_MKNOD: FIFOs and sockets still cover the path
    (tmp_path / "regular").write_bytes(b"kept")

    data = export(tmp_path)

    assert exported_meta(data).skipped == expected
    assert [i.name for i in members(data)][2:] == ["workspace/regular", "workspace/sub"]


def test_symlinks_a_restore_would_refuse_are_skipped_and_listed(tmp_path: Path) -> None:
    """Absolute and escaping links are listed; inside links are stored, never followed."""
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "file").write_bytes(b"once")
    os.symlink("/usr/bin/python3", tmp_path / "abs")
    os.symlink("../outside", tmp_path / "escape")
    os.symlink("dir", tmp_path / "inside")
    os.symlink("/etc", tmp_path / "etc-link")

    data = export(tmp_path)

    assert exported_meta(data).skipped == ["abs", "escape", "etc-link"]
    by_name = {info.name: info for info in members(data)}
    assert by_name["workspace/inside"].issym()
    assert by_name["workspace/inside"].linkname == "dir"
    assert "workspace/inside/file" not in by_name
    assert not any(name.startswith("workspace/etc-link/") for name in by_name)


def test_many_skipped_entries_with_long_paths_are_counted_past_the_first(tmp_path: Path) -> None:
    """10,000 links out of the workspace at 3,700-character paths: the meta names the first
    of them (``MAX_SKIPPED_LISTED_CHARS``) and counts the rest, and the checkpoint is
    made. The whole list (37 MB) was held in the runner's memory and put the meta past
    its 32 MiB cap: the checkpoint was refused, so a snapshot or pause was a 500."""
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(14):
            os.mkdir("d" * 250, dir_fd=fd)
            inner = os.open("d" * 250, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = inner
        for i in range(10_000):
            os.symlink("/etc", f"{i:0240d}", dir_fd=fd)
        os.mkfifo("fifo", dir_fd=fd)
    finally:
        os.close(fd)
    (tmp_path / "kept.txt").write_bytes(b"kept")

    data = export(tmp_path)

    skipped = exported_meta(data).skipped
    named = skipped[:-1]
    assert sum(map(len, named)) <= MAX_SKIPPED_LISTED_CHARS
    assert named == sorted(named)
    assert named[0] == "/".join(["d" * 250] * 14 + [f"{0:0240d}"])
    assert skipped[-1] == f"(and {10_001 - len(named)} more entries not listed)"
    assert "workspace/kept.txt" in [info.name for info in members(data)]


def test_names_that_are_not_workspace_paths_are_skipped(tmp_path: Path) -> None:
    """A backslash or undecodable bytes in a name cost that entry, not the checkpoint."""
    os.mkdir(tmp_path / "back\\slash")
    (tmp_path / "back\\slash" / "inner").write_bytes(b"x")
    (Path(os.fsdecode(bytes(tmp_path) + b"/bad-\xff"))).write_bytes(b"y")
    (tmp_path / "fine").write_bytes(b"z")

    data = export(tmp_path)

    assert exported_meta(data).skipped == ["back\\slash", "bad-\\xff"]
    assert [i.name for i in members(data)][2:] == ["workspace/fine"]


def test_sparse_terabyte_fails_fast_before_streaming(tmp_path: Path) -> None:
    """A `truncate -s 1T` file is counted by apparent size: rejected before the first chunk."""
    with open(tmp_path / "huge", "wb") as huge:
        huge.truncate(TiB)
    chunks = export_checkpoint(tmp_path, META, encoding="zstd", limits=ArchiveLimits())

    started = time.monotonic()
    with pytest.raises(ArchiveRejectedError, match="more than 1073741824 bytes"):
        next(chunks)
    assert time.monotonic() - started < 5


async def test_sparse_terabyte_fails_fast_through_the_async_stream(tmp_path: Path) -> None:
    """The async wrapper surfaces the same rejection from its worker thread."""
    with open(tmp_path / "huge", "wb") as huge:
        huge.truncate(TiB)
    stream = stream_checkpoint(tmp_path, META, encoding="gzip", limits=ArchiveLimits())

    with pytest.raises(ArchiveRejectedError, match="more than"):
        await stream.__anext__()


def test_too_many_entries_is_rejected(tmp_path: Path) -> None:
    """max_members counts the meta member and the root too."""
    for index in range(9):
        (tmp_path / f"f{index}").write_bytes(b"")

    with pytest.raises(ArchiveRejectedError, match="more than 10 entries"):
        export(tmp_path, max_members=10)
    assert len(members(export(tmp_path, max_members=11))) == 11


def test_workspace_must_be_a_real_directory(tmp_path: Path) -> None:
    """A workspace path that is a symlink is refused, not followed."""
    (tmp_path / "real").mkdir()
    os.symlink("real", tmp_path / "link")

    with pytest.raises(ArchiveRejectedError, match="not a directory"):
        export(tmp_path / "link")


@pytest.mark.parametrize("encoding", ["gzip", "zstd"])
async def test_chunks_are_bounded_and_streamed(tmp_path: Path, encoding: Encoding) -> None:
    """Incompressible data comes out as many chunks of at most 256 KiB, not one blob."""
    (tmp_path / "noise").write_bytes(os.urandom(6 << 20))

    sizes = [
        len(chunk)
        async for chunk in stream_checkpoint(
            tmp_path, META, encoding=encoding, limits=ArchiveLimits()
        )
    ]

    assert len(sizes) > 10
    assert max(sizes) <= 256 << 10


async def test_abandoned_stream_releases_its_descriptors(tmp_path: Path) -> None:
    """Closing the async stream part-way closes every directory and file it held open."""
    deep = tmp_path.joinpath(*[f"d{i}" for i in range(20)])
    deep.mkdir(parents=True)
    (deep / "noise").write_bytes(os.urandom(4 << 20))
    before = len(os.listdir("/proc/self/fd"))
    stream = stream_checkpoint(tmp_path, META, encoding="gzip", limits=ArchiveLimits())

    await stream.__anext__()
    assert len(os.listdir("/proc/self/fd")) > before
    await stream.aclose()

    assert len(os.listdir("/proc/self/fd")) == before


def test_meta_skipped_is_replaced_not_appended(tmp_path: Path) -> None:
    """``skipped`` describes this export only."""
    meta = msgspec.structs.replace(META, skipped=["from an older export"])
    data = b"".join(export_checkpoint(tmp_path, meta, encoding="gzip", limits=ArchiveLimits()))

    assert exported_meta(data).skipped == []
