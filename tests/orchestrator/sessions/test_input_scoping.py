"""Input refs are scoped to the caller's namespace on the runner's file-server pull too."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from sandcell_orchestrator.errors import InputMissingError
from sandcell_orchestrator.providers.local import LocalProvider, LocalSettings
from sandcell_orchestrator.registry import InProcessRegistry
from sandcell_orchestrator.sessions.execution import ExecutionService, Identity
from sandcell_orchestrator.snapshots import SnapshotStore
from sandcell_protocol import ExecuteRequest, FileRef, scoped_storage_session
from tests.runner.inputs import FileServer, Served

ALICE = Identity("tenant-a", "alice")
BOB = Identity("tenant-b", "bob")


@pytest.fixture
def file_server() -> Iterator[FileServer]:
    server = FileServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def pulling_service(
    runtime_dir: Path, dir_store: SnapshotStore, file_server: FileServer
) -> AsyncIterator[ExecutionService]:
    """No input source: runners pull every ref from the file server themselves."""
    settings = LocalSettings(
        runtime_dir=runtime_dir / "rt", runner_env={"SANDCELL_FILE_SERVER_URL": file_server.url}
    )
    provider = LocalProvider(settings)
    service = ExecutionService(
        provider=provider, registry=InProcessRegistry(), store=dir_store, mode="stateless"
    )
    yield service
    await service.aclose(destroy_sandboxes=True)
    await provider.close()


async def test_the_runner_pulls_the_callers_scoped_ref_only(
    pulling_service: ExecutionService, file_server: FileServer
) -> None:
    """The pull URL carries the namespace-scoped storage session: tenant A's object is
    served to A, and B naming it asks the file server for B's own (absent) object."""
    path_a = file_server.serve(
        scoped_storage_session("tenant-a", "sess"), "obj-1", Served(b"A's bytes")
    )
    request = ExecuteRequest(
        language="python",
        code="print(open('in.txt').read())",
        files=[FileRef(storage_session="sess", object_id="obj-1", name="in.txt")],
    )

    result = await pulling_service.execute(request, ALICE)
    assert result.stdout == "A's bytes\n"

    with pytest.raises(InputMissingError):
        await pulling_service.execute(request, BOB)
    path_b = FileServer.path_of(scoped_storage_session("tenant-b", "sess"), "obj-1")
    assert dict(file_server.hits) == {path_a: 1, path_b: 1}
