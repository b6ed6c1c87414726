"""The registry's public API is exported on purpose, and its value types are strict."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import redis.asyncio

import sandcell_orchestrator.registry as registry_module
from sandcell_orchestrator.errors import LockLostError
from sandcell_orchestrator.registry import FencedError, Lease, SessionRecord

MakeRecord = Callable[..., SessionRecord]


def test_all_is_pinned() -> None:
    """__all__ is exactly the intended surface, and every name resolves."""
    assert sorted(registry_module.__all__) == [
        "E2bSandboxRow",
        "E2bSandboxState",
        "E2bSandboxTable",
        "E2bStartKey",
        "FencedError",
        "IdempotencyEntry",
        "IdempotencyStore",
        "IdempotentAnswer",
        "InProcessRegistry",
        "Lease",
        "RedisRegistry",
        "SessionIndex",
        "SessionOwner",
        "SessionRecord",
        "SessionRegistry",
        "SessionState",
        "SessionStore",
        "SlotCounter",
        "SqliteRegistry",
        "hold_session",
        "validate_e2b_sandbox_id",
        "validate_idempotency_key",
        "validate_session_id",
        "validate_slot_scope",
    ]
    for name in registry_module.__all__:
        assert getattr(registry_module, name) is not None
    with pytest.raises(AttributeError):
        _ = registry_module.NoSuchThing  # type: ignore[attr-defined]


def test_fenced_error_is_a_lock_lost_error() -> None:
    """Callers that handle LockLostError also handle fencing."""
    assert issubclass(FencedError, LockLostError)
    assert FencedError("x", generation=1, current_generation=2).retryable


def test_lease_is_frozen_and_hides_its_token() -> None:
    """Lease is immutable; its repr omits the token."""
    lease = Lease(session_id="rt_" + "0" * 64, token="s3cr3t" * 5, ttl_ms=1_000)
    assert "s3cr3t" not in repr(lease)
    with pytest.raises(dataclasses.FrozenInstanceError):
        lease.token = "other"  # type: ignore[misc]


def test_record_round_trips(sid: str, make_record: MakeRecord) -> None:
    """to_json / from_json are inverse; the record is frozen."""
    record = make_record(sid, generation=3, checkpoint_key=None, state="suspended")
    assert SessionRecord.from_json(record.to_json()) == record
    with pytest.raises(AttributeError):
        record.generation = 4  # type: ignore[misc]


@pytest.mark.parametrize(
    "changes",
    [
        {"session_id": "session-1"},
        {"generation": -1},
        {"provider": ""},
        {"sandbox_uuid": ""},
    ],
)
def test_invalid_records_are_refused(
    sid: str, make_record: MakeRecord, changes: dict[str, object]
) -> None:
    """A record that could address another key or break fencing cannot be built."""
    fields = msgspec.structs.asdict(make_record(sid, generation=1))
    with pytest.raises(ValueError, match="must"):
        SessionRecord(**{**fields, **changes})


def test_unstorable_records_are_refused(sid: str, make_record: MakeRecord) -> None:
    """A record that would read back as corrupt is refused before it is written."""
    record = make_record(sid, generation=1, state="running")
    with pytest.raises(ValueError, match="state"):
        record.to_json()


def test_decoding_takes_newer_fields_but_not_unknown_states(
    sid: str, make_record: MakeRecord
) -> None:
    """A field a newer worker added is ignored (rolling upgrades share the registry);
    an unknown state still fails to decode."""
    record = make_record(sid, generation=1)
    good = msgspec.json.decode(record.to_json())
    assert SessionRecord.from_json(msgspec.json.encode({**good, "extra": 1})) == record
    with pytest.raises(msgspec.ValidationError):
        SessionRecord.from_json(msgspec.json.encode({**good, "state": "running"}))


def test_every_backend_is_a_session_registry(tmp_path: Path) -> None:
    """The composed Protocol (store, index, idempotency, E2B table) fits every backend."""
    from sandcell_orchestrator.registry import (
        E2bSandboxTable,
        IdempotencyStore,
        InProcessRegistry,
        RedisRegistry,
        SessionIndex,
        SessionRegistry,
        SessionStore,
        SlotCounter,
        SqliteRegistry,
    )

    client = redis.asyncio.Redis()
    backends = [
        InProcessRegistry(),
        SqliteRegistry(tmp_path / "r.sqlite3"),
        RedisRegistry(client),
    ]
    for backend in backends:
        for protocol in (
            SessionStore,
            SessionIndex,
            IdempotencyStore,
            E2bSandboxTable,
            SlotCounter,
        ):
            assert isinstance(backend, protocol), (backend, protocol)
        assert isinstance(backend, SessionRegistry)
