"""Build the orchestrator's services from ``OrchestratorSettings``, and tear them down.

This is the one place that turns configuration into objects, so the CLI, the
HTTP service and an embedding control plane all get the same wiring::

    settings = OrchestratorSettings.from_env(os.environ)
    async with open_services(settings) as services:
        result = await services.execution.execute(request, identity, hint="demo")

Backends are chosen by configuration (DESIGN rule 5) and imported only when
selected, so the embedded default never imports redis, boto3 or a Docker client.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from .config import OrchestratorSettings
from .extras import needs_extra
from .metrics import Metrics, declared_metrics
from .providers import open_provider
from .providers.base import SandboxProvider
from .registry import SessionRegistry
from .sessions.execution import ExecutionService
from .sessions.input_store import SnapshotInputStore
from .sessions.inputs import DirectoryInputSource, InputStore
from .sessions.manager import SandboxManager
from .sessions.owners import SessionOwners
from .snapshots import SnapshotStore, open_snapshot_store

__all__ = ["Services", "open_provider", "open_registry", "open_services"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Services:
    """The wired-up orchestrator: what ``open_services`` yields."""

    settings: OrchestratorSettings
    store: SnapshotStore
    registry: SessionRegistry
    provider: SandboxProvider
    inputs: InputStore
    """Input objects: a directory embedded, the snapshot store's ``inputs/`` with S3."""
    metrics: Metrics
    manager: SandboxManager
    """The one sandbox lifecycle every surface uses (turns, app instances, admin)."""
    execution: ExecutionService
    owners: SessionOwners
    """Whose each session is: the registry's session index, kept in the store too."""


def open_registry(settings: OrchestratorSettings) -> SessionRegistry:
    """The registry ``SANDCELL_REGISTRY_URL`` names: unset, the SQLite file under
    ``SANDCELL_HOME`` every process on this machine shares; ``memory://`` an
    in-process one (only where this process owns every session); else Redis."""
    url = settings.registry_url
    if url is None or url.startswith("sqlite:"):
        from .registry.sqlite import SqliteRegistry

        return SqliteRegistry(settings.registry_path)
    if url == "memory://":
        from .registry.memory import InProcessRegistry

        return InProcessRegistry()
    with needs_extra("redis", "SANDCELL_REGISTRY_URL"):
        from .registry.redis import RedisRegistry

    return RedisRegistry.from_url(url)


@contextlib.asynccontextmanager
async def open_services(
    settings: OrchestratorSettings, *, keep_warm: bool = True, keep_sandboxes: bool = False
) -> AsyncIterator[Services]:
    """Build every service from ``settings``; close them in reverse order on exit.

    With an embedded registry (SQLite or in-process), the sandboxes this process
    launched are destroyed on exit (the local provider's runners die with it
    anyway) and their rows marked suspended; their checkpoints stay in the
    snapshot store, so the next process restores the session. ``keep_warm=False``
    (a process that runs one turn, like ``sandcell exec``) parks each session's
    sandbox the same way at the end of its turn, while the turn still holds the
    session, so no other process is ever handed a sandbox about to die.
    ``keep_sandboxes=True`` leaves them running at exit instead: for sandboxes that
    outlive this process (``sandcell run``'s detached local runners).
    """
    async with contextlib.AsyncExitStack() as stack:
        store = open_snapshot_store(
            settings.snapshot_url, default_dir=settings.snapshot_dir, s3=settings.s3
        )
        stack.push_async_callback(store.close)
        registry = open_registry(settings)
        stack.push_async_callback(registry.close)
        provider = open_provider(settings.provider, answer_caps=settings.answer_caps)
        stack.push_async_callback(provider.close)
        # With S3, inputs live beside the checkpoints so that every process sees them.
        inputs: InputStore = (
            SnapshotInputStore(store)
            if settings.s3 is not None
            else DirectoryInputSource(settings.inputs_dir)
        )
        metrics = declared_metrics()
        manager = SandboxManager(
            provider,
            registry,
            store,
            budgets=settings.budgets,
            checkpoint_max_bytes=settings.checkpoint_max_bytes,
            checkpoint_grace_s=settings.checkpoint_grace_s,
            metrics=metrics,
        )
        embedded = not settings.distributed_registry
        stack.push_async_callback(manager.aclose, destroy_sandboxes=embedded and not keep_sandboxes)
        execution = ExecutionService(
            manager=manager,
            mode=settings.session_mode,
            inputs=inputs,
            keep_warm=keep_warm,
            checkpoint_retry_s=settings.checkpoint_retry_s,
            max_warm_per_tenant=settings.max_warm_sessions,
        )
        yield Services(
            settings=settings,
            store=store,
            registry=registry,
            provider=provider,
            inputs=inputs,
            metrics=metrics,
            manager=manager,
            execution=execution,
            owners=SessionOwners(registry, store),
        )
