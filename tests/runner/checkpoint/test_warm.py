"""The started-ahead extractor: one child per restore, replaced after use, nothing shared."""

from __future__ import annotations

import os
import tarfile
import time
from collections.abc import AsyncIterator

import anyio
import psutil
import pytest

from sandcell_runner.checkpoint.export import ArchiveLimits
from sandcell_runner.checkpoint.extractor_process import ExtractorProcess, WarmExtractor
from sandcell_runner.checkpoint.restore import restore_checkpoint
from sandcell_runner.errors import ArchiveRejectedError
from tests.runner.checkpoint import (
    GID,
    UID,
    Arena,
    archive,
    chunked,
    compress,
    member,
    own_extractors,
    reset_staging,
)


class RecordingWarm(WarmExtractor):
    """A ``WarmExtractor`` that remembers which child served each restore."""

    def __init__(self) -> None:
        super().__init__()
        self.served: list[int] = []

    async def take(self) -> ExtractorProcess:
        process = await super().take()
        self.served.append(process.pid)
        return process


def extractor_pids() -> set[int]:
    pids = set()
    for child in own_extractors():
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                pids.add(child.pid)
        except psutil.Error:
            continue
    return pids


async def settled_pids(expected: int) -> set[int]:
    """The extractor children once there are ``expected`` of them (or after 20 s)."""
    deadline = time.monotonic() + 20
    while len(pids := extractor_pids()) != expected and time.monotonic() < deadline:
        await anyio.sleep(0.02)
    return pids


async def restore(warm: WarmExtractor, arena: Arena, data: bytes) -> None:
    await restore_checkpoint(
        chunked(data),
        arena.staging,
        uid=UID,
        gid=GID,
        encoding="zstd",
        limits=ArchiveLimits(),
        expected_sha256=None,
        extractors=warm,
    )


async def test_each_restore_has_its_own_child_and_a_hostile_one_leaves_nothing(
    arena: Arena,
) -> None:
    """A hostile archive's extractor is gone before the next restore, which gets a new
    child (the spare started after it) and lands exactly its own files."""
    hostile = compress(
        archive(
            member("workspace/planted", type_=tarfile.SYMTYPE, linkname="."),
            member("workspace/../escape.txt", b"evil"),
        ),
        "zstd",
    )
    good = compress(archive(member("workspace/notes.txt", b"mine\n")), "zstd")
    warm = RecordingWarm()
    warm.start()
    try:
        before = arena.snapshot()
        spare = await settled_pids(1)
        with pytest.raises(ArchiveRejectedError, match=r"\.\."):
            await restore(warm, arena, hostile)
        assert arena.snapshot() == before
        assert arena.sentinel.read_bytes() == b"do not touch\n"
        assert warm.served == sorted(spare)
        reset_staging(arena.staging)
        after = await settled_pids(1)
        assert after.isdisjoint(warm.served)  # the one that served is gone; a new spare waits
        await restore(warm, arena, good)
        assert warm.served[1] in after
        assert sorted(os.listdir(arena.staging)) == ["notes.txt"]
        assert (arena.staging / "notes.txt").read_bytes() == b"mine\n"
        # The replacement spare is up, so the check after ``aclose`` sees whether it was stopped.
        assert len(await settled_pids(1)) == 1
    finally:
        await warm.aclose()
    assert await settled_pids(0) == set()


async def test_a_spare_that_died_is_replaced_for_the_restore(arena: Arena) -> None:
    """A spare killed while it waited (OOM, an operator) costs the restore a fresh child."""
    warm = RecordingWarm()
    warm.start()
    try:
        (spare,) = await settled_pids(1)
        psutil.Process(spare).kill()
        assert await settled_pids(0) == set()  # dead (a zombie until the pool looks)
        await restore(warm, arena, compress(archive(member("workspace/a.txt", b"a")), "zstd"))
        assert (arena.staging / "a.txt").read_bytes() == b"a"
        # The replacement spare is up, so the check after ``aclose`` sees whether it was stopped.
        assert len(await settled_pids(1)) == 1
    finally:
        await warm.aclose()
    assert await settled_pids(0) == set()


async def test_cancelling_a_restore_kills_its_child_and_a_new_spare_follows(arena: Arena) -> None:
    """The child of a cancelled restore dies with it; the next restore is served normally."""
    head = compress(archive(member("workspace/a.txt", b"a" * 100_000)), "gzip")[:100]

    async def stalled() -> AsyncIterator[bytes]:
        yield head
        await anyio.sleep_forever()

    warm = RecordingWarm()
    warm.start()
    try:
        with anyio.move_on_after(1.5):
            await restore_checkpoint(
                stalled(),
                arena.staging,
                uid=UID,
                gid=GID,
                encoding="gzip",
                limits=ArchiveLimits(),
                expected_sha256=None,
                extractors=warm,
            )
        assert warm.served[0] not in await settled_pids(1)
        reset_staging(arena.staging)
        await restore(warm, arena, compress(archive(member("workspace/b.txt", b"b")), "zstd"))
        assert (arena.staging / "b.txt").read_bytes() == b"b"
        # The replacement spare is up, so the check after ``aclose`` sees whether it was stopped.
        assert len(await settled_pids(1)) == 1
    finally:
        await warm.aclose()
    assert await settled_pids(0) == set()
