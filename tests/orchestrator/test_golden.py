"""The orchestrator's side of the shared golden vectors (tests/protocol/golden.json).

The protocol tests pin the derivations themselves; these pin what the
orchestrator does with them: the session id a turn runs under, the key its
checkpoint is stored at, and which stored object counts as the latest.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

from sandcell_orchestrator.providers.local import LocalProvider, LocalSettings
from sandcell_orchestrator.registry import InProcessRegistry
from sandcell_orchestrator.sessions.execution import ExecutionService, Identity
from sandcell_orchestrator.sessions.persistence import Persistence
from sandcell_orchestrator.snapshots import DirectorySnapshotStore
from sandcell_protocol import ExecuteRequest, checkpoint_key, unescape_name
from tests.fixtures.paths import traversable_dir
from tests.golden import load_golden

GOLDEN = load_golden()


async def _one_byte() -> AsyncIterator[bytes]:
    yield b"x"


async def test_a_turn_runs_under_the_golden_session_and_checkpoints_at_the_golden_key() -> None:
    """tenant-1 / user-42 / chat-7 is the golden session; the hold after generation 41
    writes exactly the golden generation-42 key, and the record points at it."""
    session = GOLDEN["runtime_session_id"][0]
    vector = next(v for v in GOLDEN["checkpoint_key"] if v["generation"] == 42)
    assert vector["runtime_session_id"] == session["id"]
    with traversable_dir("golden-") as root:
        provider = LocalProvider(LocalSettings(runtime_dir=root / "rt"))
        registry = InProcessRegistry()
        async with DirectorySnapshotStore(root / "snapshots") as store:
            service = ExecutionService(provider=provider, registry=registry, store=store)
            try:
                assert await registry.next_generation(session["id"], above=40) == 41
                result = await service.execute(
                    ExecuteRequest(language="python", code="open('f', 'w').write('golden')"),
                    Identity(session["namespace"], session["user_id"]),
                    hint=session["hint"],
                )
                assert result.status == "ok"
                record = await registry.get(session["id"])
                assert record is not None
                assert record.checkpoint_key == vector["key"]
                assert await store.exists(vector["key"])
            finally:
                await service.aclose(destroy_sandboxes=True)
                await provider.close()


async def test_the_latest_stored_checkpoint_is_the_highest_golden_generation(
    tmp_path: Path,
) -> None:
    """Found from the store alone (no record): keys that are not checkpoint keys, and
    another session's, are ignored; the old key counts as generation 0."""
    order = GOLDEN["checkpoint_key_order"]
    session = order["runtime_session_id"]
    async with DirectorySnapshotStore(tmp_path) as store:
        for generation in order["generations"]:
            await store.put(checkpoint_key(session, generation), _one_byte(), max_bytes=8)
        for vector in GOLDEN["legacy_checkpoint_key"]:
            await store.put(vector["key"], _one_byte(), max_bytes=8)
        persistence = Persistence(store)
        stored = await persistence.stored(session)
        assert [item.generation for item in stored] == [0, *order["generations"]]
        latest = Persistence.latest(stored)
        assert latest is not None
        assert latest.key == checkpoint_key(session, max(order["generations"]))


async def test_output_files_with_names_that_are_not_utf8_arrive_as_the_golden_names() -> None:
    """A job names files with the golden raw bytes; the orchestrator's result carries
    the golden wire names, and unescaping them gives the bytes back."""
    vectors = GOLDEN["escaped_name"]
    raws = [bytes.fromhex(v["raw_hex"]) for v in vectors if b"/" not in bytes.fromhex(v["raw_hex"])]
    code = "import sys\nfor raw in sys.argv[1:]: open(bytes.fromhex(raw), 'wb').write(b'x')"
    with traversable_dir("golden-") as root:
        provider = LocalProvider(LocalSettings(runtime_dir=root / "rt"))
        async with DirectorySnapshotStore(root / "snapshots") as store:
            service = ExecutionService(provider=provider, registry=InProcessRegistry(), store=store)
            try:
                result = await service.execute(
                    ExecuteRequest(language="python", code=code, args=[r.hex() for r in raws]),
                    Identity("tenant-1", "user-42"),
                    hint=None,
                )
            finally:
                await service.aclose(destroy_sandboxes=True)
                await provider.close()
    assert result.status == "ok", result.stderr
    expected = {v["name"] for v in vectors if bytes.fromhex(v["raw_hex"]) in raws}
    assert {item.name for item in result.files} == expected
    assert {unescape_name(item.name) for item in result.files} == set(raws)


def test_the_golden_egress_events_pass_through_unchanged() -> None:
    """What the runner client decodes from a 1.2 runner's stream is what ``/v1/exec``
    writes again, byte for byte (``egress_stream_events``)."""
    from sandcell_orchestrator.runner.client import _decode_event
    from sandcell_protocol import PROTOCOL_VERSION, encode_event, speaks_at_least

    vector = GOLDEN["egress_stream_events"]
    # This orchestrator announces a version the runner sends them to.
    assert speaks_at_least(PROTOCOL_VERSION, vector["since"])
    for line in vector["lines"]:
        assert encode_event(_decode_event(line)) == line.encode() + b"\n"
