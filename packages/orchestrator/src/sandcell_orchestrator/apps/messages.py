"""Request and response bodies of the app-instance API (``/v1/instances``).

Strict like the wire contract: unknown fields, wrong types and out-of-range
values are ``bad_request`` errors, never silently dropped.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from sandcell_protocol import EgressPolicy

__all__ = [
    "CommandOutcome",
    "CommandResults",
    "CreateInstance",
    "FileWrite",
    "FilesWritten",
    "InstanceCreated",
    "InstanceInfo",
    "InstanceList",
    "RunCommands",
    "WriteFiles",
]

ProjectName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9 _.-]{0,99}$")]
TemplateName = Annotated[str, msgspec.Meta(pattern=r"^[a-z0-9][a-z0-9._-]{0,63}$")]
# The shape only (no user info; no backslash, which URL parsers disagree about):
# whether the destination may be reached depends on the operator's allow-list, so
# AppInstances.create asks the WebhookSender (``check_url``) and the sender checks
# again on every connection.
WebhookUrl = Annotated[
    str, msgspec.Meta(pattern=r"^https?://[^\s@/?#\\]+(/[^\s#\\]*)?$", max_length=2048)
]
EnvName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")]
Command = Annotated[str, msgspec.Meta(min_length=1, max_length=16384)]


class _Body(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


class CreateInstance(_Body, frozen=True):
    """``POST /v1/instances``."""

    template: TemplateName
    project_name: ProjectName
    webhook_url: WebhookUrl | None = None
    """Where runtime-error webhooks go: a public address unless the operator allowed more."""
    env: Annotated[dict[EnvName, str], msgspec.Meta(max_length=100)] = msgspec.field(
        default_factory=dict
    )
    egress: EgressPolicy | None = None
    """The instance sandbox's egress policy (None: ``deny_all``); kept across recoveries."""

    def __repr__(self) -> str:
        # Env values are the caller's configuration and may be credentials.
        return (
            f"CreateInstance(template={self.template!r}, project_name={self.project_name!r},"
            f" env_keys={sorted(self.env)})"
        )


class InstanceCreated(_Body, frozen=True):
    """The answer to ``POST /v1/instances``: the preview ``url`` carries its token."""

    instance_id: str
    url: str
    status: Literal["ready"]


class FileWrite(_Body, frozen=True):
    """One file: ``content`` is text, or base64 of the bytes when ``encoding`` says so."""

    path: str
    content: str
    encoding: Literal["utf-8", "base64"] = "utf-8"


class WriteFiles(_Body, frozen=True):
    """``POST /v1/instances/{id}/files``."""

    files: Annotated[list[FileWrite], msgspec.Meta(min_length=1, max_length=1000)]
    commit_message: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)] | None = None


class FilesWritten(_Body, frozen=True):
    """The normalized paths written, and the new commit's sha when one was made."""

    written: list[str]
    commit: str | None = None


class RunCommands(_Body, frozen=True):
    """``POST /v1/instances/{id}/commands``: run in order, each as its own ``bash -c``."""

    commands: Annotated[list[Command], msgspec.Meta(min_length=1, max_length=50)]
    timeout_s: Annotated[float, msgspec.Meta(gt=0, le=600)] = 60.0


class CommandOutcome(_Body, frozen=True):
    """One command's result; ``status`` is the runner's (``ok``, ``timeout``, ...)."""

    command: str
    stdout: str
    stderr: str
    exit_code: int | None
    status: str


class CommandResults(_Body, frozen=True):
    results: list[CommandOutcome]


class InstanceInfo(_Body, frozen=True):
    """One instance as ``GET /v1/instances`` lists it (no token: only create returns the URL)."""

    instance_id: str
    template: str
    project_name: str
    status: Literal["ready", "starting", "recovering", "degraded"]
    dev_server: Literal["running", "exited", "unknown"]
    idle_s: float


class InstanceList(_Body, frozen=True):
    instances: list[InstanceInfo]
