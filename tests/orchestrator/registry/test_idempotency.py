"""The registry's idempotency entries, run against every backend (the ``registry`` fixture)."""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable

import anyio
import pytest

from sandcell_orchestrator.errors import LockLostError
from sandcell_orchestrator.registry import (
    FencedError,
    IdempotencyEntry,
    IdempotentAnswer,
    Lease,
    SessionRecord,
    SessionRegistry,
)

MakeRecord = Callable[..., SessionRecord]

LONG_TTL_MS = 10_000


def new_key() -> str:
    return hashlib.sha256(secrets.token_bytes(16)).hexdigest()


async def test_first_claim_wins_and_later_ones_see_it_pending(registry: SessionRegistry) -> None:
    """A claimed key answers every other claim with its pending entry."""
    key = new_key()
    assert (
        await registry.claim_idempotency(key, fingerprint="f1", token="a", ttl_ms=LONG_TTL_MS)
        is None
    )
    seen = await registry.claim_idempotency(key, fingerprint="f2", token="b", ttl_ms=LONG_TTL_MS)
    assert seen == IdempotencyEntry(fingerprint="f1", done=False, status=0, body=b"")


async def test_concurrent_claims_have_one_winner(registry: SessionRegistry) -> None:
    """Of many simultaneous claims, exactly one gets the key."""
    key = new_key()
    won: list[str] = []

    async def claim(token: str) -> None:
        if (
            await registry.claim_idempotency(key, fingerprint="f", token=token, ttl_ms=LONG_TTL_MS)
            is None
        ):
            won.append(token)

    async with anyio.create_task_group() as tg:
        for n in range(20):
            tg.start_soon(claim, f"t{n}")
    assert len(won) == 1


async def test_finished_answer_is_replayed_byte_for_byte(registry: SessionRegistry) -> None:
    """The stored status and body come back exactly, binary included."""
    key = new_key()
    body = b'{"stdout":"x"}\x00\xff'
    assert await _claim(registry, key, "a") is None
    assert await registry.finish_idempotency(
        key, token="a", status=200, body=body, ttl_ms=LONG_TTL_MS
    )
    seen = await _claim(registry, key, "b")
    assert seen == IdempotencyEntry(fingerprint="f", done=True, status=200, body=body)


async def test_only_the_claimant_renews_finishes_or_drops(registry: SessionRegistry) -> None:
    """Another token changes nothing; a dropped claim frees the key for the next one."""
    key = new_key()
    assert await _claim(registry, key, "a") is None
    assert not await registry.renew_idempotency(key, token="b", ttl_ms=LONG_TTL_MS)
    assert not await registry.finish_idempotency(
        key, token="b", status=200, body=b"x", ttl_ms=LONG_TTL_MS
    )
    assert not await registry.drop_idempotency(key, token="b")
    assert await registry.renew_idempotency(key, token="a", ttl_ms=LONG_TTL_MS)
    assert await registry.drop_idempotency(key, token="a")
    assert (
        await registry.claim_idempotency(key, fingerprint="g", token="b", ttl_ms=LONG_TTL_MS)
        is None
    )


async def test_an_answer_is_not_dropped_or_renewed(registry: SessionRegistry) -> None:
    """Once answered, the claimant's drop and renew are refused: the answer stays."""
    key = new_key()
    assert await _claim(registry, key, "a") is None
    assert await registry.finish_idempotency(
        key, token="a", status=201, body=b"ok", ttl_ms=LONG_TTL_MS
    )
    assert not await registry.drop_idempotency(key, token="a")
    assert not await registry.renew_idempotency(key, token="a", ttl_ms=LONG_TTL_MS)
    seen = await _claim(registry, key, "b")
    assert seen is not None
    assert (seen.done, seen.status) == (True, 201)


async def test_a_claim_expires_unless_renewed(registry: SessionRegistry) -> None:
    """A claimant that died stops holding the key after its TTL; its late finish is refused."""
    key = new_key()
    assert await registry.claim_idempotency(key, fingerprint="f", token="a", ttl_ms=150) is None
    await anyio.sleep(0.4)
    assert await _claim(registry, key, "b") is None
    assert not await registry.finish_idempotency(
        key, token="a", status=200, body=b"late", ttl_ms=LONG_TTL_MS
    )


@pytest.mark.parametrize("key", ["", "ABC", "g" * 64, "a" * 63, "../" + "a" * 61])
async def test_keys_must_be_hashes(registry: SessionRegistry, key: str) -> None:
    """Nothing unhashed becomes a storage key."""
    with pytest.raises(ValueError, match="idempotency key"):
        await _claim(registry, key, "a")


# -- the answer stored by the record write that commits its turn ----------------------


def _answer(key: str, token: str, body: bytes) -> IdempotentAnswer:
    return IdempotentAnswer(key=key, token=token, status=200, body=body, ttl_ms=LONG_TTL_MS)


async def _claim(registry: SessionRegistry, key: str, token: str) -> IdempotencyEntry | None:
    """Claim ``key`` as ``token`` for one fingerprint: None, or what an earlier claim left."""
    return await registry.claim_idempotency(key, fingerprint="f", token=token, ttl_ms=LONG_TTL_MS)


async def _held(registry: SessionRegistry, sid: str) -> tuple[Lease, int]:
    lease = await registry.acquire_lock(sid, ttl_ms=LONG_TTL_MS)
    assert lease is not None
    return lease, await registry.next_generation(sid)


async def test_a_committing_write_stores_its_turns_answer(
    registry: SessionRegistry, sid: str, make_record: MakeRecord
) -> None:
    """``put(..., answer=)`` writes the record and the claim's answer together: a retry
    that comes after it (its worker died before answering) gets that answer."""
    key = new_key()
    assert await _claim(registry, key, "a") is None
    lease, generation = await _held(registry, sid)
    record = make_record(sid, generation=generation)
    await registry.put(lease, record, answer=_answer(key, "a", b'{"durable":true}\x00'))
    assert await registry.get(sid) == record
    seen = await _claim(registry, key, "b")
    assert seen == IdempotencyEntry(
        fingerprint="f", done=True, status=200, body=b'{"durable":true}\x00'
    )


async def test_a_fenced_write_stores_neither_record_nor_answer(
    registry: SessionRegistry, sid: str, make_record: MakeRecord
) -> None:
    """A superseded holder's commit is refused whole: the key stays pending (its retry
    runs again, on the newer holder's state), the record stays the newer one's."""
    key = new_key()
    assert await _claim(registry, key, "a") is None
    lease, stale = await _held(registry, sid)
    current = await registry.next_generation(sid)
    await registry.put(lease, make_record(sid, generation=current))
    with pytest.raises(FencedError):
        await registry.put(
            lease,
            make_record(sid, generation=stale, state="suspended"),
            answer=_answer(key, "a", b"x"),
        )
    assert (await registry.get(sid)) == make_record(sid, generation=current)
    seen = await _claim(registry, key, "b")
    assert seen == IdempotencyEntry(fingerprint="f", done=False, status=0, body=b"")
    # Nor a write without the lock.
    assert await registry.release(lease)
    with pytest.raises(LockLostError):
        await registry.put(
            lease, make_record(sid, generation=current), answer=_answer(key, "a", b"x")
        )
    seen = await _claim(registry, key, "b")
    assert seen is not None
    assert not seen.done


async def test_a_committing_write_leaves_another_claims_key_alone(
    registry: SessionRegistry, sid: str, make_record: MakeRecord
) -> None:
    """An answer whose claim is gone (expired, taken by a retry) is not stored; the record
    is: the write commits the turn either way, and the key is the new claimant's."""
    key = new_key()
    assert await _claim(registry, key, "b") is None
    lease, generation = await _held(registry, sid)
    record = make_record(sid, generation=generation)
    await registry.put(lease, record, answer=_answer(key, "a", b"first"))
    assert await registry.get(sid) == record
    seen = await _claim(registry, key, "c")
    assert seen == IdempotencyEntry(fingerprint="f", done=False, status=0, body=b"")
    # A key nobody claimed gets no entry either.
    unclaimed = new_key()
    await registry.put(lease, record, answer=_answer(unclaimed, "a", b"x"))
    assert (
        await registry.claim_idempotency(unclaimed, fingerprint="f", token="d", ttl_ms=LONG_TTL_MS)
        is None
    )


def test_an_answers_repr_hides_its_token_and_body() -> None:
    """The claim token is a secret and the body a tenant's output: neither in a repr."""
    answer = _answer(new_key(), "claim-token-secret", b"tenant output")
    assert "claim-token-secret" not in repr(answer)
    assert "tenant output" not in repr(answer)
    with pytest.raises(ValueError):
        IdempotentAnswer(key="not-hex", token="a", status=200, body=b"", ttl_ms=1)
