"""The extractor's own walk of the tar stream: data and padding land exactly, PAX sizes count."""

from __future__ import annotations

import os
import tarfile

import pytest

from sandcell_runner.checkpoint.compression import Encoding
from tests.runner.checkpoint import Arena, archive, compress, member, restore_bytes

MiB = 1 << 20
ENCODINGS: list[Encoding] = ["gzip", "zstd"]
# Around block and copy-chunk boundaries (512 bytes, 1 MiB reads and buffers).
SIZES = [0, 1, 511, 512, 513, MiB - 1, MiB, MiB + 1, 3 * MiB - 7]


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("chunk_bytes", [777, 256 << 10])
async def test_member_data_and_padding_land_exactly(
    arena: Arena, encoding: Encoding, chunk_bytes: int
) -> None:
    """Files of awkward sizes, back to back, restore byte for byte whatever the body's chunking."""
    blobs = {f"f{size}": os.urandom(size) for size in SIZES}
    members = [member(f"workspace/{name}", data) for name, data in blobs.items()]
    data = compress(archive(*members), encoding)

    await restore_bytes(data, arena.staging, encoding=encoding, chunk_bytes=chunk_bytes)

    for name, blob in blobs.items():
        assert (arena.staging / name).read_bytes() == blob, name


@pytest.mark.parametrize("encoding", ENCODINGS)
async def test_pax_size_record_overrides_the_header(arena: Arena, encoding: Encoding) -> None:
    """A PAX ``size`` record (how tar writes files past 8 GiB) decides how much data is read."""
    info = tarfile.TarInfo("workspace/big")
    info.size = 0  # the ustar field; the record below says 3
    info.pax_headers = {"size": "3"}
    header = info.tobuf(tarfile.PAX_FORMAT, "utf-8", "strict")
    plain = tarfile.TarInfo.frombuf(header[-tarfile.BLOCKSIZE :], "utf-8", "strict")
    assert plain.size == 0
    raw = header + b"abc" + bytes(tarfile.BLOCKSIZE - 3)
    data = compress(archive(raw, member("workspace/after", b"next")), encoding)

    await restore_bytes(data, arena.staging, encoding=encoding)

    assert (arena.staging / "big").read_bytes() == b"abc"
    assert (arena.staging / "after").read_bytes() == b"next"
