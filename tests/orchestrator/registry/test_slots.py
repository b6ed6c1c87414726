"""Fleet-wide slots (LibreChat's per-tenant concurrency across workers, issue 20), against
every backend: at most ``limit`` live holders per scope, released or lapsed slots free
room, renewals keep a slot and fail once it lapsed."""

from __future__ import annotations

import hashlib
import secrets

import anyio
import pytest

from sandcell_orchestrator.registry import SessionRegistry

LIMIT = 2


def scope() -> str:
    return hashlib.sha256(secrets.token_bytes(8)).hexdigest()


async def test_at_most_limit_slots_are_held_and_released_ones_free_room(
    registry: SessionRegistry,
) -> None:
    """Two holders fit, a third is refused; a release lets it in; scopes are apart."""
    mine, other = scope(), scope()
    assert await registry.acquire_slot(mine, token="a", limit=LIMIT, ttl_ms=60_000)
    assert await registry.acquire_slot(mine, token="b", limit=LIMIT, ttl_ms=60_000)
    assert not await registry.acquire_slot(mine, token="c", limit=LIMIT, ttl_ms=60_000)
    assert await registry.acquire_slot(other, token="c", limit=LIMIT, ttl_ms=60_000)
    assert await registry.slots_held(mine) == 2
    await registry.release_slot(mine, token="a")
    await registry.release_slot(mine, token="a")  # idempotent
    assert await registry.slots_held(mine) == 1
    assert await registry.acquire_slot(mine, token="c", limit=LIMIT, ttl_ms=60_000)
    assert await registry.slots_held(other) == 1


async def test_a_slot_nobody_renews_lapses(registry: SessionRegistry) -> None:
    """A holder that stopped renewing (a crashed worker) frees its slot after its TTL;
    its late renewal fails, while a renewed slot is kept past its first TTL."""
    where = scope()
    assert await registry.acquire_slot(where, token="crashed", limit=1, ttl_ms=300)
    assert not await registry.acquire_slot(where, token="next", limit=1, ttl_ms=300)
    for _ in range(200):
        if await registry.slots_held(where) == 0:
            break
        await anyio.sleep(0.05)
    assert await registry.slots_held(where) == 0
    assert not await registry.renew_slot(where, token="crashed", ttl_ms=300)
    assert await registry.acquire_slot(where, token="next", limit=1, ttl_ms=60_000)
    assert await registry.renew_slot(where, token="next", ttl_ms=60_000)
    assert not await registry.acquire_slot(where, token="third", limit=1, ttl_ms=60_000)


@pytest.mark.parametrize("bad", ["", "tenant-a", "A" * 64, "0" * 63])
async def test_scopes_are_hashes(registry: SessionRegistry, bad: str) -> None:
    """What a caller counts by is hashed first: anything else is a ValueError."""
    with pytest.raises(ValueError, match="slot scope"):
        await registry.acquire_slot(bad, token="t", limit=1, ttl_ms=1000)
