"""The ``InputStore`` contract, for the directory store and the S3 one (moto's server)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sandcell_orchestrator.errors import InputMissingError
from sandcell_orchestrator.sessions.input_store import SnapshotInputStore
from sandcell_orchestrator.sessions.inputs import DirectoryInputSource, InputStore
from sandcell_orchestrator.snapshots import S3SnapshotStore
from sandcell_protocol import FileRef, ProtocolError, scoped_storage_session
from tests.golden import load_golden
from tests.orchestrator.conftest import S3Server

REFUSED = load_golden()["input_ref"]["rejected"]
MINE = scoped_storage_session("tenant-a", "sess")
THEIRS = scoped_storage_session("tenant-b", "sess")


@pytest.fixture(params=["directory", "s3"])
async def inputs(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[InputStore]:
    if request.param == "directory":
        yield DirectoryInputSource(tmp_path / "inputs")
        return
    server: S3Server = request.getfixturevalue("s3_server")
    async with S3SnapshotStore(server.settings(f"t-{uuid.uuid4().hex}")) as store:
        yield SnapshotInputStore(store)


async def test_objects_round_trip_per_scoped_session(inputs: InputStore) -> None:
    """Written objects read back, list and delete within their scoped storage session
    only; the same names under another tenant's scope are another, absent object."""
    await inputs.write(MINE, "obj-1", b"one")
    await inputs.write(MINE, "obj-2", b"")
    await inputs.write(MINE, "obj-1", b"one, replaced")
    assert await inputs.fetch(MINE, "obj-1") == b"one, replaced"
    assert await inputs.fetch(MINE, "obj-2") == b""
    assert await inputs.names(MINE) == ["obj-1", "obj-2"]
    assert await inputs.fetch(THEIRS, "obj-1") is None
    assert await inputs.names(THEIRS) == []
    assert await inputs.read(FileRef(storage_session=MINE, object_id="obj-1", name="f")) == (
        b"one, replaced"
    )
    with pytest.raises(InputMissingError, match="obj-1"):
        await inputs.read(FileRef(storage_session=THEIRS, object_id="obj-1", name="f"))
    await inputs.remove(MINE, "obj-1")
    await inputs.remove(MINE, "obj-1")
    assert await inputs.fetch(MINE, "obj-1") is None
    assert await inputs.names(MINE) == ["obj-2"]
    assert await inputs.fetch(MINE, "-never-written") is None


async def test_refused_parts_never_reach_the_store(inputs: InputStore) -> None:
    """Every golden refused value is a ProtocolError in either part, for every method."""
    for value in REFUSED:
        for storage_session, object_id in ((value, "obj-1"), (MINE, value)):
            with pytest.raises(ProtocolError):
                await inputs.write(storage_session, object_id, b"x")
            with pytest.raises(ProtocolError):
                await inputs.fetch(storage_session, object_id)
            with pytest.raises(ProtocolError):
                await inputs.remove(storage_session, object_id)
    with pytest.raises(ProtocolError):
        await inputs.names("..")
