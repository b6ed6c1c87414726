"""Rows and objects another worker stored read back across a rolling upgrade.

Several workers share one Redis and one S3 and are upgraded one at a time: an older
worker reads rows a newer one wrote (with fields it does not know: dropped, at any
depth, a stored copy of a wire message included), and a newer one reads rows an
older one wrote (without the fields added since: their defaults). Each row is
written straight into the real redis-server or moto's S3, as the other version
would have, and read through the code that reads it in production.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import redis.asyncio

from sandcell_orchestrator.registry import RedisRegistry, SessionOwner, SessionRecord
from sandcell_orchestrator.registry.e2b import E2bSandboxRow
from sandcell_orchestrator.sessions.execution import RESULT_CODEC
from sandcell_orchestrator.sessions.owners import SessionOwners, owner_key
from sandcell_orchestrator.sessions.persistence import Persistence
from sandcell_orchestrator.sessions.stateless_answers import (
    StatelessAnswer,
    StatelessAnswers,
    stateless_answer_key,
)
from sandcell_orchestrator.snapshots import S3SnapshotStore, SnapshotStore
from sandcell_orchestrator.snapshots.whole import put_whole
from sandcell_orchestrator.stored import StoredDecoder
from sandcell_protocol import EgressPolicy, ExecuteResult, runtime_session_id
from tests.orchestrator.conftest import S3Server

SID = runtime_session_id("tenant", "u1", "demo")
NEWER = {"written_by": "a newer worker", "limits": {"stdout_bytes": 1}}
"""Fields a newer version added (a scalar and an object)."""

STORED_ROWS: dict[type[msgspec.Struct], set[str]] = {
    SessionRecord: {
        "session_id",
        "provider",
        "sandbox_id",
        "sandbox_uuid",
        "endpoint",
        "generation",
        "checkpoint_key",
        "state",
        "created_at_s",
        "updated_at_s",
    },
    SessionOwner: {"session_id", "namespace", "user_id", "hint"},
    E2bSandboxRow: {
        "sandbox_id",
        "namespace",
        "template",
        "session_id",
        "access_token",
        "traffic_token",
        "metadata",
        "env",
        "egress",
        "started_at_s",
        "end_at_s",
        "auto_pause",
        "state",
    },
    StatelessAnswer: {"fingerprint", "status", "body"},
}
"""Each stored row and the fields it has always had (no default)."""


@pytest.mark.parametrize("row", list(STORED_ROWS), ids=lambda row: row.__name__)
def test_a_stored_row_takes_unknown_fields_and_new_fields_have_defaults(
    row: type[msgspec.Struct],
) -> None:
    """A stored row ignores unknown fields, and every field added to it has a default:
    a required field an older worker never wrote would make all its rows unreadable."""
    assert not row.__struct_config__.forbid_unknown_fields
    required = {
        field.name
        for field in msgspec.structs.fields(row)
        if field.default is msgspec.NODEFAULT and field.default_factory is msgspec.NODEFAULT
    }
    assert required == STORED_ROWS[row], "a field added to a stored row needs a default"


def _record(**changes: Any) -> SessionRecord:
    fields: dict[str, Any] = {
        "session_id": SID,
        "provider": "local",
        "sandbox_id": "sb-1",
        "sandbox_uuid": "uuid-1",
        "endpoint": "http://127.0.0.1:1",
        "generation": 3,
        "checkpoint_key": None,
        "state": "active",
        "created_at_s": 1.0,
        "updated_at_s": 2.0,
    }
    return SessionRecord(**{**fields, **changes})


def _result_json(**extra_file: Any) -> dict[str, Any]:
    result = ExecuteResult(
        status="ok",
        exit_code=0,
        signal=None,
        stdout="42\n",
        stderr="",
        stdout_truncated=False,
        stderr_truncated=False,
        wall_ms=5,
        cpu_ms=4,
        max_rss_kib=None,
        files=[],
        durable=True,
    )
    tree: dict[str, Any] = msgspec.to_builtins(result)
    tree["files"] = [{"name": "a.txt", "size": 1, "sha256": None, **extra_file}]
    return tree


def test_nested_unknown_fields_are_dropped_and_bad_values_still_fail() -> None:
    """Unknown fields go at any depth (an output file of a stored result); a wrong type,
    an unknown enum value and a missing required field still fail."""
    decoder = StoredDecoder(ExecuteResult)
    newer = {**_result_json(**NEWER), **NEWER}
    result = decoder.decode(msgspec.json.encode(newer))
    assert (result.stdout, result.files[0].name) == ("42\n", "a.txt")
    for bad in (
        {**newer, "status": "exploded"},
        {**newer, "wall_ms": "five"},
        {key: value for key, value in newer.items() if key != "stdout"},
    ):
        with pytest.raises(msgspec.ValidationError):
            decoder.decode(msgspec.json.encode(bad))


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[redis.asyncio.Redis]:
    client = redis.asyncio.Redis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
async def registry(client: redis.asyncio.Redis) -> AsyncIterator[RedisRegistry]:
    prefix = f"sandcell-test:{uuid.uuid4().hex}:"
    yield RedisRegistry(client, prefix=prefix)
    keys = [key async for key in client.scan_iter(match=f"{prefix}*")]
    if keys:
        await client.delete(*keys)


async def test_a_newer_workers_session_record_reads_in_redis(
    client: redis.asyncio.Redis, registry: RedisRegistry
) -> None:
    """A record with fields this worker does not know is the session's record, not a
    corrupt one (which would be treated as missing: a second sandbox for the session)."""
    newer = {**msgspec.to_builtins(_record()), **NEWER}
    await client.set(f"{registry.prefix}record:{SID}", msgspec.json.encode(newer))
    await client.sadd(f"{registry.prefix}sessions", SID)
    assert await registry.get(SID) == _record()
    assert [record.session_id for record in await registry.list_records()] == [SID]


async def test_an_older_workers_session_record_reads_with_defaults(
    client: redis.asyncio.Redis, registry: RedisRegistry
) -> None:
    """A record written before ``unsaved``, ``turn_open`` and ``adopted`` existed."""
    older = msgspec.to_builtins(_record())
    for added in ("unsaved", "turn_open", "adopted"):
        del older[added]
    await client.set(f"{registry.prefix}record:{SID}", msgspec.json.encode(older))
    record = await registry.get(SID)
    assert record == _record()
    assert (record.unsaved, record.turn_open, record.adopted) == (False, False, False)


async def test_a_newer_workers_session_owner_reads_in_redis(
    client: redis.asyncio.Redis, registry: RedisRegistry
) -> None:
    owner = SessionOwner(session_id=SID, namespace="tenant", user_id="u1", hint="demo")
    newer = {**msgspec.to_builtins(owner), **NEWER}
    await client.hset(f"{registry.prefix}owners", SID, msgspec.json.encode(newer))
    assert await registry.session_owner(SID) == owner


async def test_a_newer_workers_e2b_row_reads_in_redis(
    client: redis.asyncio.Redis, registry: RedisRegistry
) -> None:
    """Unknown fields of the row and of its egress policy (a protocol message)."""
    row = E2bSandboxRow(
        sandbox_id="a" * 20,
        namespace="tenant",
        template="base",
        session_id=SID,
        access_token="t" * 20,
        traffic_token="r" * 20,
        metadata={},
        env={},
        egress=None,
        started_at_s=1.0,
        end_at_s=2.0,
        auto_pause=False,
        state="running",
    )
    assert await registry.add_e2b_sandbox(row)
    newer = {**msgspec.to_builtins(row), **NEWER, "egress": {"mode": "deny_all", **NEWER}}
    await client.hset(f"{registry.prefix}e2b:{row.sandbox_id}", "row", msgspec.json.encode(newer))
    found = await registry.e2b_sandbox(row.sandbox_id)
    assert found == msgspec.structs.replace(row, egress=EgressPolicy())


@pytest.fixture
async def s3_store(s3_server: S3Server) -> AsyncIterator[SnapshotStore]:
    async with S3SnapshotStore(s3_server.settings(f"t-{uuid.uuid4().hex}")) as store:
        yield store


async def test_a_newer_workers_owner_object_reads_in_s3(
    s3_store: SnapshotStore, registry: RedisRegistry
) -> None:
    """The store's copy of an owner (read when the registry has none: a wiped Redis)."""
    owner = SessionOwner(session_id=SID, namespace="tenant", user_id="u1", hint="demo")
    newer = msgspec.json.encode({**msgspec.to_builtins(owner), **NEWER})
    await put_whole(s3_store, owner_key("tenant", SID), newer, max_bytes=1 << 20)
    owners, _ = await SessionOwners(registry, s3_store).page("tenant", after=None, limit=10)
    assert owners == [owner]


async def test_a_newer_workers_stateless_answer_reads_in_s3(s3_store: SnapshotStore) -> None:
    stored_key = hashlib.sha256(b"compat").hexdigest()
    body = msgspec.json.encode(_result_json())
    newer = {"fingerprint": "f", "status": 200, "body": body, **NEWER}
    await put_whole(
        s3_store, stateless_answer_key(stored_key), msgspec.json.encode(newer), max_bytes=1 << 20
    )
    answer = await StatelessAnswers(s3_store).read_result(stored_key)
    assert answer == StatelessAnswer("f", 200, body)


async def test_a_newer_workers_turn_result_reads_in_s3(s3_store: SnapshotStore) -> None:
    """A keyed turn's saved result, as a retry on an older worker reads it back."""
    persistence = Persistence(s3_store)
    turn_key = hashlib.sha256(b"turn").hexdigest()
    body = msgspec.json.encode({**_result_json(**NEWER), **NEWER})
    await persistence.save_answer(SID, turn_key=turn_key, body=body)
    saved = await persistence.answer(SID, turn_key)
    assert saved is not None
    result = RESULT_CODEC.decode(saved)
    assert (result.stdout, result.durable, result.files[0].name) == ("42\n", True, "a.txt")
