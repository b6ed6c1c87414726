"""The package root is the embedder's API: exported on purpose, and cheap to import."""

from __future__ import annotations

import subprocess
import sys

import sandcell_orchestrator

PINNED = [
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


def test_all_is_pinned_and_every_name_resolves() -> None:
    assert sandcell_orchestrator.__all__ == PINNED
    for name in PINNED:
        assert getattr(sandcell_orchestrator, name) is not None, name
    assert set(PINNED) <= set(dir(sandcell_orchestrator))


def test_the_root_names_are_the_modules_own() -> None:
    """A root name is the same object as in its home module (no copies, no wrappers)."""
    from sandcell_orchestrator.errors import SandcellError
    from sandcell_orchestrator.sessions.execution import ExecutionService
    from sandcell_orchestrator.sessions.manager import SandboxManager

    assert sandcell_orchestrator.SandboxManager is SandboxManager
    assert sandcell_orchestrator.ExecutionService is ExecutionService
    assert sandcell_orchestrator.SandcellError is SandcellError
    for name in PINNED:
        value = getattr(sandcell_orchestrator, name)
        if isinstance(value, type) and issubclass(value, Exception):
            assert issubclass(value, SandcellError), name


def test_importing_the_root_and_the_cli_loads_no_backend_sdk() -> None:
    """The embedded default (and ``sandcell exec``) never imports a vendor SDK or the
    HTTP service: those load when configuration chooses them."""
    code = (
        "import sys, sandcell_orchestrator, sandcell_orchestrator.cli\n"
        "from sandcell_orchestrator import SandboxManager, ExecutionService, open_services\n"
        "bad = ('boto3', 'botocore', 'redis', 'minio', 'urllib3', 'starlette', 'uvicorn',\n"
        "       'websockets', 'sandcell_orchestrator.apps.routes')\n"
        "print(sorted(m for m in bad if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]"
