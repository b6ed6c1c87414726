"""hold_session: acquire, renew in the background, abort the body when the lease is lost."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import anyio
import pytest

from sandcell_orchestrator.errors import LockLostError, SessionBusyError
from sandcell_orchestrator.registry import Lease, SessionRegistry, hold_session

if TYPE_CHECKING:
    from .conftest import Backdoor, FlakyRenew

TTL_MS = 300
EVERY_MS = 60
# Generous: the point is "promptly, not after the body's 10 s sleep".
PROMPT_S = 2.0


async def test_holds_renews_and_releases(registry: SessionRegistry, sid: str) -> None:
    """The lock stays ours for several TTLs while the body runs, and is free afterwards."""
    async with hold_session(registry, sid, ttl_ms=TTL_MS, renew_every_ms=EVERY_MS) as lease:
        assert isinstance(lease, Lease)
        await anyio.sleep(3 * TTL_MS / 1000)
        assert await registry.acquire_lock(sid, ttl_ms=TTL_MS) is None
        assert await registry.renew(lease, ttl_ms=TTL_MS)
    assert await registry.acquire_lock(sid, ttl_ms=TTL_MS) is not None


async def test_busy_session_raises(registry: SessionRegistry, sid: str) -> None:
    """A session held elsewhere raises SessionBusyError (retryable) without waiting."""
    assert await registry.acquire_lock(sid, ttl_ms=10_000) is not None
    with pytest.raises(SessionBusyError) as caught:
        async with hold_session(registry, sid, ttl_ms=TTL_MS):
            pytest.fail("the body must not run")
    assert caught.value.retryable


async def test_busy_session_waits_up_to_wait_ms(registry: SessionRegistry, sid: str) -> None:
    """With wait_ms, a lock released in time is taken; one held longer still raises."""
    other = await registry.acquire_lock(sid, ttl_ms=10_000)
    assert other is not None

    async def release_soon() -> None:
        await anyio.sleep(0.1)
        await registry.release(other)

    async with anyio.create_task_group() as tg:
        tg.start_soon(release_soon)
        async with hold_session(registry, sid, ttl_ms=TTL_MS, wait_ms=2_000):
            pass

    assert await registry.acquire_lock(sid, ttl_ms=10_000) is not None
    started = time.monotonic()
    with pytest.raises(SessionBusyError):
        async with hold_session(registry, sid, ttl_ms=TTL_MS, wait_ms=150):
            pass
    assert 0.14 <= time.monotonic() - started < PROMPT_S


@pytest.mark.parametrize("another_takes_it", [True, False], ids=["taken", "deleted"])
async def test_lost_lock_cancels_the_body(
    registry: SessionRegistry, backdoor: Backdoor, sid: str, another_takes_it: bool
) -> None:
    """When a renewal finds the token gone, the body is cancelled and LockLostError raised."""
    reached_end = False

    async def turn() -> None:
        nonlocal reached_end
        async with hold_session(registry, sid, ttl_ms=TTL_MS, renew_every_ms=EVERY_MS):
            await backdoor.drop_lock(sid)
            if another_takes_it:
                assert await registry.acquire_lock(sid, ttl_ms=10_000) is not None
            await anyio.sleep(10)
            reached_end = True

    started = time.monotonic()
    with anyio.fail_after(PROMPT_S), pytest.raises(LockLostError, match="taken over"):
        await turn()
    assert not reached_end
    assert time.monotonic() - started < PROMPT_S
    if another_takes_it:
        # The loser must not have released the winner's lock on its way out.
        assert await registry.acquire_lock(sid, ttl_ms=10_000) is None


async def test_transient_renew_errors_fence_after_ttl(
    registry: SessionRegistry, sid: str, flaky_renew: type[FlakyRenew]
) -> None:
    """Renewals that keep raising are retried until the lease is a TTL old, then fenced."""
    flaky = flaky_renew(registry, failures=None)
    started = time.monotonic()
    with anyio.fail_after(PROMPT_S), pytest.raises(LockLostError, match="within its 300 ms TTL"):
        async with hold_session(flaky, sid, ttl_ms=TTL_MS, renew_every_ms=EVERY_MS):
            await anyio.sleep(10)
    elapsed = time.monotonic() - started
    assert TTL_MS / 1000 * 0.95 <= elapsed < PROMPT_S
    assert flaky.renew_calls >= 2, "errors are retried, not fatal on the first"


async def test_transient_renew_errors_are_tolerated(
    registry: SessionRegistry, sid: str, flaky_renew: type[FlakyRenew]
) -> None:
    """A blip shorter than the TTL costs nothing: the body completes, the lock stays ours."""
    flaky = flaky_renew(registry, failures=2)
    async with hold_session(flaky, sid, ttl_ms=TTL_MS, renew_every_ms=EVERY_MS):
        await anyio.sleep(4 * TTL_MS / 1000)
        assert await registry.acquire_lock(sid, ttl_ms=TTL_MS) is None
    assert flaky.renew_calls > 2
    assert await registry.acquire_lock(sid, ttl_ms=TTL_MS) is not None


async def test_lease_age_follows_the_injected_clock(registry: SessionRegistry, sid: str) -> None:
    """A clock that jumps past the TTL (a long pause) fences even though Redis still agrees."""
    offset_s = 0.0

    def clock() -> float:
        return time.monotonic() + offset_s

    async def turn() -> None:
        nonlocal offset_s
        async with hold_session(registry, sid, ttl_ms=10_000, renew_every_ms=EVERY_MS, clock=clock):
            offset_s = 60.0
            await anyio.sleep(10)

    with anyio.fail_after(PROMPT_S), pytest.raises(LockLostError, match="within its 10000 ms"):
        await turn()


async def test_body_errors_propagate_unwrapped(registry: SessionRegistry, sid: str) -> None:
    """The body's own exception comes out as itself (no ExceptionGroup) and the lock is freed."""
    with pytest.raises(KeyError, match="boom"):
        async with hold_session(registry, sid, ttl_ms=TTL_MS):
            raise KeyError("boom")
    assert await registry.acquire_lock(sid, ttl_ms=TTL_MS) is not None


async def test_outer_cancellation_releases(registry: SessionRegistry, sid: str) -> None:
    """Cancelling the caller is not a lost lock: nothing is raised, and the lock is freed."""
    with anyio.move_on_after(0.1) as scope:
        async with hold_session(registry, sid, ttl_ms=TTL_MS):
            await anyio.sleep(10)
    assert scope.cancelled_caught
    assert await registry.acquire_lock(sid, ttl_ms=TTL_MS) is not None


async def test_fenced_write_inside_the_body_surfaces_as_lock_lost(
    registry: SessionRegistry, backdoor: Backdoor, sid: str
) -> None:
    """If the body's own write hits the fence first, that LockLostError comes out as is."""

    async def turn() -> None:
        async with hold_session(registry, sid, ttl_ms=10_000, renew_every_ms=5_000) as lease:
            await backdoor.drop_lock(sid)
            await registry.delete(lease, sid, generation=await registry.next_generation(sid))

    with pytest.raises(LockLostError, match="no longer held"):
        await turn()


@pytest.mark.parametrize(
    ("ttl_ms", "renew_every_ms", "wait_ms"),
    [(0, None, 0), (300, 300, 0), (300, 0, 0), (300, None, -1)],
)
async def test_arguments_are_validated(
    registry: SessionRegistry, sid: str, ttl_ms: int, renew_every_ms: int | None, wait_ms: int
) -> None:
    """Renewing no more often than the TTL would let the lock lapse: refused up front."""
    with pytest.raises(ValueError, match="ms"):
        async with hold_session(
            registry, sid, ttl_ms=ttl_ms, renew_every_ms=renew_every_ms, wait_ms=wait_ms
        ):
            pass


async def test_token_never_logged_or_shown(
    registry: SessionRegistry,
    backdoor: Backdoor,
    sid: str,
    flaky_renew: type[FlakyRenew],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The token appears in no repr and no log line, across renewals, errors and loss."""
    tokens: list[str] = []

    async def clean_turn() -> None:
        # Renewed every EVERY_MS, but with a TTL no scheduling delay on a loaded
        # machine outlasts: this turn must not lose its lock.
        ttl_ms = 100 * TTL_MS
        async with hold_session(registry, sid, ttl_ms=ttl_ms, renew_every_ms=EVERY_MS) as lease:
            tokens.append(lease.token)
            assert lease.token not in repr(lease)
            assert lease.token not in str(lease)
            assert lease.token not in f"{lease!r} {lease}"
            assert repr(lease) == f"Lease(session_id={sid!r}, ttl_ms={ttl_ms})"
            await anyio.sleep(0.2)

    async def flaky_turn() -> None:
        async with hold_session(flaky_renew(registry, failures=None), sid, ttl_ms=TTL_MS) as lease:
            tokens.append(lease.token)
            await anyio.sleep(10)

    async def lost_turn() -> None:
        async with hold_session(registry, sid, ttl_ms=TTL_MS, renew_every_ms=EVERY_MS) as lease:
            tokens.append(lease.token)
            await backdoor.drop_lock(sid)
            await anyio.sleep(10)

    with caplog.at_level(logging.DEBUG):
        await clean_turn()
        with pytest.raises(LockLostError):
            await flaky_turn()
        await backdoor.drop_lock(sid)
        with pytest.raises(LockLostError):
            await lost_turn()
    assert len(tokens) == 3
    assert any(r.levelno >= logging.WARNING for r in caplog.records), "errors were logged"
    for r in caplog.records:
        text = r.getMessage() + (r.exc_text or "") + repr(r.args)
        for token in tokens:
            assert token not in text
