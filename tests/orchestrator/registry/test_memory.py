"""InProcessRegistry specifics: lock expiry follows the injected clock."""

from __future__ import annotations

from sandcell_orchestrator.registry import InProcessRegistry


async def test_expiry_follows_the_injected_clock(sid: str) -> None:
    """A lock lives exactly ttl_ms by the registry's clock; renewals restart it."""
    now_s = 1000.0
    registry = InProcessRegistry(clock=lambda: now_s)
    lease = await registry.acquire_lock(sid, ttl_ms=1_000)
    assert lease is not None
    now_s += 0.999
    assert await registry.acquire_lock(sid, ttl_ms=1_000) is None
    assert await registry.renew(lease, ttl_ms=1_000)
    now_s += 0.999
    assert await registry.acquire_lock(sid, ttl_ms=1_000) is None
    now_s += 0.001
    assert await registry.renew(lease, ttl_ms=1_000) is False
    assert await registry.acquire_lock(sid, ttl_ms=1_000) is not None


async def test_repr_shows_no_tokens(sid: str) -> None:
    """The registry's repr does not dump lock state."""
    registry = InProcessRegistry()
    lease = await registry.acquire_lock(sid, ttl_ms=1_000)
    assert lease is not None
    assert lease.token not in repr(registry)
