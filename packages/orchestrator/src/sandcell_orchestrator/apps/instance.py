"""``Instance``: one app instance, the value ``AppInstances`` keeps per instance id.

Its ``handle`` and ``runner`` change when a recovery replaces the sandbox; its
id, owner, preview token and sandbox id do not. What every (re)created sandbox of
it is launched with is ``sandbox_spec``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

import anyio
import msgspec

from sandcell_protocol import EgressPolicy, redact_message

from ..handle import SandboxHandle
from ..providers.base import SandboxSpec
from ..sessions.manager import sandbox_session_key
from .client import AppRunnerClient
from .templates import TemplateManifest

__all__ = ["Instance", "sandbox_spec"]

M = TypeVar("M", bound=msgspec.Struct)

_OWNER_LABEL = "sandcell.app_instance"


def sandbox_spec(
    *, template: str, env: dict[str, str], instance_id: str, egress: EgressPolicy | None
) -> SandboxSpec:
    """What a sandbox of the instance ``instance_id`` is launched with (labelled its own)."""
    return SandboxSpec(
        template=template, env=env, labels={_OWNER_LABEL: instance_id}, egress=egress
    )


@dataclass(eq=False)
class Instance:
    """One app instance. ``handle``/``runner`` change when a recovery replaces the sandbox."""

    instance_id: str
    owner: str
    template: str
    manifest: TemplateManifest
    project_name: str
    sandbox_uuid: str
    """The instance's stable sandbox id; its runtime session is ``session_id``."""
    handle: SandboxHandle
    runner: AppRunnerClient
    last_active: float
    preview_token: str = field(repr=False)
    env: dict[str, str] = field(repr=False)
    webhook_url: str | None = field(default=None, repr=False)
    egress: EgressPolicy | None = None
    status: str = "starting"
    dirty: bool = True
    seen_errors: set[str] = field(default_factory=set, repr=False)
    lock: anyio.Lock = field(default_factory=anyio.Lock, repr=False)

    @property
    def session_id(self) -> str:
        """The runtime session the manager keeps this instance's sandbox under."""
        return sandbox_session_key(self.sandbox_uuid)

    def diagnostic(self, value: M) -> M:
        """``value`` as an agent may see it: this instance's preview token, URL
        credentials and bearer tokens redacted (sandcell_protocol.redaction)."""
        return redact_message(value, secrets=(self.preview_token,))

    @property
    def preview_prefix(self) -> str:
        """The path prefix the preview is served under (what the app sees as forwarded)."""
        return f"/preview/{self.instance_id}/"

    def spec(self) -> SandboxSpec:
        """What a (re)created sandbox of this instance is launched with."""
        return sandbox_spec(
            template=self.template, env=self.env, instance_id=self.instance_id, egress=self.egress
        )
