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
import importlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, cast

from .config import OrchestratorSettings
from .errors import ConfigError
from .metrics import METRIC_HELP, Metrics
from .providers.base import SandboxProvider
from .providers.local import LocalProvider, LocalSettings
from .registry import SessionRegistry
from .sessions.execution import ExecutionService
from .sessions.inputs import DirectoryInputSource
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
    execution: ExecutionService


def open_registry(settings: OrchestratorSettings) -> SessionRegistry:
    """The in-process registry, or Redis when ``SANDCELL_REGISTRY_URL`` is set."""
    if settings.registry_url is None:
        from .registry.memory import InProcessRegistry

        return InProcessRegistry()
    from .registry.redis import RedisRegistry

    return RedisRegistry.from_url(settings.registry_url)


def open_provider(settings: OrchestratorSettings, *, store: SnapshotStore) -> SandboxProvider:
    """The provider ``SANDCELL_PROVIDER`` names; ``ConfigError`` if it cannot be built."""
    if settings.provider == "local":
        local = LocalSettings.from_env(
            settings.env,
            pool_size=settings.local_pool_size,
            checkpoint_max_bytes=settings.checkpoint_max_bytes,
        )
        return LocalProvider(local, store=store)
    if settings.provider == "lambda-microvm":
        provider_module = _provider_module("lambda_microvm", settings.provider)
        settings_module = _provider_module("lambda_settings", settings.provider)
        lambda_settings = _attr(settings_module, "LambdaMicrovmSettings", settings.provider)
        provider_class = _attr(provider_module, "LambdaMicrovmProvider", settings.provider)
        return cast(SandboxProvider, provider_class(lambda_settings.from_env(settings.env)))
    if settings.provider == "docker":
        module = _provider_module("docker", settings.provider)
        docker_settings = _attr(module, "DockerSettings", settings.provider).from_env(
            settings.env, checkpoint_max_bytes=settings.checkpoint_max_bytes
        )
        provider_class = _attr(module, "DockerProvider", settings.provider)
        return cast(SandboxProvider, provider_class(docker_settings, store=store))
    raise ConfigError(f"provider {settings.provider} is not available")


def _provider_module(module: str, provider: str) -> Any:
    try:
        return importlib.import_module(f"{__package__}.providers.{module}")
    except ImportError as exc:
        # Only a missing provider module means "not available"; a provider that
        # exists but fails to import is a bug to surface, not to rename.
        if exc.name not in (f"{__package__}.providers.{module}", None):
            raise
        raise ConfigError(f"provider {provider} is not available") from None


def _attr(module: Any, name: str, provider: str) -> Any:
    value = getattr(module, name, None)
    if value is None:
        raise ConfigError(f"provider {provider} is not available ({name} is missing)")
    return value


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
            settings.snapshot_url, default_dir=settings.snapshot_dir, env=settings.env
        )
        stack.push_async_callback(store.close)
        registry = open_registry(settings)
        stack.push_async_callback(registry.close)
        provider = open_provider(settings, store=store)
        stack.push_async_callback(provider.close)
        inputs = DirectoryInputSource(settings.inputs_dir)
        metrics = _metrics()
        execution = ExecutionService(
            provider=provider,
            registry=registry,
            store=store,
            mode=settings.session_mode,
            budgets=settings.budgets,
            checkpoint_max_bytes=settings.checkpoint_max_bytes,
            inputs=inputs,
            metrics=metrics,
        )
        embedded = settings.registry_url is None
        stack.push_async_callback(execution.aclose, destroy_sandboxes=embedded)
        yield Services(
            settings=settings,
            store=store,
            registry=registry,
            provider=provider,
            inputs=inputs,
            metrics=metrics,
            execution=execution,
        )
