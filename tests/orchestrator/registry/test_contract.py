"""The SessionRegistry contract, run against every backend (the ``registry`` fixture)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import anyio
import pytest

from sandcell_orchestrator.errors import LockLostError
from sandcell_orchestrator.registry import FencedError, Lease, SessionRecord, SessionRegistry

if TYPE_CHECKING:
    from .conftest import Backdoor

MakeRecord = Callable[..., SessionRecord]
NewSessionId = Callable[[], str]

LONG_TTL_MS = 10_000


def forged(session_id: str) -> Lease:
    return Lease(session_id=session_id, token="f" * 32, ttl_ms=LONG_TTL_MS)


async def test_backends_satisfy_the_protocol(registry: SessionRegistry) -> None:
    """Each backend is structurally a SessionRegistry."""
    assert isinstance(registry, SessionRegistry)


# ---- locks -----------------------------------------------------------------


async def test_lock_is_exclusive(registry: SessionRegistry, sid: str) -> None:
    """While a lease is live, nobody else gets the lock."""
    lease = await registry.acquire_lock(sid, ttl_ms=LONG_TTL_MS)
    assert lease is not None
    assert lease.session_id == sid
    assert await registry.acquire_lock(sid, ttl_ms=LONG_TTL_MS) is None


async def test_concurrent_acquires_have_one_winner(registry: SessionRegistry, sid: str) -> None:
    """Of many simultaneous acquires, exactly one gets a lease."""
    results: list[Lease | None] = []

    async def take() -> None:
        results.append(await registry.acquire_lock(sid, ttl_ms=LONG_TTL_MS))

    async with anyio.create_task_group() as tg:
        for _ in range(20):
            tg.start_soon(take)
    assert len([lease for lease in results if lease is not None]) == 1


async def test_locks_are_per_session(
    registry: SessionRegistry, sid: str, new_session_id: NewSessionId
) -> None:
    """Holding one session does not block another."""
    assert await registry.acquire_lock(sid, ttl_ms=LONG_TTL_MS) is not None
    assert await registry.acquire_lock(new_session_id(), ttl_ms=LONG_TTL_MS) is not None


async def test_tokens_are_unique(registry: SessionRegistry, sid: str) -> None:
    """Re-acquiring after release yields a different token."""
    first = await registry.acquire_lock(sid, ttl_ms=LONG_TTL_MS)
    assert first is not None
    assert await registry.release(first)
    second = await registry.acquire_lock(sid, ttl_ms=LONG_TTL_MS)
    assert second is not None
    assert second.token != first.token
    assert len(first.token) >= 32


async def test_release_only_by_owner(registry: SessionRegistry, sid: str) -> None:
    """Release is compare-and-delete: a wrong token leaves the lock in place."""
    lease = await registry.acquire_lock(sid, ttl_ms=LONG_TTL_MS)
    assert lease is not None
    assert await registry.release(forged(sid)) is False
    assert await registry.acquire_lock(sid, ttl_ms=LONG_TTL_MS) is None
    assert await registry.release(lease) is True
    assert await registry.release(lease) is False
    assert await registry.acquire_lock(sid, ttl_ms=LONG_TTL_MS) is not None


async def test_renew_only_by_owner(registry: SessionRegistry, sid: str) -> None:
    """Renew is compare-and-pexpire: only the owner extends the lock."""
    lease = await registry.acquire_lock(sid, ttl_ms=150)
    assert lease is not None
    assert await registry.renew(forged(sid), ttl_ms=LONG_TTL_MS) is False
    assert await registry.renew(lease, ttl_ms=LONG_TTL_MS) is True
    await anyio.sleep(0.3)
    assert await registry.acquire_lock(sid, ttl_ms=LONG_TTL_MS) is None


async def test_expiry_lets_another_take_it(registry: SessionRegistry, sid: str) -> None:
    """An expired lock is free; the old lease can then neither renew nor release it."""
    old = await registry.acquire_lock(sid, ttl_ms=50)
    assert old is not None
    await anyio.sleep(0.15)
    new = await registry.acquire_lock(sid, ttl_ms=LONG_TTL_MS)
    assert new is not None
    assert await registry.renew(old, ttl_ms=LONG_TTL_MS) is False
    assert await registry.release(old) is False
    assert await registry.acquire_lock(sid, ttl_ms=LONG_TTL_MS) is None


async def test_expired_lock_cannot_be_renewed(registry: SessionRegistry, sid: str) -> None:
    """Renewal does not resurrect a lock that already expired."""
    lease = await registry.acquire_lock(sid, ttl_ms=50)
    assert lease is not None
    await anyio.sleep(0.15)
    assert await registry.renew(lease, ttl_ms=LONG_TTL_MS) is False


# ---- generations -----------------------------------------------------------


async def test_generations_start_at_zero_and_increase(
    registry: SessionRegistry, sid: str, new_session_id: NewSessionId
) -> None:
    """The counter reads 0 until first incremented, then 1, 2, …"""
    assert await registry.current_generation(sid) == 0
    assert await registry.next_generation(sid) == 1
    assert await registry.next_generation(sid) == 2
    assert await registry.current_generation(sid) == 2
    assert await registry.current_generation(new_session_id()) == 0


async def test_a_floor_moves_the_generation_past_what_the_store_holds(
    registry: SessionRegistry, sid: str
) -> None:
    """``above``: after a lost counter the next generation still passes the newest
    checkpoint's, so a new holder never reuses an old holder's key; the counter
    never moves back either."""
    assert await registry.next_generation(sid, above=41) == 42
    assert await registry.current_generation(sid) == 42
    assert await registry.next_generation(sid, above=3) == 43
    assert await registry.next_generation(sid) == 44
    with pytest.raises(ValueError, match="above"):
        await registry.next_generation(sid, above=-1)


async def test_a_wall_clock_floor_stays_exact(registry: SessionRegistry, sid: str) -> None:
    """A hold after a wipe floors the generation at the wall clock in milliseconds (13
    digits until the year 2286): every backend hands out the exact next integers, which
    Redis's Lua (doubles, printed with 14 digits) must not round or print in exponent
    form."""
    floor = 9_999_999_999_998  # the last 13-digit millisecond count, in the year 2286
    assert await registry.next_generation(sid, above=floor) == floor + 1
    assert await registry.next_generation(sid) == floor + 2
    assert await registry.current_generation(sid) == floor + 2
    assert await registry.next_generation(sid, above=floor) == floor + 3


async def test_concurrent_generations_are_distinct(registry: SessionRegistry, sid: str) -> None:
    """50 concurrent increments hand out 50 distinct, consecutive generations."""
    seen: list[int] = []

    async def bump() -> None:
        seen.append(await registry.next_generation(sid))

    async with anyio.create_task_group() as tg:
        for _ in range(50):
            tg.start_soon(bump)
    assert sorted(seen) == list(range(1, 51))
    assert await registry.current_generation(sid) == 50


# ---- fenced writes ---------------------------------------------------------


async def test_put_and_get_round_trip(
    registry: SessionRegistry, sid: str, make_record: MakeRecord
) -> None:
    """The holder's record reads back equal."""
    lease = await registry.acquire_lock(sid, ttl_ms=LONG_TTL_MS)
    assert lease is not None
    record = make_record(sid, generation=await registry.next_generation(sid))
    assert await registry.get(sid) is None
    await registry.put(lease, record)
    assert await registry.get(sid) == record
    suspended = make_record(sid, generation=record.generation, state="suspended", endpoint=None)
    await registry.put(lease, suspended)
    assert await registry.get(sid) == suspended


async def test_put_rejected_without_the_lock(
    registry: SessionRegistry, sid: str, make_record: MakeRecord
) -> None:
    """Neither a forged lease nor a released one can write."""
    record = make_record(sid, generation=await registry.next_generation(sid))
    with pytest.raises(LockLostError):
        await registry.put(forged(sid), record)
    lease = await registry.acquire_lock(sid, ttl_ms=LONG_TTL_MS)
    assert lease is not None
    with pytest.raises(LockLostError):
        await registry.put(forged(sid), record)
    assert await registry.release(lease)
    with pytest.raises(LockLostError):
        await registry.put(lease, record)
    assert await registry.get(sid) is None


async def test_put_rejected_for_a_stale_generation(
    registry: SessionRegistry, sid: str, make_record: MakeRecord
) -> None:
    """A holder whose generation was superseded is fenced out (FencedError)."""
    lease = await registry.acquire_lock(sid, ttl_ms=LONG_TTL_MS)
    assert lease is not None
    stale = await registry.next_generation(sid)
    current = await registry.next_generation(sid)
    with pytest.raises(FencedError) as caught:
        await registry.put(lease, make_record(sid, generation=stale))
    assert isinstance(caught.value, LockLostError)
    assert (caught.value.generation, caught.value.current_generation) == (stale, current)
    assert await registry.get(sid) is None
    await registry.put(lease, make_record(sid, generation=current))


async def test_put_rejects_a_record_for_another_session(
    registry: SessionRegistry, sid: str, make_record: MakeRecord, new_session_id: NewSessionId
) -> None:
    """A lease only covers its own session."""
    lease = await registry.acquire_lock(sid, ttl_ms=LONG_TTL_MS)
    assert lease is not None
    with pytest.raises(ValueError, match="another session"):
        await registry.put(lease, make_record(new_session_id(), generation=0))


async def test_stale_worker_cannot_write(
    registry: SessionRegistry, sid: str, make_record: MakeRecord
) -> None:
    """A worker whose lock expired and was re-acquired elsewhere cannot write, at any generation."""
    stale = await registry.acquire_lock(sid, ttl_ms=80)
    assert stale is not None
    stale_generation = await registry.next_generation(sid)
    await registry.put(stale, make_record(sid, generation=stale_generation))

    await anyio.sleep(0.2)  # the stale worker "pauses" past its TTL
    fresh = await registry.acquire_lock(sid, ttl_ms=LONG_TTL_MS)
    assert fresh is not None
    fresh_record = make_record(sid, generation=await registry.next_generation(sid), sandbox_id="b")
    await registry.put(fresh, fresh_record)

    for generation in (stale_generation, stale_generation + 100):
        with pytest.raises(LockLostError) as caught:
            await registry.put(stale, make_record(sid, generation=generation, sandbox_id="a"))
        assert not isinstance(caught.value, FencedError), "the token check comes first"
    with pytest.raises(LockLostError):
        await registry.delete(stale, sid, generation=stale_generation + 100)
    assert await registry.get(sid) == fresh_record


async def test_delete_is_fenced(
    registry: SessionRegistry, sid: str, make_record: MakeRecord, new_session_id: NewSessionId
) -> None:
    """Delete needs the lock and a current generation; it keeps the generation counter."""
    lease = await registry.acquire_lock(sid, ttl_ms=LONG_TTL_MS)
    assert lease is not None
    generation = await registry.next_generation(sid)
    record = make_record(sid, generation=generation)
    await registry.put(lease, record)
    await registry.touch(sid, at_s=100.0)

    with pytest.raises(LockLostError):
        await registry.delete(forged(sid), sid, generation=generation)
    with pytest.raises(ValueError, match="another session"):
        await registry.delete(lease, new_session_id(), generation=generation)
    newer = await registry.next_generation(sid)
    with pytest.raises(FencedError):
        await registry.delete(lease, sid, generation=generation)
    assert await registry.get(sid) == record

    await registry.delete(lease, sid, generation=newer)
    assert await registry.get(sid) is None
    assert await registry.list_records() == []
    assert await registry.idle_sessions(older_than_s=0, now_s=1e12) == []
    assert await registry.current_generation(sid) == newer
    await registry.delete(lease, sid, generation=newer)  # already gone: quiet


# ---- corrupt records -------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        b"\x00\xffnot json{",
        b'{"session_id": "rt_x"}',
        b"[]",
    ],
)
async def test_corrupt_record_reads_as_missing(
    registry: SessionRegistry,
    backdoor: Backdoor,
    sid: str,
    raw: bytes,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Garbage in the record slot reads as None and logs one WARNING naming the session only."""
    await backdoor.corrupt_record(sid, raw)
    with caplog.at_level(logging.DEBUG, logger="sandcell_orchestrator.registry"):
        assert await registry.get(sid) is None
        assert await registry.get(sid) is None
        assert await registry.list_records() == []
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert sid in warnings[0].getMessage()
    for r in caplog.records:
        assert raw.decode("utf-8", "replace") not in r.getMessage()


async def test_record_under_another_sessions_key_is_corrupt(
    registry: SessionRegistry,
    backdoor: Backdoor,
    sid: str,
    caplog: pytest.LogCaptureFixture,
    make_record: MakeRecord,
    new_session_id: NewSessionId,
) -> None:
    """A well-formed record filed under the wrong key is not trusted."""
    other = make_record(new_session_id(), generation=1)
    await backdoor.corrupt_record(sid, other.to_json())
    with caplog.at_level(logging.WARNING, logger="sandcell_orchestrator.registry"):
        assert await registry.get(sid) is None
    assert [r.levelno for r in caplog.records] == [logging.WARNING]


async def test_put_repairs_a_corrupt_record(
    registry: SessionRegistry,
    backdoor: Backdoor,
    sid: str,
    caplog: pytest.LogCaptureFixture,
    make_record: MakeRecord,
) -> None:
    """The holder can overwrite a corrupt record; a later corruption warns again."""
    await backdoor.corrupt_record(sid, b"garbage")
    assert await registry.get(sid) is None
    lease = await registry.acquire_lock(sid, ttl_ms=LONG_TTL_MS)
    assert lease is not None
    record = make_record(sid, generation=await registry.next_generation(sid))
    await registry.put(lease, record)
    assert await registry.get(sid) == record
    await backdoor.corrupt_record(sid, b"garbage again")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sandcell_orchestrator.registry"):
        assert await registry.get(sid) is None
    assert len(caplog.records) == 1


# ---- last seen, listing ----------------------------------------------------


async def test_touch_and_idle_sessions(
    registry: SessionRegistry, new_session_id: NewSessionId
) -> None:
    """Idle means last seen at or before now - older_than; touch never moves back."""
    a, b, c = new_session_id(), new_session_id(), new_session_id()
    await registry.touch(a, at_s=100.0)
    await registry.touch(b, at_s=200.0)
    await registry.touch(c, at_s=300.0)
    assert await registry.idle_sessions(older_than_s=50, now_s=250.0) == [a, b]
    assert await registry.idle_sessions(older_than_s=50, now_s=249.0) == [a]
    assert await registry.idle_sessions(older_than_s=500, now_s=250.0) == []

    await registry.touch(a, at_s=10.0)  # a skewed clock must not make a look idle
    assert await registry.idle_sessions(older_than_s=0, now_s=150.0) == [a]
    await registry.touch(a, at_s=400.0)
    assert await registry.idle_sessions(older_than_s=50, now_s=400.0) == [b, c]


async def test_list_records(
    registry: SessionRegistry, make_record: MakeRecord, new_session_id: NewSessionId
) -> None:
    """list_records returns every record, ordered by session id."""
    assert await registry.list_records() == []
    records = []
    for _ in range(3):
        sid = new_session_id()
        lease = await registry.acquire_lock(sid, ttl_ms=LONG_TTL_MS)
        assert lease is not None
        record = make_record(sid, generation=await registry.next_generation(sid))
        await registry.put(lease, record)
        records.append(record)
    assert await registry.list_records() == sorted(records, key=lambda r: r.session_id)


# ---- input validation ------------------------------------------------------


@pytest.mark.parametrize("bad", ["", "session-1", "rt_" + "A" * 64, "rt_*", "rt_" + "0" * 63])
async def test_session_ids_are_validated(registry: SessionRegistry, bad: str) -> None:
    """Only runtime session ids reach a storage key."""
    with pytest.raises(ValueError, match="runtime session id"):
        await registry.acquire_lock(bad, ttl_ms=LONG_TTL_MS)
    with pytest.raises(ValueError, match="runtime session id"):
        await registry.next_generation(bad)
    with pytest.raises(ValueError, match="runtime session id"):
        await registry.get(bad)
    with pytest.raises(ValueError, match="runtime session id"):
        await registry.touch(bad, at_s=1.0)


async def test_ttl_must_be_positive(registry: SessionRegistry, sid: str) -> None:
    """A zero TTL is a bug, not a lock that never expires."""
    with pytest.raises(ValueError, match="ttl_ms"):
        await registry.acquire_lock(sid, ttl_ms=0)
    lease = await registry.acquire_lock(sid, ttl_ms=LONG_TTL_MS)
    assert lease is not None
    with pytest.raises(ValueError, match="ttl_ms"):
        await registry.renew(lease, ttl_ms=-1)


async def test_close_is_idempotent(registry: SessionRegistry) -> None:
    """close() twice is quiet."""
    await registry.close()
    await registry.close()
