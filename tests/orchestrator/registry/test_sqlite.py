"""SqliteRegistry specifics: one file shared by processes, fenced across them."""

from __future__ import annotations

import os
import sqlite3
import stat
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from sandcell_orchestrator.bootstrap import open_registry
from sandcell_orchestrator.config import OrchestratorSettings
from sandcell_orchestrator.errors import ConfigError, LockLostError, RegistryError
from sandcell_orchestrator.registry import FencedError, SessionRecord, SqliteRegistry

MakeRecord = Callable[..., SessionRecord]

_RACE = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    from sandcell_orchestrator.registry import SqliteRegistry

    async def main():
        registry = SqliteRegistry(Path(sys.argv[1]))
        sys.stdin.readline()  # start together
        lease = await registry.acquire_lock(sys.argv[2], ttl_ms=60_000)
        generation = await registry.next_generation(sys.argv[2]) if lease else 0
        await registry.close()
        print("won" if lease else "lost", generation)

    asyncio.run(main())
    """
)


def test_processes_racing_for_a_lock_have_one_winner(tmp_path: Path, sid: str) -> None:
    """Eight processes acquire one session's lock at once: exactly one gets it."""
    path = tmp_path / "registry.sqlite3"
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", _RACE, str(path), sid],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(8)
    ]
    for racer in racers:
        assert racer.stdin is not None
        racer.stdin.write("go\n")
        racer.stdin.flush()
    outcomes = [racer.communicate(timeout=60)[0].split() for racer in racers]
    assert all(racer.returncode == 0 for racer in racers)
    assert sorted(word for word, _ in outcomes) == ["lost"] * 7 + ["won"]
    assert [generation for word, generation in outcomes if word == "won"] == ["1"]


async def test_a_second_opener_is_fenced_like_a_second_host(
    tmp_path: Path, sid: str, make_record: MakeRecord
) -> None:
    """Two registries on one file (two processes): the lock and the generation hold
    across them, and the file is readable by its owner only."""
    path = tmp_path / "home" / "registry.sqlite3"
    first, second = SqliteRegistry(path), SqliteRegistry(path)
    try:
        lease = await first.acquire_lock(sid, ttl_ms=60_000)
        assert lease is not None
        assert await second.acquire_lock(sid, ttl_ms=60_000) is None
        stale = await first.next_generation(sid)
        current = await second.next_generation(sid)
        with pytest.raises(FencedError):
            await first.put(lease, make_record(sid, generation=stale))
        await first.put(lease, make_record(sid, generation=current))
        assert await second.get(sid) == make_record(sid, generation=current)
        assert await first.release(lease)
        taken = await second.acquire_lock(sid, ttl_ms=60_000)
        assert taken is not None
        with pytest.raises(LockLostError):
            await first.put(lease, make_record(sid, generation=current + 1))
    finally:
        await first.close()
        await second.close()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700


async def test_a_lock_from_another_boot_is_expired(tmp_path: Path, sid: str) -> None:
    """Monotonic time restarts at boot: a lock row written before a reboot is free."""
    path = tmp_path / "registry.sqlite3"
    before = SqliteRegistry(path, boot_id="boot-1", clock=lambda: 1e9)
    after = SqliteRegistry(path, boot_id="boot-2", clock=lambda: 10.0)
    try:
        assert await before.acquire_lock(sid, ttl_ms=60_000) is not None
        assert await after.acquire_lock(sid, ttl_ms=60_000) is not None
    finally:
        await before.close()
        await after.close()


async def test_a_held_database_is_a_registry_error(tmp_path: Path, sid: str) -> None:
    """A database another connection keeps write-locked past the busy timeout fails as
    RegistryError (retryable), not as a hang or a raw sqlite3 error."""
    path = tmp_path / "registry.sqlite3"
    registry = SqliteRegistry(path, busy_timeout_ms=100)
    await registry.current_generation(sid)  # creates the file and schema
    blocker = sqlite3.connect(path, isolation_level=None)
    try:
        blocker.execute("BEGIN IMMEDIATE")
        with pytest.raises(RegistryError, match="acquire_lock failed") as caught:
            await registry.acquire_lock(sid, ttl_ms=1_000)
        assert caught.value.retryable
    finally:
        blocker.close()
        await registry.close()


async def test_closed_registry_refuses_work(tmp_path: Path, sid: str) -> None:
    """After close, calls fail as RegistryError instead of reopening the file."""
    registry = SqliteRegistry(tmp_path / "registry.sqlite3")
    await registry.close()
    with pytest.raises(RegistryError, match="closed"):
        await registry.get(sid)


@pytest.mark.parametrize(
    ("url", "kind", "path"),
    [
        (None, "SqliteRegistry", "home/registry.sqlite3"),
        ("sqlite://{tmp}/elsewhere.db", "SqliteRegistry", "elsewhere.db"),
        ("memory://", "InProcessRegistry", None),
    ],
)
async def test_the_embedded_default_is_the_sqlite_file(
    tmp_path: Path, url: str | None, kind: str, path: str | None
) -> None:
    """Unset SANDCELL_REGISTRY_URL means $SANDCELL_HOME/registry.sqlite3; memory:// is
    the in-process one; anything else unknown is a ConfigError naming the variable."""
    env = {"SANDCELL_HOME": str(tmp_path / "home")}
    if url is not None:
        env["SANDCELL_REGISTRY_URL"] = url.format(tmp=tmp_path)
    settings = OrchestratorSettings.from_env(env)
    registry = open_registry(settings)
    try:
        assert type(registry).__name__ == kind
        assert not settings.distributed_registry
        if path is not None:
            assert isinstance(registry, SqliteRegistry)
            assert registry.path == tmp_path / path
    finally:
        await registry.close()
    with pytest.raises(ConfigError, match="SANDCELL_REGISTRY_URL"):
        OrchestratorSettings.from_env({**env, "SANDCELL_REGISTRY_URL": "sqlite://relative"})
