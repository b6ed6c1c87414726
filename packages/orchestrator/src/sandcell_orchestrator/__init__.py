"""sandcell's orchestrator: what a control plane embeds.

    from sandcell_orchestrator import Identity, OrchestratorSettings, open_services

    settings = OrchestratorSettings.from_env(os.environ)
    async with open_services(settings) as services:
        alice = Identity("tenant", "alice")
        result = await services.execution.execute(request, alice, hint="chat-7")
        handle = await services.manager.acquire(session_id, SandboxSpec(), owner="me")

Every name below is importable from the package root; each loads its module on
first use, so ``import sandcell_orchestrator`` (and the CLI) stays cheap and no
backend's vendor SDK is imported before it is chosen.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# A constant, not importlib.metadata (~40 ms at every start-up); a test checks it
# equals the installed distribution's version.
__version__ = "0.1.0"

if TYPE_CHECKING:
    from .bootstrap import Services, open_services
    from .config import Budgets, OrchestratorSettings, ServeSettings
    from .errors import (
        ArchiveRejectedError,
        CheckpointError,
        ConfigError,
        ContextLostError,
        InputMissingError,
        LockLostError,
        ProtocolMismatchError,
        RegistryError,
        RunnerRequestError,
        SandboxCommandError,
        SandboxError,
        SandboxNotFoundError,
        SandboxTimeoutError,
        SandboxUnavailableError,
        SandcellError,
        SessionBusyError,
        SessionConflictError,
        SessionError,
        SessionRequiredError,
    )
    from .handle import CommandResult, SandboxHandle
    from .providers import open_provider
    from .providers.base import (
        NativeSuspend,
        ResourceLimits,
        SandboxCapabilities,
        SandboxProvider,
        SandboxSpec,
    )
    from .registry import FencedError, SessionRecord, SessionRegistry
    from .runner.client import RunnerClient
    from .sessions.execution import ExecutionService, Identity
    from .sessions.inputs import DirectoryInputSource, InputSource
    from .sessions.manager import Attached, Hold, SandboxManager, sandbox_session_key
    from .sessions.persistence import PersistentWorkspace
    from .snapshots import (
        SnapshotNotFoundError,
        SnapshotStore,
        SnapshotUnavailableError,
        open_snapshot_store,
    )

_HOMES: dict[str, str] = {
    # wiring
    "Services": "bootstrap",
    "open_services": "bootstrap",
    "open_provider": "providers",
    "open_snapshot_store": "snapshots",
    # settings
    "Budgets": "config",
    "OrchestratorSettings": "config",
    "ServeSettings": "config",
    # the lifecycle and the turns on top of it
    "Attached": "sessions.manager",
    "Hold": "sessions.manager",
    "SandboxManager": "sessions.manager",
    "sandbox_session_key": "sessions.manager",
    "ExecutionService": "sessions.execution",
    "Identity": "sessions.execution",
    "PersistentWorkspace": "sessions.persistence",
    "InputSource": "sessions.inputs",
    "DirectoryInputSource": "sessions.inputs",
    # sandboxes
    "SandboxHandle": "handle",
    "CommandResult": "handle",
    "RunnerClient": "runner.client",
    "SandboxSpec": "providers.base",
    "ResourceLimits": "providers.base",
    "SandboxProvider": "providers.base",
    "SandboxCapabilities": "providers.base",
    "NativeSuspend": "providers.base",
    # state
    "SessionRecord": "registry",
    "SessionRegistry": "registry",
    "SnapshotStore": "snapshots",
    # errors
    "SandcellError": "errors",
    "ConfigError": "errors",
    "SandboxError": "errors",
    "SandboxCommandError": "errors",
    "SandboxTimeoutError": "errors",
    "SandboxUnavailableError": "errors",
    "SandboxNotFoundError": "errors",
    "ContextLostError": "errors",
    "RunnerRequestError": "errors",
    "SessionError": "errors",
    "SessionBusyError": "errors",
    "SessionRequiredError": "errors",
    "SessionConflictError": "errors",
    "LockLostError": "errors",
    "FencedError": "registry",
    "ProtocolMismatchError": "errors",
    "CheckpointError": "errors",
    "ArchiveRejectedError": "errors",
    "SnapshotNotFoundError": "snapshots",
    "SnapshotUnavailableError": "snapshots",
    "InputMissingError": "errors",
    "RegistryError": "errors",
}

__all__ = [
    "ArchiveRejectedError",
    "Attached",
    "Budgets",
    "CheckpointError",
    "CommandResult",
    "ConfigError",
    "ContextLostError",
    "DirectoryInputSource",
    "ExecutionService",
    "FencedError",
    "Hold",
    "Identity",
    "InputMissingError",
    "InputSource",
    "LockLostError",
    "NativeSuspend",
    "OrchestratorSettings",
    "PersistentWorkspace",
    "ProtocolMismatchError",
    "RegistryError",
    "ResourceLimits",
    "RunnerClient",
    "RunnerRequestError",
    "SandboxCapabilities",
    "SandboxCommandError",
    "SandboxError",
    "SandboxHandle",
    "SandboxManager",
    "SandboxNotFoundError",
    "SandboxProvider",
    "SandboxSpec",
    "SandboxTimeoutError",
    "SandboxUnavailableError",
    "SandcellError",
    "ServeSettings",
    "Services",
    "SessionBusyError",
    "SessionConflictError",
    "SessionError",
    "SessionRecord",
    "SessionRegistry",
    "SessionRequiredError",
    "SnapshotNotFoundError",
    "SnapshotStore",
    "SnapshotUnavailableError",
    "__version__",
    "open_provider",
    "open_services",
    "open_snapshot_store",
    "sandbox_session_key",
]


def __getattr__(name: str) -> object:
    module = _HOMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
