"""The extractor fork server: one forked child per restore, nothing shared, lost ones replaced."""

from __future__ import annotations

import os
import tarfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import psutil
import pytest

from sandcell_runner.checkpoint.export import ArchiveLimits
from sandcell_runner.checkpoint.extractor_child import ExtractorArgs
from sandcell_runner.checkpoint.extractor_process import ExtractorProcess, ExtractorServer
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
    own_extractor_servers,
    own_extractors,
    reset_staging,
)


class RecordingServer(ExtractorServer):
    """An ``ExtractorServer`` that remembers which child served each restore, and what
    descriptors that child held."""

    def __init__(self) -> None:
        super().__init__()
        self.served: list[int] = []
        self.fds: list[set[str]] = []

    async def extract(self, args: ExtractorArgs, fds: object) -> ExtractorProcess:
        process = await super().extract(args, fds)  # type: ignore[arg-type]
        self.served.append(process.pid)
        return process


def live(processes: list[psutil.Process]) -> set[int]:
    pids = set()
    for process in processes:
        try:
            if process.status() != psutil.STATUS_ZOMBIE:
                pids.add(process.pid)
        except psutil.Error:
            continue
    return pids


def jailed(processes: list[psutil.Process]) -> set[int]:
    """Those past their privilege drop: their descriptors are as they will read the body."""
    pids = set()
    for process in processes:
        try:
            if process.uids().effective == UID:
                pids.add(process.pid)
        except psutil.Error:
            continue
    return pids


async def settled(count: int, *, servers: bool = False) -> set[int]:
    """The live servers (or their children) once there are ``count`` (or after 20 s)."""
    deadline = time.monotonic() + 20
    find = own_extractor_servers if servers else own_extractors
    while len(pids := live(find())) != count and time.monotonic() < deadline:
        await anyio.sleep(0.02)
    return pids


async def restore(server: ExtractorServer, arena: Arena, data: bytes) -> None:
    await restore_checkpoint(
        chunked(data),
        arena.staging,
        uid=UID,
        gid=GID,
        encoding="zstd",
        limits=ArchiveLimits(),
        expected_sha256=None,
        extractors=server,
    )


async def test_each_restore_has_its_own_child_and_a_hostile_one_leaves_nothing(
    arena: Arena,
) -> None:
    """A hostile archive's child is gone before the next restore, which gets a new child
    of the same server and lands exactly its own files; no child is left after."""
    hostile = compress(
        archive(
            member("workspace/planted", type_=tarfile.SYMTYPE, linkname="."),
            member("workspace/../escape.txt", b"evil"),
        ),
        "zstd",
    )
    good = compress(archive(member("workspace/notes.txt", b"mine\n")), "zstd")
    server = RecordingServer()
    server.start()
    try:
        before = arena.snapshot()
        (server_pid,) = await settled(1, servers=True)
        with pytest.raises(ArchiveRejectedError, match=r"\.\."):
            await restore(server, arena, hostile)
        assert arena.snapshot() == before
        assert arena.sentinel.read_bytes() == b"do not touch\n"
        assert await settled(0) == set()  # the child that served is gone
        reset_staging(arena.staging)
        await restore(server, arena, good)
        assert len(set(server.served)) == 2  # two children...
        assert live(own_extractor_servers()) == {server_pid}  # ...of one server
        assert sorted(os.listdir(arena.staging)) == ["notes.txt"]
        assert (arena.staging / "notes.txt").read_bytes() == b"mine\n"
        assert await settled(0) == set()
    finally:
        await server.aclose()
    assert await settled(0, servers=True) == set()


async def test_a_child_holds_only_its_own_descriptors(arena: Arena) -> None:
    """While it waits for the body, a child has its stdio and its request's descriptors:
    not the server's socket, and not the pidfd of a sibling serving another restore."""
    head = compress(archive(member("workspace/a.txt", b"a" * 100_000)), "gzip")[:100]
    go_on = anyio.Event()

    async def stalled() -> AsyncIterator[bytes]:
        yield head
        await go_on.wait()

    seen: list[list[str]] = []

    async def restore_stalled(staging: Path) -> None:
        with pytest.raises(ArchiveRejectedError):
            await restore_checkpoint(
                stalled(),
                staging,
                uid=UID,
                gid=GID,
                encoding="gzip",
                limits=ArchiveLimits(),
                expected_sha256=None,
                extractors=server,
            )

    second = arena.staging.parent / "second"
    second.mkdir(mode=0o700)
    os.chown(second, UID, GID)
    server = ExtractorServer()
    server.start()
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(restore_stalled, arena.staging)
            tg.start_soon(restore_stalled, second)
            with anyio.fail_after(20):
                while len(children := jailed(own_extractors())) < 2:
                    await anyio.sleep(0.02)
            for pid in children:
                # Readable by root whatever the child's UID; its fd table, as links.
                fds = os.listdir(f"/proc/{pid}/fd")
                seen.append(sorted(os.readlink(f"/proc/{pid}/fd/{fd}") for fd in fds))
            go_on.set()
    finally:
        await server.aclose()
    for links in seen:
        assert not [link for link in links if link.startswith("socket:")], links
        assert not [link for link in links if "pidfd" in link], links


async def test_a_server_that_died_is_replaced_for_the_restore(arena: Arena) -> None:
    """A server killed while it waited (OOM, an operator) costs the restore a new server."""
    server = ExtractorServer()
    server.start()
    try:
        (first,) = await settled(1, servers=True)
        psutil.Process(first).kill()
        assert await settled(0, servers=True) == set()  # dead (a zombie until reaped)
        await restore(server, arena, compress(archive(member("workspace/a.txt", b"a")), "zstd"))
        assert (arena.staging / "a.txt").read_bytes() == b"a"
        (second,) = await settled(1, servers=True)
        assert second != first
    finally:
        await server.aclose()
    assert await settled(0, servers=True) == set()


async def test_cancelling_a_restore_kills_its_child_and_the_next_is_served(arena: Arena) -> None:
    """The child of a cancelled restore dies with it; the next restore is served normally."""
    head = compress(archive(member("workspace/a.txt", b"a" * 100_000)), "gzip")[:100]

    async def stalled() -> AsyncIterator[bytes]:
        yield head
        await anyio.sleep_forever()

    server = RecordingServer()
    server.start()
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
                extractors=server,
            )
        assert server.served
        assert await settled(0) == set()
        reset_staging(arena.staging)
        await restore(server, arena, compress(archive(member("workspace/b.txt", b"b")), "zstd"))
        assert (arena.staging / "b.txt").read_bytes() == b"b"
    finally:
        await server.aclose()
    assert await settled(0, servers=True) == set()
