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
from .metrics import METRIC_HELP, Metrics
from .providers import open_provider
from .providers.base import SandboxProvider
from .registry import SessionRegistry
from .sessions.execution import ExecutionService
from .sessions.inputs import DirectoryInputSource
from .sessions.manager import SandboxManager
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
    inputs: DirectoryInputSource
    metrics: Metrics
    manager: SandboxManager
    """The one sandbox lifecycle every surface uses (turns, app instances, admin)."""
    execution: ExecutionService


def open_registry(settings: OrchestratorSettings) -> SessionRegistry:
    """The in-process registry, or Redis when ``SANDCELL_REGISTRY_URL`` is set."""
    if settings.registry_url is None:
        from .registry.memory import InProcessRegistry

        return InProcessRegistry()
    with needs_extra("redis", "SANDCELL_REGISTRY_URL"):
        from .registry.redis import RedisRegistry

    return RedisRegistry.from_url(settings.registry_url)


def _metrics() -> Metrics:
    metrics = Metrics()
    for name, help_text in METRIC_HELP.items():
        metrics.describe(name, help_text)
    return metrics


@contextlib.asynccontextmanager
async def open_services(settings: OrchestratorSettings) -> AsyncIterator[Services]:
    """Build every service from ``settings``; close them in reverse order on exit.

    With the in-process registry, sandboxes are destroyed on exit: nothing else
    could ever find them again. Their checkpoints stay in the snapshot store, so
    the next process restores the session.
    """
    async with contextlib.AsyncExitStack() as stack:
        store = open_snapshot_store(
            settings.snapshot_url, default_dir=settings.snapshot_dir, s3=settings.s3
        )
        stack.push_async_callback(store.close)
        registry = open_registry(settings)
        stack.push_async_callback(registry.close)
        provider = open_provider(settings.provider)
        stack.push_async_callback(provider.close)
        inputs = DirectoryInputSource(settings.inputs_dir)
        metrics = _metrics()
        manager = SandboxManager(
            provider,
            registry,
            store,
            budgets=settings.budgets,
            checkpoint_max_bytes=settings.checkpoint_max_bytes,
            checkpoint_grace_s=settings.checkpoint_grace_s,
            metrics=metrics,
        )
        embedded = settings.registry_url is None
        stack.push_async_callback(manager.aclose, destroy_sandboxes=embedded)
        execution = ExecutionService(manager=manager, mode=settings.session_mode, inputs=inputs)
        yield Services(
            settings=settings,
            store=store,
            registry=registry,
            provider=provider,
            inputs=inputs,
            metrics=metrics,
            manager=manager,
            execution=execution,
        )
