"""The small rules under export and restore, checked directly."""

from __future__ import annotations

import io
import os
import posixpath
import tarfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sandcell_runner.checkpoint.archive_rules import (
    StrictTarInfo,
    parse_pax_records,
    symlink_target_inside,
)
from sandcell_runner.checkpoint.compression import choose_encoding
from sandcell_runner.checkpoint.export import ArchiveLimits, export_checkpoint, format_mtime_ns
from sandcell_runner.errors import ArchiveRejectedError
from tests.runner.checkpoint import META, Arena, chunked, restore_bytes


@pytest.mark.parametrize(
    ("relpath", "target", "inside"),
    [
        ("l", "a/b", True),
        ("l", ".", True),
        ("a/l", "..", True),
        ("a/b/l", "../../x", True),
        ("a/b/l", "../../../x", False),
        ("l", "../x", False),
        ("l", "/etc", False),
        ("l", "", False),
        ("a/l", "b/../..", False),  # '..' after a name: refused even though it normalizes inside
        ("a/l", "./../x", True),
        ("a/l", "x/../y", False),
        ("l", "a\x00b", False),
    ],
)
def test_symlink_target_inside(relpath: str, target: str, inside: bool) -> None:
    """Leading '..' only, never deeper than the link; no absolute or empty targets."""
    assert symlink_target_inside(relpath, target) is inside


@given(
    depth=st.integers(min_value=0, max_value=4),
    parts=st.lists(st.sampled_from(["..", ".", "a", ""]), max_size=8),
)
def test_accepted_targets_normalize_inside(depth: int, parts: list[str]) -> None:
    """Anything accepted also stays inside by plain lexical normalisation."""
    relpath = "/".join(["d"] * depth + ["l"])
    target = "/".join(parts)
    if symlink_target_inside(relpath, target):
        resolved = posixpath.normpath(posixpath.join(posixpath.dirname(relpath), target))
        assert resolved != ".."
        assert not resolved.startswith("../")


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (None, "gzip"),
        ("", "gzip"),
        ("gzip, deflate", "gzip"),
        ("zstd", "zstd"),
        ("gzip;q=1.0, ZSTD;q=0.5", "zstd"),
        ("zstd;q=0", "gzip"),
        ("zstd;q=0.000", "gzip"),
        ("zstd;q=oops", "gzip"),
        ("x-zstd", "gzip"),
    ],
)
def test_choose_encoding(header: str | None, expected: str) -> None:
    """zstd only when Accept-Encoding names it with a non-zero q-value."""
    assert choose_encoding(header) == expected


def test_pax_records_parse_strictly() -> None:
    """Well-formed records parse; anything malformed or unexpected is refused."""
    assert parse_pax_records(b"16 path=a/b/c.d\n21 mtime=1.500000000\n") == {
        "path": "a/b/c.d",
        "mtime": "1.500000000",
    }
    for bad in (
        b"15 path=a/b/c.d\n",  # length too short: record does not end in a newline
        b"99 path=a\n",  # overruns the header
        b"016 path=a/b/c.d\n",  # leading zero
        b"x path=a\n",
        b"12 uid=1000\n",  # keys outside the whitelist
        b"21 hdrcharset=BINARY\n",
        b"9 path=a\n9 path=b\n",  # duplicate key
        b"10 path=\xff\n",
    ):
        with pytest.raises(ArchiveRejectedError):
            parse_pax_records(bad)


def test_mtime_format() -> None:
    """Nine fractional digits; the sign applies to the whole value."""
    assert format_mtime_ns(1_500_000_000) == "1.500000000"
    assert format_mtime_ns(-1_500_000_000) == "-1.500000000"
    assert format_mtime_ns(0) == "0.000000000"


@pytest.mark.parametrize("mtime_ns", [-1_500_000_001, 0, 1, 10_000_000_000_000_000_001])
async def test_extreme_mtimes_round_trip(arena: Arena, tmp_path: Path, mtime_ns: int) -> None:
    """Pre-1970 and past-ustar-range mtimes survive to the nanosecond."""
    (tmp_path / "f").write_bytes(b"x")
    os.utime(tmp_path / "f", ns=(mtime_ns, mtime_ns))
    data = b"".join(export_checkpoint(tmp_path, META, encoding="gzip", limits=ArchiveLimits()))

    await restore_bytes(data, arena.staging, encoding="gzip")

    assert (arena.staging / "f").lstat().st_mtime_ns == mtime_ns


def test_archive_limits_validate() -> None:
    with pytest.raises(ValueError, match="max_members"):
        ArchiveLimits(max_members=1)
    with pytest.raises(ValueError, match="max_bytes"):
        ArchiveLimits(max_bytes=-1)


async def test_exported_chunks_restore_in_any_split(arena: Arena, tmp_path: Path) -> None:
    """Chunk boundaries in the body carry no meaning (one byte at a time works)."""
    (tmp_path / "f").write_bytes(b"hello")
    data = b"".join(export_checkpoint(tmp_path, META, encoding="zstd", limits=ArchiveLimits()))
    assert len(data) < 4096
    await restore_bytes(data, arena.staging, encoding="zstd", chunk_bytes=1)

    assert (arena.staging / "f").read_bytes() == b"hello"
    assert [chunk async for chunk in chunked(b"abc", 1)] == [b"a", b"b", b"c"]


def _pax_member_blocks(name: str, mtime: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = size
    info.pax_headers = {"mtime": mtime}
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "strict")


@given(
    name=st.from_regex(r"workspace/[a-z0-9_./-]{1,300}", fullmatch=True),
    seconds=st.integers(min_value=0, max_value=10**10),
    fraction=st.integers(min_value=0, max_value=999_999_999),
    size=st.integers(min_value=0, max_value=2**33),
)
def test_pax_member_headers_parse_like_tarfile(
    name: str, seconds: int, fraction: int, size: int
) -> None:
    """The PAX header block's own fields are read without tarfile; the member matches it."""
    blocks = _pax_member_blocks(name, f"{seconds}.{fraction:09d}", size)
    stream = io.BytesIO(blocks)
    member = StrictTarInfo.next_member(stream.read)
    expected = tarfile.TarFile(fileobj=io.BytesIO(blocks + bytes(1024))).next()
    assert member is not None
    assert expected is not None
    assert (member.name, member.size) == (expected.name, expected.size)
    assert member.pax_headers["mtime"] == expected.pax_headers["mtime"]


@given(offset=st.integers(min_value=0, max_value=511), flip=st.integers(min_value=1, max_value=255))
def test_a_corrupt_pax_header_block_is_refused(offset: int, flip: int) -> None:
    """Any changed byte of a PAX header block fails its checksum (or its size) check."""
    blocks = bytearray(_pax_member_blocks("workspace/f", "1.5", 10))
    if 148 <= offset < 156 or offset == 156:
        offset = 0  # the checksum field and the type flag are checked on their own
    blocks[offset] ^= flip
    with pytest.raises(ArchiveRejectedError):
        StrictTarInfo.next_member(io.BytesIO(bytes(blocks)).read)
