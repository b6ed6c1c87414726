"""Restore: digests, stripped bits, corrupt streams, link safety, cancellation."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import posixpath
import stat
import subprocess
import sys
import tarfile
import threading
from collections.abc import AsyncIterator
from typing import Any

import anyio
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandcell_runner.checkpoint.compression import Encoding
from sandcell_runner.checkpoint.export import ArchiveLimits
from sandcell_runner.checkpoint.extractor_child import parse_request
from sandcell_runner.checkpoint.restore import restore_checkpoint
from sandcell_runner.errors import ArchiveRejectedError
from tests.runner.checkpoint import (
    GID,
    META,
    UID,
    Arena,
    archive,
    compress,
    make_arena,
    member,
    own_extractor_servers,
    own_extractors,
    restore_bytes,
)

ENCODINGS: list[Encoding] = ["gzip", "zstd"]
SETTINGS = settings(
    max_examples=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def small_archive(encoding: Encoding) -> bytes:
    return compress(
        archive(
            member("workspace", type_=tarfile.DIRTYPE, mode=0o755),
            member("workspace/dir", type_=tarfile.DIRTYPE, mode=0o750),
            member("workspace/dir/file.txt", b"hello\n" * 1000),
            member("workspace/link", type_=tarfile.SYMTYPE, linkname="dir/file.txt"),
        ),
        encoding,
    )


@pytest.mark.parametrize("encoding", ENCODINGS)
async def test_expected_sha256_is_enforced(arena: Arena, encoding: Encoding) -> None:
    """A matching digest (any case) restores; a different one is rejected."""
    data = small_archive(encoding)
    digest = hashlib.sha256(data).hexdigest()

    meta = await restore_bytes(data, arena.staging, encoding=encoding, expected_sha256=digest)
    assert meta == META

    for other_staging in ("again", "mismatch"):
        staging = arena.root / other_staging
        staging.mkdir(mode=0o700)
        os.chown(staging, UID, GID)
    await restore_bytes(
        data, arena.root / "again", encoding=encoding, expected_sha256=digest.upper()
    )
    with pytest.raises(ArchiveRejectedError, match="sha256"):
        await restore_bytes(
            data, arena.root / "mismatch", encoding=encoding, expected_sha256="0" * 64
        )


@pytest.mark.parametrize("encoding", ENCODINGS)
async def test_setuid_setgid_sticky_are_stripped(arena: Arena, encoding: Encoding) -> None:
    """A setuid root-owned file in the archive lands as a plain UID-owned file."""
    data = compress(
        archive(
            member("workspace/suid", b"#!/bin/sh\n", mode=0o4755),
            member("workspace/sgid", b"x", mode=0o2711),
            member("workspace/sticky", type_=tarfile.DIRTYPE, mode=0o1777),
        ),
        encoding,
    )

    await restore_bytes(data, arena.staging, encoding=encoding)

    modes = {
        name: (
            stat.S_IMODE((arena.staging / name).lstat().st_mode),
            (arena.staging / name).lstat().st_uid,
        )
        for name in ("suid", "sgid", "sticky")
    }
    assert modes == {"suid": (0o755, UID), "sgid": (0o711, UID), "sticky": (0o777, UID)}


async def test_staging_must_be_empty(arena: Arena) -> None:
    """Restore never merges into existing content."""
    (arena.staging / "leftover").write_bytes(b"x")

    with pytest.raises(ArchiveRejectedError, match="not empty"):
        await restore_bytes(small_archive("gzip"), arena.staging, encoding="gzip")


async def test_staging_symlink_is_refused(arena: Arena) -> None:
    """A staging path that is a symlink is not followed."""
    os.symlink(arena.live, arena.root / "staging-link")

    with pytest.raises(ArchiveRejectedError, match="staging"):
        await restore_bytes(small_archive("gzip"), arena.root / "staging-link", encoding="gzip")


async def test_wrong_encoding_is_rejected(arena: Arena) -> None:
    """A zstd body declared as gzip is corrupt, not misread."""
    with pytest.raises(ArchiveRejectedError, match="gzip"):
        await restore_bytes(small_archive("zstd"), arena.staging, encoding="gzip")


@SETTINGS
@given(encoding=st.sampled_from(ENCODINGS), cut=st.floats(min_value=0, max_value=1))
def test_truncated_stream_is_rejected(encoding: Encoding, cut: float) -> None:
    """Cut anywhere (even inside the trailer or checksum), the stream is refused."""
    data = small_archive(encoding)
    truncated = data[: min(int(len(data) * cut), len(data) - 1)]

    async def scenario() -> None:
        with make_arena() as arena:
            before = arena.snapshot()
            with pytest.raises(ArchiveRejectedError):
                await restore_bytes(truncated, arena.staging, encoding=encoding)
            assert arena.snapshot() == before

    anyio.run(scenario)


@SETTINGS
@given(
    encoding=st.sampled_from(ENCODINGS),
    garbage=st.one_of(
        st.binary(max_size=4096),
        st.binary(max_size=4096).map(lambda b: b"\x1f\x8b\x08\x00" + b),
        st.binary(max_size=4096).map(lambda b: b"\x28\xb5\x2f\xfd" + b),
    ),
)
def test_garbage_is_rejected(encoding: Encoding, garbage: bytes) -> None:
    """Random bytes, with or without a plausible magic number, never restore."""

    async def scenario() -> None:
        with make_arena() as arena:
            before = arena.snapshot()
            with pytest.raises(ArchiveRejectedError):
                await restore_bytes(garbage, arena.staging, encoding=encoding)
            assert arena.snapshot() == before

    anyio.run(scenario)


link_parts = st.lists(st.sampled_from(["..", ".", "a", "b", "l0", "l1", ""]), max_size=6)


@SETTINGS
@given(
    links=st.lists(
        st.tuples(st.sampled_from(["", "a/", "a/b/"]), link_parts.map("/".join)),
        min_size=1,
        max_size=3,
    )
)
def test_accepted_symlinks_resolve_inside(links: list[tuple[str, str]]) -> None:
    """Whatever chain of relative links gets accepted, each one resolves inside staging."""
    members = [
        member("workspace/a", type_=tarfile.DIRTYPE, mode=0o755),
        member("workspace/a/b", type_=tarfile.DIRTYPE, mode=0o755),
    ]
    members += [
        member(f"workspace/{where}l{index}", type_=tarfile.SYMTYPE, linkname=target or ".")
        for index, (where, target) in enumerate(links)
    ]

    async def scenario() -> None:
        with make_arena() as arena:
            try:
                await restore_bytes(
                    compress(archive(*members), "gzip"), arena.staging, encoding="gzip"
                )
            except ArchiveRejectedError:
                return
            staging = os.path.realpath(arena.staging)
            for path in arena.staging.rglob("l*"):
                # strict: a link loop (l0 -> l0//.) resolves nowhere (ELOOP), and
                # non-strict realpath would report it as "/" by joining an absolute rest.
                try:
                    resolved = os.path.realpath(path, strict=True)
                except OSError:
                    continue
                assert posixpath.commonpath([resolved, staging]) == staging, (path, resolved)

    anyio.run(scenario)


async def test_cancelling_a_restore_kills_the_extractor(arena: Arena) -> None:
    """A caller's timeout ends the child; no extractor outlives the call."""
    head = small_archive("gzip")[:100]

    async def stalled_body() -> AsyncIterator[bytes]:
        yield head
        await anyio.sleep_forever()

    with anyio.move_on_after(1.5) as scope:
        await restore_checkpoint(
            stalled_body(),
            arena.staging,
            uid=UID,
            gid=GID,
            encoding="gzip",
            limits=ArchiveLimits(),
            expected_sha256=None,
        )

    assert scope.cancelled_caught
    assert own_extractors() == []
    assert own_extractor_servers() == []  # the one started for the call is stopped


async def test_extractor_is_chrooted_into_staging_as_the_pinned_uid(arena: Arena) -> None:
    """The extractor's root and working directory are the staging directory; it runs as UID."""
    head = small_archive("zstd")[:100]
    seen: dict[str, object] = {}

    async def watched_body() -> AsyncIterator[bytes]:
        yield head
        with anyio.fail_after(10):
            while not seen:
                await anyio.sleep(0.05)
                for child in own_extractors():
                    try:
                        if child.uids().effective != UID:
                            continue  # still importing, before the privilege drop
                        seen["root"] = os.readlink(f"/proc/{child.pid}/root")
                        seen["cwd"] = child.cwd()
                        seen["uids"] = child.uids()
                    except (psutil.Error, FileNotFoundError):
                        continue  # another test's child that has just exited
        # Ending here truncates the archive: the restore is refused, as it should be.

    with pytest.raises(ArchiveRejectedError):
        await restore_checkpoint(
            watched_body(),
            arena.staging,
            uid=UID,
            gid=GID,
            encoding="zstd",
            limits=ArchiveLimits(),
            expected_sha256=None,
        )

    staging = os.path.realpath(arena.staging)
    assert seen["root"] == staging
    assert seen["cwd"] == staging
    assert tuple(seen["uids"]) == (UID, UID, UID)  # type: ignore[arg-type]


async def test_early_rejection_does_not_wait_for_the_rest_of_the_body(arena: Arena) -> None:
    """Once the extractor has refused, a slow client's remaining body is not awaited."""
    hostile = compress(archive(member("../x", b"evil")), "gzip")

    async def slow_body() -> AsyncIterator[bytes]:
        yield hostile
        await anyio.sleep(30)
        yield b"never read"

    with anyio.fail_after(10), pytest.raises(ArchiveRejectedError, match=r"\.\."):
        await restore_checkpoint(
            slow_body(),
            arena.staging,
            uid=UID,
            gid=GID,
            encoding="gzip",
            limits=ArchiveLimits(),
            expected_sha256=None,
        )


def test_the_extractor_reads_only_the_runners_own_arguments() -> None:
    """The one message is strict JSON, and its descriptors must be exactly the ones it names."""
    base = {"encoding": "zstd", "max_bytes": 100, "max_members": 9}
    request = parse_request(json.dumps({**base, "uid": 20001, "gid": 20001}).encode(), [7, 8])
    assert (request.stream_fd, request.staging_fd, request.cgroup_fds) == (7, 8, [])
    args = request.args
    assert (args.encoding, args.max_bytes, args.max_members) == ("zstd", 100, 9)
    assert (args.uid, args.gid) == (20001, 20001)
    with_cgroups = parse_request(json.dumps({**base, "cgroups": 2}).encode(), [3, 4, 5, 6])
    assert (with_cgroups.args.uid, with_cgroups.cgroup_fds) == (None, [5, 6])
    missing = {k: v for k, v in base.items() if k != "max_bytes"}
    for bad, fds, why in [
        ({**base, "colour": "red"}, [3, 4], "unknown field `colour`"),
        (missing, [3, 4], "missing required field `max_bytes`"),
        ({**base, "encoding": "bz2"}, [3, 4], "encoding"),
        ({**base, "max_bytes": "lots"}, [3, 4], "max_bytes"),
        (base, [3], "expected 2 descriptors, got 1"),
        ({**base, "cgroups": 1}, [3, 4], "expected 3 descriptors, got 2"),
    ]:
        with pytest.raises(SystemExit, match=why):
            parse_request(json.dumps(bad).encode(), fds)


def test_the_extractor_loads_only_what_an_extraction_needs() -> None:
    """The extractor child imports its own package's tar rules and codecs, and nothing of
    the HTTP side (starlette, anyio, asyncio, subprocess, the export): every restore waits
    for its start-up."""
    probe = (
        "import sys, sandcell_runner.checkpoint.extractor_server\n"
        "print('\\n'.join(sorted(sys.modules)))\n"
    )
    loaded = subprocess.run(
        [sys.executable, "-I", "-X", "utf8", "-c", probe],
        capture_output=True,
        text=True,
        check=True,
        env={},
    ).stdout.split()
    ours = {name for name in loaded if name.startswith("sandcell_runner")}
    assert ours == {
        "sandcell_runner",
        "sandcell_runner.checkpoint",
        "sandcell_runner.checkpoint.archive_rules",
        "sandcell_runner.checkpoint.compression",
        "sandcell_runner.checkpoint.confine",
        "sandcell_runner.checkpoint.extract_tree",
        "sandcell_runner.checkpoint.extractor",
        "sandcell_runner.checkpoint.extractor_child",
        "sandcell_runner.checkpoint.extractor_server",
        "sandcell_runner.errors",
    }
    heavy = ("starlette", "uvicorn", "anyio", "asyncio", "httpx", "subprocess", "argparse")
    assert not [name for name in loaded if name.split(".")[0] in heavy]


async def test_a_restore_cancelled_while_staging_is_opened_closes_it(
    arena: Arena, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The staging directory is opened in a thread: natively cancelled there (a task's
    ``cancel()`` passes anyio's thread wait), the descriptor the thread opened after
    was never closed. The open is held until the cancellation has reached the call."""
    entered, release, finished = threading.Event(), threading.Event(), threading.Event()
    opened: list[int] = []
    real_open = os.open

    def held_open(path: Any, flags: int, *args: Any) -> int:
        if str(path) != str(arena.staging):
            return real_open(path, flags, *args)
        entered.set()
        release.wait(60)
        try:
            opened.append(real_open(path, flags, *args))
            return opened[-1]
        finally:
            finished.set()

    async def body() -> AsyncIterator[bytes]:
        yield small_archive("gzip")

    monkeypatch.setattr(os, "open", held_open)
    restore = asyncio.create_task(
        restore_checkpoint(
            body(),
            arena.staging,
            uid=UID,
            gid=GID,
            encoding="gzip",
            limits=ArchiveLimits(),
            expected_sha256=None,
        )
    )
    await asyncio.to_thread(entered.wait, 60)
    restore.cancel()
    for _ in range(10):  # the cancellation reaches the restore
        await asyncio.sleep(0)
    release.set()
    await asyncio.to_thread(finished.wait, 60)
    with pytest.raises(asyncio.CancelledError):
        await restore
    monkeypatch.undo()
    assert len(opened) == 1
    try:
        target = os.readlink(f"/proc/self/fd/{opened[0]}")
    except FileNotFoundError:
        target = None
    if target == str(arena.staging):
        os.close(opened[0])
    assert target != str(arena.staging), "the staging descriptor was left open"
