"""A keyed E2B create whose worker died after it registered the sandbox, before it
stored the create's answer (issue 20): the claim lapses, and the retry answers that
sandbox instead of making a second one (a sandbox nobody would ever be told of, in
the tenant's running count until its timeout). The sandbox's id comes from the
claimed key, so the retry finds its row. Real redis-server; the worker's death is a
registry view whose ``finish_idempotency`` fails, as a dead worker's never comes."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

from sandcell_orchestrator.e2b import create_once as create_once_module
from sandcell_orchestrator.e2b.create_once import create_once
from sandcell_orchestrator.e2b.sandbox import E2bSandbox
from sandcell_orchestrator.errors import RegistryError
from sandcell_orchestrator.providers.base import SandboxSpec
from sandcell_orchestrator.registry import E2bSandboxRow, RedisRegistry, SessionRegistry
from tests.orchestrator.conftest import redis_url

__all__ = ["redis_url"]


class _DiesBeforeAnswering:
    def __init__(self, inner: SessionRegistry) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def finish_idempotency(self, key: str, **_: object) -> bool:
        raise RegistryError("injected: the worker died before storing the answer")


@pytest.fixture
async def registry(redis_url: str) -> AsyncIterator[SessionRegistry]:
    backend = RedisRegistry.from_url(redis_url, prefix=f"create-{uuid.uuid4().hex}:")
    yield backend
    await backend.close()


def _row(sandbox_id: str, owner: str) -> E2bSandboxRow:
    return E2bSandboxRow(
        sandbox_id=sandbox_id,
        namespace=owner,
        template="base",
        session_id=f"e2b-{uuid.uuid4().hex}",
        access_token="a" * 43,
        traffic_token="t" * 43,
        metadata={},
        env={},
        egress=None,
        started_at_s=0.0,
        end_at_s=3600.0,
        auto_pause=False,
        state="running",
    )


async def test_a_retry_after_the_creating_worker_died_answers_its_sandbox(
    registry: SessionRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(create_once_module, "CREATE_CLAIM_TTL_MS", 300)
    made: list[str] = []

    async def make(sandbox_id: str | None = None) -> E2bSandbox:
        row = _row(sandbox_id or uuid.uuid4().hex[:20], "tenant-a")
        assert await registry.add_e2b_sandbox(row)
        made.append(row.sandbox_id)
        return E2bSandbox(row=row, spec=SandboxSpec())

    async def view(row: E2bSandboxRow) -> E2bSandbox:
        return E2bSandbox(row=row, spec=SandboxSpec())

    dying = _DiesBeforeAnswering(registry)
    first = await create_once(dying, owner="tenant-a", key="k-1", make=make, view=view)  # type: ignore[arg-type]
    await anyio.sleep(0.5)  # the dead worker's claim lapses
    again = await create_once(registry, owner="tenant-a", key="k-1", make=make, view=view)
    assert again.sandbox_id == first.sandbox_id
    assert made == [first.sandbox_id]
    # Another tenant's equal key is its own create.
    other = await create_once(registry, owner="tenant-b", key="k-1", make=make, view=view)
    assert other.sandbox_id != first.sandbox_id
    assert len(made) == 2
