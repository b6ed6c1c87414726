"""E2B's control-plane JSON, as the ``e2b`` SDK (2.63) sends and reads it.

Field names are E2B's exactly (``templateID``, ``envVars``, ``allow_internet_access``…).
Requests are strict (an unknown field is a 400); fields the SDK sends that
sandcell does not serve are accepted only with their neutral value, so a caller
asking for a volume or an MCP gateway gets a clear 400 instead of a sandbox
without it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

__all__ = [
    "AutoResume",
    "ConnectSandbox",
    "ErrorBody",
    "ForkError",
    "ForkResult",
    "ForkSandbox",
    "ListedSandbox",
    "NewSandbox",
    "PauseSandbox",
    "SandboxCreated",
    "SandboxDetail",
    "SandboxMetric",
    "SetTimeout",
    "SnapshotInfo",
    "SnapshotSandbox",
    "State",
    "UpdateNetwork",
]

State = Literal["running", "paused"]
TimeoutSeconds = Annotated[int, msgspec.Meta(ge=0)]


class _Request(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


class AutoResume(_Request, frozen=True, kw_only=True):
    """``autoResume``: wake a paused sandbox on traffic (not served: only ``false``)."""

    enabled: bool = False


class NewSandbox(_Request, frozen=True, kw_only=True):
    """``POST /v2/sandboxes``."""

    templateID: str
    timeout: TimeoutSeconds | None = None
    autoPause: bool | None = None
    autoPauseMemory: bool | None = None
    autoResume: AutoResume | None = None
    allow_internet_access: bool | None = None
    network: dict[str, Any] | None = None
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    envVars: dict[str, str] = msgspec.field(default_factory=dict)
    mcp: Any = None
    iam: Any = None
    volumeMounts: list[Any] | None = None
    secure: bool | None = None


class ConnectSandbox(_Request, frozen=True, kw_only=True):
    """``POST /v2/sandboxes/{id}/connect``: resume if paused; extend the timeout."""

    timeout: TimeoutSeconds | None = None
    memory: bool | None = None


class SetTimeout(_Request, frozen=True, kw_only=True):
    """``POST /sandboxes/{id}/timeout``: the sandbox ends ``timeout`` seconds from now."""

    timeout: TimeoutSeconds


class UpdateNetwork(_Request, frozen=True, kw_only=True):
    """``PUT /sandboxes/{id}/network``: the running sandbox's egress settings, replaced
    whole (an omitted field is cleared), in the create's ``network`` names."""

    allowOut: list[str] | None = None
    denyOut: list[str] | None = None
    dnsServers: list[str] | None = None
    egressProxy: Any = None
    rules: Any = None
    allow_internet_access: bool | None = None

    def network(self) -> dict[str, Any]:
        """The fields given, as a create's ``network`` object."""
        given = {
            "allowOut": self.allowOut,
            "denyOut": self.denyOut,
            "dnsServers": self.dnsServers,
            "egressProxy": self.egressProxy,
            "rules": self.rules,
        }
        return {key: value for key, value in given.items() if value is not None}


class PauseSandbox(_Request, frozen=True, kw_only=True):
    """``POST /sandboxes/{id}/pause``."""

    memory: bool | None = None
    requireHealthyGuest: bool | None = None


class SnapshotSandbox(_Request, frozen=True, kw_only=True):
    """``POST /sandboxes/{id}/snapshots``: ``memory`` is taken either way (a snapshot
    here is always of the filesystem: processes are not carried); ``name``:
    ``[<team slug>/]<name>[:<tag>]``, E2B's named snapshot."""

    name: str | None = None
    memory: bool | None = None


class SnapshotInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot, as create and the listing answer it: ``snapshotID`` is a template id."""

    snapshotID: str
    names: list[str]


class SandboxCreated(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The answer of create and connect (its tokens are the caller's: ``repr`` leaves
    them out)."""

    templateID: str
    sandboxID: str
    clientID: str
    envdVersion: str
    envdAccessToken: str
    trafficAccessToken: str | None = None
    alias: str | None = None
    domain: str | None = None

    def __repr__(self) -> str:
        return f"SandboxCreated(sandboxID={self.sandboxID!r}, templateID={self.templateID!r})"


class ListedSandbox(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One item of ``GET /v2/sandboxes``."""

    templateID: str
    sandboxID: str
    clientID: str
    startedAt: str
    endAt: str
    cpuCount: int
    memoryMB: int
    diskSizeMB: int
    state: State
    envdVersion: str
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    alias: str | None = None


class SandboxDetail(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """``GET /sandboxes/{id}`` (``repr`` leaves the token out)."""

    templateID: str
    sandboxID: str
    clientID: str
    startedAt: str
    endAt: str
    cpuCount: int
    memoryMB: int
    diskSizeMB: int
    state: State
    envdVersion: str
    envdAccessToken: str
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    alias: str | None = None
    domain: str | None = None

    def __repr__(self) -> str:
        return f"SandboxDetail(sandboxID={self.sandboxID!r}, state={self.state!r})"


class SandboxMetric(msgspec.Struct, frozen=True, kw_only=True):
    """One item of ``GET /sandboxes/{id}/metrics``: a sample (bytes, percent of
    ``cpuCount``; ``timestamp`` RFC 3339, ``timestampUnix`` whole seconds)."""

    timestamp: str
    timestampUnix: int
    cpuCount: int
    cpuUsedPct: float
    memUsed: int
    memTotal: int
    memCache: int
    diskUsed: int
    diskTotal: int


class ErrorBody(msgspec.Struct, frozen=True, kw_only=True):
    """E2B's error shape (``code`` is the HTTP status) plus sandcell's machine-readable
    ``error_code``."""

    code: int
    message: str
    error_code: str


class ForkSandbox(_Request, frozen=True, kw_only=True):
    """``POST /sandboxes/{id}/fork``: ``count`` sandboxes from one snapshot of it."""

    timeout: TimeoutSeconds | None = None
    count: int | None = None


class ForkError(msgspec.Struct, frozen=True, kw_only=True):
    """One fork's failure, as E2B reports it (``code`` is the HTTP status)."""

    code: int
    message: str


class ForkResult(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One requested fork: exactly one of ``sandbox`` and ``error``."""

    sandbox: SandboxCreated | None = None
    error: ForkError | None = None
