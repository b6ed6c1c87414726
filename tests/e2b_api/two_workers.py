"""Two E2B workers in this process, as two ``sandcell serve`` processes have them:
each its own ``SandboxManager``, local provider and registry client, over one
redis-server and one S3 (moto's server), sharing the local runtime directory (so
each reaches the runners the other launched). The per-sandbox lock is per worker,
so nothing but the row's compare-and-set orders the two.

``registry_type``: the real ``RedisRegistry`` or a test's subclass of it (a gate
before one call). The sandboxes outlive a worker (a shared registry); what is left
of them at the end is destroyed, and a runner process left behind fails the test.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

import redis.asyncio

from sandcell_orchestrator.e2b.sandbox import E2bSandbox
from sandcell_orchestrator.e2b.sandboxes import E2bSandboxes
from sandcell_orchestrator.providers.local import LocalProvider, LocalSettings
from sandcell_orchestrator.registry import RedisRegistry
from sandcell_orchestrator.sessions.manager import SandboxManager
from sandcell_orchestrator.snapshots import S3SnapshotStore
from sandcell_protocol import EgressPolicy
from tests.fixtures.paths import traversable_dir
from tests.orchestrator.conftest import S3Server
from tests.orchestrator.sessions.conftest import runner_pids

R = TypeVar("R", bound=RedisRegistry)


@dataclass
class Worker(Generic[R]):
    """One worker's E2B sandboxes and its registry client."""

    sandboxes: E2bSandboxes
    registry: R

    @property
    def manager(self) -> SandboxManager:
        return self.sandboxes.manager


@contextlib.asynccontextmanager
async def _worker(
    registry_type: type[R], redis_url: str, prefix: str, s3: S3Server, rt: Path
) -> AsyncIterator[Worker[R]]:
    client = redis.asyncio.Redis.from_url(redis_url)
    registry = registry_type(client, prefix=prefix)
    provider = LocalProvider(LocalSettings(runtime_dir=rt))
    try:
        async with S3SnapshotStore(s3.settings(prefix.rstrip(":"))) as store:
            manager = SandboxManager(provider, registry, store)
            sandboxes = E2bSandboxes(manager, keep_at_exit=True)
            try:
                yield Worker(sandboxes, registry)
            finally:
                await sandboxes.aclose()
                await manager.aclose(destroy_sandboxes=False)
    finally:
        await provider.close()
        await client.aclose()


@contextlib.asynccontextmanager
async def two_workers(
    registry_type: type[R], redis_url: str, s3: S3Server, *, name: str
) -> AsyncIterator[tuple[Worker[R], Worker[R]]]:
    """Two workers on one Redis prefix and one S3 bucket, both removed at the end."""
    prefix = f"{name}{uuid.uuid4().hex[:12]}:"
    with traversable_dir(name) as root:
        rt = root / "rt"
        try:
            async with (
                _worker(registry_type, redis_url, prefix, s3, rt) as one,
                _worker(registry_type, redis_url, prefix, s3, rt) as two,
            ):
                yield one, two
        finally:
            leftovers = runner_pids(rt)
            cleanup = LocalProvider(LocalSettings(runtime_dir=rt))
            for child in rt.iterdir() if rt.exists() else []:
                await cleanup.destroy(child.name)
            await cleanup.close()
            client = redis.asyncio.Redis.from_url(redis_url)
            keys = [key async for key in client.scan_iter(match=f"{prefix}*")]
            if keys:
                await client.delete(*keys)
            await client.aclose()
        assert not leftovers, f"sandbox processes left behind: {leftovers}"


async def running_sandbox(
    worker: Worker[R], owner: str, *, egress: EgressPolicy | None = None
) -> E2bSandbox:
    """A new sandbox of the base template, created on ``worker`` for ``owner``."""
    return await worker.sandboxes.create(
        owner=owner,
        template="base",
        timeout_s=600,
        metadata={},
        env={},
        auto_pause=False,
        egress=egress,
    )
