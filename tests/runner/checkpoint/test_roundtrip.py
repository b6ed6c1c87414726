"""A checkpoint exported from one workspace and restored into a fresh one continues the session."""

from __future__ import annotations

import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from sandcell_runner.checkpoint.compression import Encoding
from sandcell_runner.checkpoint.export import ArchiveLimits, export_checkpoint, stream_checkpoint
from sandcell_runner.checkpoint.restore import restore_checkpoint
from tests.runner.checkpoint import GID, META, UID, Arena, chunked, snapshot_tree

MTIME_NS = 1_600_000_000_123_456_789


def build_tree(root: Path) -> None:
    """Nested and empty dirs, exec bits, setuid, unicode, symlinks, a hard link, odd mtimes."""
    (root / "a" / "b" / "c").mkdir(parents=True)
    (root / "empty" / "nested-empty").mkdir(parents=True)
    (root / "ünïcødé ✓" / "目录").mkdir(parents=True)
    files = {
        "a/b/c/deep.txt": (b"deep\n", 0o644),
        "run.sh": (b"#!/bin/sh\necho hi\n", 0o755),
        "secret": (b"s3cret", 0o600),
        "setuid-tool": (b"\x7fELF pretend", 0o4755),
        "setgid-tool": (b"sg", 0o2750),
        "empty-file": (b"", 0o640),
        "ünïcødé ✓/目录/ファイル.txt": ("héllo wörld".encode(), 0o644),
        "with space and\nnewline": (b"odd name", 0o644),
        "big.bin": (os.urandom(3 << 20) + bytes(1 << 20), 0o644),
        "ro/inside.txt": (b"in a read-only dir", 0o444),
    }
    (root / "ro").mkdir()
    for relpath, (data, mode) in files.items():
        path = root / relpath
        path.write_bytes(data)
        os.chmod(path, mode)
    os.link(root / "run.sh", root / "hard-link-to-run.sh")
    os.symlink("b/c/deep.txt", root / "a" / "to-deep")
    os.symlink("../../run.sh", root / "a" / "b" / "up-to-run")
    os.symlink("nowhere", root / "dangling")
    os.symlink("a", root / "dir-link")
    os.symlink(".", root / "a" / "self")
    os.chmod(root / "ro", 0o555)
    os.chmod(root / "empty", 0o1777)
    stamp_mtimes(root)


def stamp_mtimes(root: Path) -> None:
    """Distinct nanosecond mtimes everywhere; directories last, deepest first."""
    entries = sorted(root.rglob("*"), key=lambda p: len(p.parts), reverse=True)
    for index, path in enumerate(p for p in entries if not p.is_dir() or p.is_symlink()):
        ns = MTIME_NS + index * 1_000_003
        os.utime(path, ns=(ns, ns), follow_symlinks=False)
    for index, path in enumerate(p for p in entries if p.is_dir() and not p.is_symlink()):
        ns = MTIME_NS - (index + 1) * 7_000_001
        os.utime(path, ns=(ns, ns))
    os.utime(root, ns=(MTIME_NS - 1, MTIME_NS - 1))


def expected_after_restore(source: Path) -> dict[str, tuple[object, ...]]:
    """The source's snapshot as a restore must reproduce it: UID-owned, no special bits."""
    expected = {}
    for relpath, (kind, mode, _uid, _gid, size, mtime_ns, content) in snapshot_tree(source).items():
        kept = mode if kind == stat.S_IFLNK else mode & 0o777
        expected[relpath] = (kind, kept, UID, GID, size, mtime_ns, content)
    return expected


async def export_chunks(
    workspace: Path, *, encoding: Encoding, api: str, limits: ArchiveLimits
) -> AsyncIterator[bytes]:
    if api == "async":
        async for chunk in stream_checkpoint(workspace, META, encoding=encoding, limits=limits):
            yield chunk
    else:
        data = b"".join(export_checkpoint(workspace, META, encoding=encoding, limits=limits))
        async for chunk in chunked(data, 50_000):
            yield chunk


@pytest.mark.parametrize("encoding", ["gzip", "zstd"])
@pytest.mark.parametrize("api", ["sync", "async"])
async def test_round_trip_preserves_the_workspace(
    arena: Arena, tmp_path: Path, encoding: Encoding, api: str
) -> None:
    """Files, modes less setuid/setgid/sticky, symlinks, empty dirs and ns mtimes survive."""
    source = tmp_path / "source"
    source.mkdir()
    build_tree(source)
    limits = ArchiveLimits()

    meta = await restore_checkpoint(
        export_chunks(source, encoding=encoding, api=api, limits=limits),
        arena.staging,
        uid=UID,
        gid=GID,
        encoding=encoding,
        limits=limits,
        expected_sha256=None,
    )

    assert meta == META
    assert snapshot_tree(arena.staging) == expected_after_restore(source)
    root = arena.staging.lstat()
    assert (stat.S_IMODE(root.st_mode), root.st_mtime_ns) == (
        stat.S_IMODE(source.lstat().st_mode),
        MTIME_NS - 1,
    )
    assert os.readlink(arena.staging / "a" / "b" / "up-to-run") == "../../run.sh"
    assert stat.S_IMODE((arena.staging / "setuid-tool").lstat().st_mode) == 0o755
    assert stat.S_IMODE((arena.staging / "empty").lstat().st_mode) == 0o777
    hard = arena.staging / "hard-link-to-run.sh"
    assert hard.lstat().st_ino != (arena.staging / "run.sh").lstat().st_ino  # stored as a copy


async def test_restored_entries_belong_to_the_pinned_uid(arena: Arena, tmp_path: Path) -> None:
    """Every restored entry, the staging root included, is owned by uid:gid, not root."""
    source = tmp_path / "source"
    source.mkdir()
    build_tree(source)
    data = b"".join(export_checkpoint(source, META, encoding="zstd", limits=ArchiveLimits()))

    await restore_checkpoint(
        chunked(data),
        arena.staging,
        uid=UID,
        gid=GID,
        encoding="zstd",
        limits=ArchiveLimits(),
        expected_sha256=None,
    )

    owners = {
        (path.lstat().st_uid, path.lstat().st_gid)
        for path in [arena.staging, *arena.staging.rglob("*")]
    }
    assert owners == {(UID, GID)}


async def test_restore_returns_the_exported_metadata(arena: Arena, tmp_path: Path) -> None:
    """The meta member round-trips, with ``skipped`` filled by the exporter."""
    source = tmp_path / "source"
    source.mkdir()
    os.mkfifo(source / "pipe")
    meta = msgspec.structs.replace(META, skipped=["stale entry the caller passed"])
    data = b"".join(export_checkpoint(source, meta, encoding="gzip", limits=ArchiveLimits()))

    restored = await restore_checkpoint(
        chunked(data),
        arena.staging,
        uid=UID,
        gid=GID,
        encoding="gzip",
        limits=ArchiveLimits(),
        expected_sha256=None,
    )

    assert restored == msgspec.structs.replace(META, skipped=["pipe"])
    assert list(arena.staging.iterdir()) == []
