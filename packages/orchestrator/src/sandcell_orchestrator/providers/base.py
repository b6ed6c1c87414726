"""The provider seam: what every sandbox backend (local, docker, lambda-microvm) offers.

Feature code (``SandboxManager``, ``ExecutionService``) sees only these types and
``SandboxHandle``; vendor SDKs stay inside their provider module. A provider does
compute (create, connect, destroy, close) and, optionally, its own native
suspend; object-store persistence belongs to ``SandboxManager``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from sandcell_protocol import EgressPolicy

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
    egress: EgressPolicy | None = None
    """The sandbox's egress policy, set on its runner as soon as it is up (None: the
    runner's own, ``deny_all`` unless its operator said otherwise); see docs/egress.md."""
    limits: ResourceLimits = field(default_factory=ResourceLimits)
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SandboxCapabilities:
    """What a provider can do natively; the manager's one suspend policy branches on it."""

    pause_resume: bool
    """Suspends in place (``NativeSuspend``); otherwise suspend = checkpoint, destroy."""


@runtime_checkable
class SandboxProvider(Protocol):
    """A sandbox backend: compute only. Implementations translate vendor errors into
    ``SandcellError``s.

    What every backend has: create, connect, destroy, close. Saving a sandbox's
    workspace to object storage is not a provider's job (``SandboxManager`` pulls
    the checkpoint from the runner); a backend that can suspend a sandbox in place
    also implements ``NativeSuspend``, and says so in ``capabilities``.
    """

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

    async def close(self) -> None:
        """Release clients and pools; idempotent."""
        ...


@runtime_checkable
class NativeSuspend(Protocol):
    """The optional capability of suspending a sandbox in place (a Lambda MicroVM).

    Memory, processes and files stay with the suspended sandbox, under the same id.
    """

    async def suspend(self, sandbox_id: str) -> None:
        """Suspend the running sandbox; ``SandboxNotFoundError`` if it is gone."""
        ...

    async def resume(self, sandbox_id: str, spec: SandboxSpec) -> SandboxHandle:
        """Resume a suspended (or still running) sandbox; ``SandboxNotFoundError`` if gone."""
        ...


@runtime_checkable
class Remains(Protocol):
    """The optional capability of listing sandboxes that serve no one any more, so the
    sweeper can remove the ones no record points at (a worker that died between
    launching a sandbox and recording it, a record lost with a wiped Redis)."""

    async def dead_sandboxes(self) -> dict[str, float]:
        """This deployment's sandboxes whose runner is gone, or that only a record could
        still claim (Docker: a session's running container): id -> seconds since
        created. The sweeper removes those no record names, once past a launch."""
        ...


def native_suspend(provider: SandboxProvider) -> NativeSuspend | None:
    """The provider's native suspend, if it declares and implements one."""
    if provider.capabilities.pause_resume and isinstance(provider, NativeSuspend):
        return provider
    return None
