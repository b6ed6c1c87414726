"""Input refs through a real ``sandcell serve`` (issue 14, item 1): no traversal out of
the input store, no link followed, and no tenant reads another's object."""

from __future__ import annotations

import asyncio
import os

import pytest

from sandcell_orchestrator.sessions.inputs import DirectoryInputSource
from sandcell_protocol import ErrorCode, ExecuteResult, decode, scoped_storage_session
from tests.orchestrator.serve.test_serve import (
    KEY_B,
    Service,
    StartService,
    error_of,
    start_service,
)

__all__ = ["start_service"]

CANARY = "canary-SECRET-7f3a"
READ = "print(open('got.txt').read())"


@pytest.fixture
async def service(start_service: StartService) -> Service:
    return await start_service(SANDCELL_RUNTIME_SESSION_MODE="stateless")


def _ref(storage_session: str, object_id: str) -> dict[str, str]:
    return {"storage_session": storage_session, "object_id": object_id, "name": "got.txt"}


async def test_traversal_out_of_the_input_store_is_refused(service: Service) -> None:
    """The issue's probe (``..`` naming a file under SANDCELL_HOME) and its relatives are
    400 ``bad_request`` before any lookup; a link planted inside the store is never
    followed and answers ``input_missing``."""
    home = service.settings.home
    home.mkdir(parents=True, exist_ok=True)
    (home / "canary-secret.txt").write_text(CANARY)
    for ref in (
        _ref("..", "canary-secret.txt"),
        _ref(".", "../canary-secret.txt"),
        _ref("%2e%2e", "canary-secret.txt"),
        _ref("sess", "../../canary-secret.txt"),
        _ref("sess/../..", "canary-secret.txt"),
        _ref("", "x"),
    ):
        response = await service.exec(key=KEY_B, code=READ, files=[ref])
        assert response.status_code == 400, (ref, response.text)
        assert error_of(response).error.code == ErrorCode.BAD_REQUEST
        assert CANARY not in response.text

    # Links planted in B's own part of the store: a storage-session directory that
    # is a link, and an object that is one.
    inputs = service.settings.inputs_dir
    inputs.mkdir(parents=True, exist_ok=True)
    os.symlink(home, inputs / scoped_storage_session("tenant-b", "linked-dir"))
    real = inputs / scoped_storage_session("tenant-b", "real")
    real.mkdir()
    os.symlink(home / "canary-secret.txt", real / "linked-object")
    for ref in (_ref("linked-dir", "canary-secret.txt"), _ref("real", "linked-object")):
        response = await service.exec(key=KEY_B, code=READ, files=[ref])
        assert response.status_code == 400, (ref, response.text)
        assert error_of(response).error.code == ErrorCode.INPUT_MISSING
        assert CANARY not in response.text


async def test_another_tenants_object_answers_as_a_missing_one(service: Service) -> None:
    """Tenant A's object is A's alone: B naming A's storage session (or A's scoped name
    for it) gets exactly the answer B gets for an object that does not exist."""
    store = DirectoryInputSource(service.settings.inputs_dir)
    scoped_a = scoped_storage_session("tenant-a", "shared")
    object_id = await _store(store, scoped_a, b"tenant A's data")

    mine = await service.exec(code=READ, files=[_ref("shared", object_id)])
    assert mine.status_code == 200, mine.text
    assert decode(mine.content, ExecuteResult).stdout == "tenant A's data\n"

    missing = await service.exec(key=KEY_B, code=READ, files=[_ref("nowhere", object_id)])
    assert missing.status_code == 400
    assert error_of(missing).error.code == ErrorCode.INPUT_MISSING
    for storage_session in ("shared", scoped_a):
        crossed = await service.exec(key=KEY_B, code=READ, files=[_ref(storage_session, object_id)])
        assert (crossed.status_code, crossed.content) == (missing.status_code, missing.content)
        assert b"tenant A" not in crossed.content


async def _store(store: DirectoryInputSource, storage_session: str, data: bytes) -> str:
    return await asyncio.to_thread(store.store, storage_session, data)
