"""The provider seam: what every sandbox backend (local, docker, lambda-microvm) offers.

Feature code (``SandboxManager``, ``ExecutionService``) sees only these types and
``SandboxHandle``; vendor SDKs stay inside their provider module.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    from ..handle import SandboxHandle


SESSION_LABEL = "sandcell.session_id"
"""Spec label naming the runtime session a sandbox's runner binds to."""


def sandbox_session_id(sandbox_id: str) -> str:
    """The runtime-session id of a sandbox whose spec named none."""
    return "rt_" + hashlib.sha256(b"sandbox\x00" + sandbox_id.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class ResourceLimits:
    """Limits of the sandbox itself (container/VM), not of one execution."""

    memory_mib: int | None = None
    pids: int | None = None
    cpus: float | None = None


@dataclass(frozen=True, slots=True)
class SandboxSpec:
    """What to launch. ``image`` for container/VM providers, ``template`` for app sandboxes."""

    image: str | None = None
    template: str | None = None
    turn_timeout_s: float = 60.0
    env: Mapping[str, str] = field(default_factory=dict)
    egress_allowlist: tuple[str, ...] = ()
    limits: ResourceLimits = field(default_factory=ResourceLimits)
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PersistentWorkspace:
    """Which workspace paths a snapshot keeps (glob patterns, relative to the workspace)."""

    include: tuple[str, ...] = ("**",)
    exclude: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ObjectSnapshot:
    """A tar checkpoint in the snapshot store."""

    key: str
    sha256: str | None = None
    size: int | None = None
    kind: Literal["object"] = "object"


@dataclass(frozen=True, slots=True)
class NativeSnapshot:
    """A provider-native suspended sandbox (e.g. a suspended MicroVM)."""

    provider: str
    sandbox_id: str
    kind: Literal["native"] = "native"


SnapshotRef = ObjectSnapshot | NativeSnapshot
"""Tagged by ``kind``: an object-store tar key, or a provider-native suspended id."""


@dataclass(frozen=True, slots=True)
class SandboxCapabilities:
    """What a provider can do natively; the manager decides suspend policy from it."""

    pause_resume: bool


@runtime_checkable
class SandboxProvider(Protocol):
    """A sandbox backend. Implementations translate vendor errors into ``SandcellError``s."""

    name: str
    capabilities: SandboxCapabilities

    async def create(self, spec: SandboxSpec) -> SandboxHandle:
        """Launch a sandbox and return once its runner answers ``/health``."""
        ...

    async def connect(self, sandbox_id: str) -> SandboxHandle:
        """A handle to an existing sandbox; ``SandboxNotFoundError`` if it is gone."""
        ...

    async def destroy(self, sandbox_id: str) -> None:
        """Remove the sandbox; idempotent (a missing sandbox returns quietly)."""
        ...

    async def persist(
        self, handle: SandboxHandle, workspace: PersistentWorkspace, *, key: str
    ) -> SnapshotRef:
        """Save the sandbox's state: native suspend, or a checkpoint stored under ``key``."""
        ...

    async def resume(self, ref: SnapshotRef, spec: SandboxSpec) -> SandboxHandle:
        """Bring a persisted sandbox back (its provider id may change)."""
        ...

    async def delete_snapshot(self, ref: SnapshotRef) -> None:
        """Drop what ``persist`` made: a blob delete, or a no-op for native snapshots."""
        ...

    async def close(self) -> None:
        """Release clients and pools; idempotent."""
        ...
