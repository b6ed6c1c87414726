"""Hostile archives are rejected, and nothing outside staging changes.

Each case builds tar bytes by hand (or with tarfile, for well-formed but
hostile members). The named cases run one by one; Hypothesis then mixes them
with benign members, both encodings and arbitrary chunking of the body.
"""

from __future__ import annotations

import re
import tarfile
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandcell_runner.checkpoint.compression import Encoding
from sandcell_runner.checkpoint.export import ArchiveLimits
from sandcell_runner.errors import ArchiveRejectedError
from tests.runner.checkpoint import (
    Arena,
    archive,
    compress,
    make_arena,
    member,
    restore_bytes,
    tar_with,
)

MiB = 1 << 20
SMALL = ArchiveLimits(max_bytes=1 * MiB, max_members=50)


@dataclass(frozen=True)
class Hostile:
    members: Callable[[Arena], list[bytes]]
    reason: str
    with_meta: bool = True
    end: bool = True
    trailer: bytes = b""
    limits: ArchiveLimits = field(default_factory=lambda: SMALL)

    def tar(self, arena: Arena, benign: list[bytes]) -> bytes:
        members = [*benign, *self.members(arena)]
        return archive(*members, with_meta=self.with_meta, end=self.end) + self.trailer


def pax_info(name: str, *, type_: bytes, pax: dict[str, str]) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = type_
    info.pax_headers = pax
    return info


def gnu_longname() -> bytes:
    info = tarfile.TarInfo("workspace/" + "n" * 150)
    info.size = 1
    return info.tobuf(tarfile.GNU_FORMAT, "utf-8", "strict") + b"x" + bytes(511)


def two_pax_headers() -> bytes:
    blocks = tar_with([(pax_info("workspace/f", type_=REG, pax={"mtime": "1.5"}), None)])
    pax, header = blocks[: 2 * tarfile.BLOCKSIZE], blocks[2 * tarfile.BLOCKSIZE : 1536]
    return pax + pax + header


def ustar_raw_name(raw: bytes) -> bytes:
    info = tarfile.TarInfo(raw.decode("utf-8", "surrogateescape"))
    info.size = 0
    return info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "surrogateescape")


def hopping_between_deep_branches() -> list[bytes]:
    """Files alternating between two branches 100 directories deep: each member leaves
    one branch and enters the other, 101 directories (O(depth) system calls a member)."""
    deep = "/".join(["d"] * 100)
    return [member(f"workspace/{branch}/{deep}/f{i}", b"") for i in range(50) for branch in "ab"]


DOTDOT = r"contains '\.\.'"
OUTSIDE = "points outside"
SYM, LNK, DIR, REG = tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.DIRTYPE, tarfile.REGTYPE

CASES: dict[str, Hostile] = {
    "traversal ../x": Hostile(lambda a: [member("../x", b"evil")], DOTDOT),
    "absolute /etc/x": Hostile(lambda a: [member("/etc/x", b"evil")], "absolute"),
    "absolute into the live workspace": Hostile(
        lambda a: [member(str(a.live / "x"), b"evil")], "absolute"
    ),
    "workspace/../../x": Hostile(lambda a: [member("workspace/../../x", b"evil")], DOTDOT),
    "workspace/../sentinel": Hostile(lambda a: [member("workspace/../sentinel", b"e")], DOTDOT),
    "member outside workspace/": Hostile(lambda a: [member("other/x", b"evil")], "outside"),
    "workspace-prefixed sibling": Hostile(lambda a: [member("workspacex/y", b"e")], "outside"),
    "symlink to /etc, then a file through it": Hostile(
        lambda a: [
            member("workspace/l", type_=SYM, linkname="/etc"),
            member("workspace/l/x", b"evil"),
        ],
        OUTSIDE,
    ),
    "symlink to the live workspace by absolute path": Hostile(
        lambda a: [
            member("workspace/l", type_=SYM, linkname=str(a.live)),
            member("workspace/l/x", b"evil"),
        ],
        OUTSIDE,
    ),
    "symlink ../../x, then a file through it": Hostile(
        lambda a: [
            member("workspace/l", type_=SYM, linkname="../../x"),
            member("workspace/l/x", b"evil"),
        ],
        OUTSIDE,
    ),
    "symlink ../live from the root": Hostile(
        lambda a: [member("workspace/l", type_=SYM, linkname="../live")], OUTSIDE
    ),
    "symlink climbing after a name": Hostile(
        lambda a: [
            member("workspace/d", type_=DIR, mode=0o755),
            member("workspace/d/l", type_=SYM, linkname="../d/../../live"),
        ],
        OUTSIDE,
    ),
    "file written through an inside symlink": Hostile(
        lambda a: [
            member("workspace/d", type_=DIR, mode=0o755),
            member("workspace/l", type_=SYM, linkname="d"),
            member("workspace/l/x", b"through the link"),
        ],
        "not a directory",
    ),
    "directory created through a symlink": Hostile(
        lambda a: [
            member("workspace/l", type_=SYM, linkname="."),
            member("workspace/l/sub", type_=DIR, mode=0o755),
        ],
        "not a directory",
    ),
    "hard link to /etc/passwd": Hostile(
        lambda a: [member("workspace/h", type_=LNK, linkname="/etc/passwd")], "hard links"
    ),
    "hard link out to the sentinel": Hostile(
        lambda a: [member("workspace/h", type_=LNK, linkname="../sentinel")], "hard links"
    ),
    "hard link inside": Hostile(
        lambda a: [
            member("workspace/f", b"data"),
            member("workspace/h", type_=LNK, linkname="workspace/f"),
        ],
        "hard links",
    ),
    "character device": Hostile(
        lambda a: [member("workspace/null", type_=tarfile.CHRTYPE)], "character devices"
    ),
    "block device": Hostile(
        lambda a: [member("workspace/sda", type_=tarfile.BLKTYPE)], "block devices"
    ),
    "FIFO": Hostile(lambda a: [member("workspace/pipe", type_=tarfile.FIFOTYPE)], "FIFOs"),
    "too many members": Hostile(
        lambda a: [member(f"workspace/f{i}", b"x") for i in range(60)], "more than 50 members"
    ),
    "duplicate member": Hostile(
        lambda a: [member("workspace/f", b"one"), member("workspace/f", b"two")], "duplicate"
    ),
    "duplicate root": Hostile(
        lambda a: [member("workspace", type_=DIR), member("workspace", type_=DIR)], "duplicate"
    ),
    "file then a directory of the same name": Hostile(
        lambda a: [member("workspace/f", b"one"), member("workspace/f/g", b"two")],
        "not a directory",
    ),
    "missing meta": Hostile(
        lambda a: [member("workspace/f", b"x")], "no .sandcell-checkpoint.json", with_meta=False
    ),
    "meta is not JSON": Hostile(
        lambda a: [member(".sandcell-checkpoint.json", b"{not json")],
        "invalid checkpoint metadata",
        with_meta=False,
    ),
    "meta has the wrong shape": Hostile(
        lambda a: [member(".sandcell-checkpoint.json", b'{"session_id": 1, "protocol": "1"}')],
        "invalid checkpoint metadata",
        with_meta=False,
    ),
    "meta is a directory": Hostile(
        lambda a: [member(".sandcell-checkpoint.json", type_=DIR)],
        "not a small regular file",
        with_meta=False,
    ),
    "second meta member": Hostile(
        lambda a: [member(".sandcell-checkpoint.json", b"{}")], "duplicate"
    ),
    "name not normalized": Hostile(lambda a: [member("workspace/a//b", b"x")], "normalized"),
    "name with a dot segment": Hostile(lambda a: [member("workspace/./a", b"x")], "normalized"),
    "name with a backslash": Hostile(lambda a: [member("workspace/a\\b", b"x")], "backslash"),
    "name not UTF-8": Hostile(lambda a: [ustar_raw_name(b"workspace/\xff\xfe")], "not UTF-8"),
    "global PAX header": Hostile(
        lambda a: [
            tarfile.TarInfo.create_pax_global_header({"path": "../../x"}),
            member("workspace/f", b"x"),
        ],
        "global PAX",
    ),
    "PAX record with an unknown key": Hostile(
        lambda a: [
            tar_with(
                [
                    (
                        pax_info(
                            "workspace/f",
                            type_=tarfile.REGTYPE,
                            pax={"SCHILY.xattr.security.capability": "x"},
                        ),
                        None,
                    )
                ]
            )[: 3 * tarfile.BLOCKSIZE]
        ],
        "unexpected PAX record",
    ),
    "PAX path escaping": Hostile(
        lambda a: [
            tar_with([(pax_info("workspace/ok", type_=REG, pax={"path": "../x"}), None)])[
                : 3 * tarfile.BLOCKSIZE
            ]
        ],
        DOTDOT,
    ),
    "two PAX headers in a row": Hostile(lambda a: [two_pax_headers()], "two PAX headers"),
    "PAX mtime that is not a number": Hostile(
        lambda a: [
            tar_with([(pax_info("workspace/f", type_=REG, pax={"mtime": "nan"}), None)])[:1536]
        ],
        "bad mtime",
    ),
    "oversized PAX header": Hostile(
        lambda a: [member("././@PaxHeader", b"9" * (64 << 10), type_=tarfile.XHDTYPE)],
        "PAX header too large",
    ),
    "GNU long name": Hostile(lambda a: [gnu_longname()], "unsupported member type"),
    "GNU sparse member": Hostile(
        lambda a: [member("workspace/s", type_=tarfile.GNUTYPE_SPARSE)], "sparse"
    ),
    "directory smuggling data": Hostile(
        lambda a: [
            member("workspace/d", member("workspace/../../x", b"e"), type_=DIR),
        ],
        "bad size",
    ),
    "bomb: one member past max_bytes": Hostile(
        lambda a: [member("workspace/zeros", bytes(4 * MiB))], "more than 1048576 bytes"
    ),
    "bomb: members adding up past max_bytes": Hostile(
        lambda a: [member(f"workspace/z{i}", bytes(MiB // 2)) for i in range(3)],
        "more than 1048576 bytes",
    ),
    "bomb: header size lies low, zeros follow": Hostile(
        lambda a: [member("workspace/f", b"0123456789") + bytes(8 * MiB)], "decompression bomb"
    ),
    "bomb: header size lies low, data follows": Hostile(
        lambda a: [member("workspace/f", b"0123456789") + b"A" * (8 * MiB)], "corrupt"
    ),
    "bomb: header size lies high": Hostile(
        lambda a: [member("workspace/f", b"short", size=512 * 1024)], "end of data", end=False
    ),
    "bomb: hopping between deep branches": Hostile(
        lambda a: hopping_between_deep_branches(),
        "re-enters directories too often",
        limits=ArchiveLimits(max_bytes=MiB, max_members=1000),
    ),
    "truncated: no end-of-archive marker": Hostile(
        lambda a: [member("workspace/f", b"x")], "truncated", end=False
    ),
    "data after the end-of-archive marker": Hostile(
        lambda a: [member("workspace/f", b"x")],
        "after the end-of-archive marker",
        trailer=member("workspace/late", b"smuggled"),
    ),
}

ENCODINGS: list[Encoding] = ["gzip", "zstd"]


async def assert_rejected(
    arena: Arena, data: bytes, *, encoding: Encoding, reason: str, limits: ArchiveLimits, **kw: int
) -> None:
    before = arena.snapshot()
    with pytest.raises(ArchiveRejectedError) as caught:
        await restore_bytes(data, arena.staging, encoding=encoding, limits=limits, **kw)
    assert re.search(reason, str(caught.value)), str(caught.value)
    assert arena.snapshot() == before
    assert arena.sentinel.read_bytes() == b"do not touch\n"


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("case", sorted(CASES))
async def test_hostile_archive_is_rejected(arena: Arena, case: str, encoding: Encoding) -> None:
    """Each named attack fails with its reason; the live workspace and sentinel are untouched."""
    hostile = CASES[case]
    data = compress(hostile.tar(arena, []), encoding)
    await assert_rejected(
        arena, data, encoding=encoding, reason=hostile.reason, limits=hostile.limits
    )


benign_members = st.lists(
    st.tuples(
        st.text(alphabet="abcdefgh-_.", min_size=1, max_size=12).filter(
            lambda s: s not in (".", "..")
        ),
        st.binary(max_size=3000),
    ),
    max_size=4,
    unique_by=lambda item: item[0],
)


@settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    case=st.sampled_from(sorted(CASES)),
    encoding=st.sampled_from(ENCODINGS),
    benign=benign_members,
    chunk_bytes=st.integers(min_value=1, max_value=200_000),
)
def test_hostile_archives_with_benign_company(
    case: str, encoding: Encoding, benign: list[tuple[str, bytes]], chunk_bytes: int
) -> None:
    """Benign members ahead of an attack neither hide it nor get it past the checks."""
    hostile = CASES[case]
    prefix = [member(f"workspace/benign/{name}", data) for name, data in benign]
    if prefix:
        prefix.insert(0, member("workspace/benign", type_=DIR, mode=0o755))

    async def scenario() -> None:
        with make_arena() as arena:
            data = compress(hostile.tar(arena, prefix), encoding)
            await assert_rejected(
                arena,
                data,
                encoding=encoding,
                reason=hostile.reason,
                limits=hostile.limits,
                chunk_bytes=min(chunk_bytes, len(data)),
            )

    anyio.run(scenario)
