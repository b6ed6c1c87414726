"""``AppInstances``: app sandboxes built from templates, on top of ``SandboxManager``.

An instance is one manager-owned sandbox whose session workspace holds a
template's files (a git repository), with the template's dev server running
as the session's ``dev`` process and a preview served at ``/preview/<id>/``.
The table of instances lives in this process: instances do not survive it
(``aclose`` destroys them), like the embedded registry's sandboxes.

Every API call on an instance holds that instance's lock, so calls on one
instance are serialized and never race its recovery; preview traffic does not
take it. Lifecycle (health, recovery, idle shutdown, runtime-error webhooks)
is in ``lifecycle.py``; one instance's value is ``instance.py``'s, its preview
token's checks ``preview_tokens.py``'s.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable

import anyio

from sandcell_protocol import (
    AnalysisResult,
    ErrorCode,
    ExecuteRequest,
    LogLines,
    ProtocolError,
    RuntimeErrors,
    validate_workspace_path,
)

from ..errors import SandcellError
from ..sessions.manager import SandboxManager, sandbox_session_key
from . import provision
from .client import AppRunnerClient
from .errors import AppRequestError, InstanceNotFoundError
from .instance import Instance, sandbox_spec
from .messages import (
    CommandOutcome,
    CommandResults,
    CreateInstance,
    FilesWritten,
    InstanceCreated,
    RunCommands,
    WriteFiles,
)
from .policy import CommandPolicy
from .preview_tokens import PreviewTokens
from .settings import AppSettings
from .templates import TemplateRegistry
from .webhooks import WebhookSender

__all__ = ["AppInstances"]

log = logging.getLogger(__name__)

_COMMAND_MARGIN_S = 10.0
_MAX_LOG_LINES = 10_000


class AppInstances:
    """Create, use and destroy app instances; see the module docstring."""

    def __init__(
        self,
        manager: SandboxManager,
        *,
        templates: TemplateRegistry,
        settings: AppSettings,
        webhooks: WebhookSender | None = None,
        policy: CommandPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
        new_token: Callable[[], str] = lambda: secrets.token_urlsafe(32),
        new_id: Callable[[], str] = lambda: "app_" + secrets.token_hex(12),
    ) -> None:
        self.manager = manager
        self.templates = templates
        self.settings = settings
        self.webhooks = webhooks
        self.policy = policy or CommandPolicy(settings.denied_commands)
        self.clock = clock
        self._new_token = new_token
        self._new_id = new_id
        self._instances: dict[str, Instance] = {}
        self._previews = PreviewTokens()

    def __repr__(self) -> str:
        return f"AppInstances(instances={len(self._instances)})"

    # -- lookups -------------------------------------------------------------------

    def all(self) -> list[Instance]:
        """Every live instance (any owner)."""
        return list(self._instances.values())

    def get(self, instance_id: str, *, owner: str) -> Instance:
        """``owner``'s instance ``instance_id``; ``InstanceNotFoundError`` otherwise."""
        instance = self._instances.get(instance_id)
        if instance is None or instance.owner != owner:
            raise InstanceNotFoundError(instance_id)
        return instance

    def owned_by(self, owner: str) -> list[Instance]:
        """``owner``'s instances, oldest first."""
        return [item for item in self._instances.values() if item.owner == owner]

    def authorize_preview(self, instance_id: str, token: str | None) -> Instance | None:
        """The instance if ``token`` is its preview token (constant time), else ``None``."""
        instance = self._instances.get(instance_id)
        return instance if self._previews.opens(instance, token) else None

    def was_deleted(self, instance_id: str, token: str | None) -> bool:
        """Whether ``token`` was the preview token of ``instance_id`` before it was deleted."""
        return self._previews.was_deleted(instance_id, token)

    def preview_url(self, instance: Instance) -> str:
        """The preview URL handed to the caller: it carries the token for the first visit."""
        return f"{self.settings.public_url}{instance.preview_prefix}?token={instance.preview_token}"

    def touch(self, instance: Instance) -> None:
        """Count activity (API call or preview traffic) for idle shutdown."""
        instance.last_active = self.clock()

    @contextlib.asynccontextmanager
    async def _using(self, instance: Instance) -> AsyncIterator[Instance]:
        """Hold the instance's lock for one API call; it may have stopped while we waited."""
        async with instance.lock:
            if instance.status == "stopped":
                raise InstanceNotFoundError(instance.instance_id)
            self.touch(instance)
            yield instance

    # -- create / destroy --------------------------------------------------------------

    async def create(self, request: CreateInstance, *, owner: str) -> InstanceCreated:
        """Acquire a sandbox, copy the template, install, start, wait ready; checkpoint it."""
        if request.webhook_url is not None:
            if self.webhooks is None:
                raise AppRequestError(
                    "webhook_url needs SANDCELL_APP_WEBHOOK_SECRET on the service"
                )
            # Before a sandbox is acquired: a refused destination is a plain 400.
            self.webhooks.check_url(request.webhook_url)
        template = await self.templates.load(request.template)
        instance_id = self._new_id()
        spec = sandbox_spec(
            template=template.name, env=request.env, instance_id=instance_id, egress=request.egress
        )
        sandbox_uuid = str(uuid.uuid4())
        session_id = sandbox_session_key(sandbox_uuid)
        handle = await self.manager.acquire(session_id, spec, owner=owner)
        runner: AppRunnerClient | None = None
        try:
            runner = AppRunnerClient.for_handle(handle)
            instance = Instance(
                instance_id=instance_id,
                owner=owner,
                template=template.name,
                manifest=template.manifest,
                project_name=request.project_name,
                sandbox_uuid=sandbox_uuid,
                handle=handle,
                runner=runner,
                last_active=self.clock(),
                preview_token=self._new_token(),
                env=dict(request.env),
                webhook_url=request.webhook_url,
                egress=request.egress,
            )
            await provision.copy_template(handle, template)
            await provision.git_init(
                handle, template=template.name, author=self.settings.git_author
            )
            await provision.install(handle, template.manifest, instance.env)
            await provision.start_dev_server(runner, template.manifest, instance.env)
            await provision.wait_ready(runner, template.manifest, clock=self.clock)
        except BaseException:
            with anyio.CancelScope(shield=True):
                if runner is not None:
                    await runner.close()
                await handle.close()
                with contextlib.suppress(SandcellError):
                    await self.manager.destroy(session_id)
            raise
        instance.status = "ready"
        self._instances[instance_id] = instance
        try:
            await self.checkpoint(instance)
        except SandcellError as exc:
            # Open on speed: the health loop retries while the instance is dirty.
            log.warning("app instance %s: first checkpoint failed: %s", instance_id, exc)
        self.touch(instance)  # idle time counts from ready, not from the request
        log.info("app instance %s created from template %s", instance_id, template.name)
        return InstanceCreated(
            instance_id=instance_id, url=self.preview_url(instance), status="ready"
        )

    async def destroy(self, instance_id: str, *, owner: str) -> None:
        """Stop the dev server and destroy the sandbox; ``InstanceNotFoundError`` if unknown."""
        instance = self.get(instance_id, owner=owner)
        await self.shutdown(instance)

    async def shutdown(self, instance: Instance) -> None:
        """Remove ``instance`` and destroy its sandbox and checkpoint (idempotent)."""
        if self._instances.pop(instance.instance_id, None) is None:
            return
        self._previews.deleted(instance)
        # The lock waits out a call or a recovery in flight, so neither can bring a
        # sandbox back after this destroyed it.
        with anyio.CancelScope(shield=True):
            async with instance.lock:
                instance.status = "stopped"
                with contextlib.suppress(SandcellError, TimeoutError):
                    with anyio.fail_after(10):
                        await instance.runner.stop_process(provision.DEV_TAG)
                await instance.runner.close()
                await instance.handle.close()
                try:
                    await self.manager.destroy(instance.session_id)
                except SandcellError as exc:
                    log.warning("app instance %s: destroy failed: %s", instance.instance_id, exc)
        log.info("app instance %s shut down", instance.instance_id)

    async def aclose(self) -> None:
        """Shut every instance down: none could be found again after this process."""
        for instance in self.all():
            await self.shutdown(instance)

    # -- files and commands ---------------------------------------------------------------

    async def write_files(
        self, instance_id: str, request: WriteFiles, *, owner: str
    ) -> FilesWritten:
        """Write files (all validated first); commit them when a message is given."""
        instance = self.get(instance_id, owner=owner)
        prepared = [
            (_file_path(item.path), _file_bytes(item.content, item.encoding))
            for item in request.files
        ]
        async with self._using(instance):
            for path, data in prepared:
                await instance.handle.files.write(path, data)
            instance.dirty = True
            commit = None
            if request.commit_message is not None:
                commit = await self._commit(
                    instance, [path for path, _ in prepared], request.commit_message
                )
        return FilesWritten(written=[path for path, _ in prepared], commit=commit)

    async def _commit(self, instance: Instance, paths: list[str], message: str) -> str | None:
        git = instance.handle.git
        await git.add(paths)
        staged = [
            line
            for line in (await git.status()).splitlines()
            if line[:1] not in ("#", " ", "?", "")
        ]
        if not staged:
            return None
        author = self.settings.git_author
        return await git.commit(message, author_name=author.name, author_email=author.email)

    async def run_commands(
        self, instance_id: str, request: RunCommands, *, owner: str
    ) -> CommandResults:
        """Check every command against the policy, then run them in order."""
        instance = self.get(instance_id, owner=owner)
        self.policy.check_all(request.commands)
        results: list[CommandOutcome] = []
        async with self._using(instance):
            for command in request.commands:
                job = ExecuteRequest(
                    language="bash",
                    code=command,
                    env=instance.env,
                    timeout_ms=max(1, int(request.timeout_s * 1000)),
                )
                result = await instance.handle.runner.execute(
                    job,
                    session_id=instance.handle.session_id,
                    timeout_s=request.timeout_s + _COMMAND_MARGIN_S,
                )
                results.append(
                    CommandOutcome(
                        command=command,
                        stdout=result.stdout,
                        stderr=result.stderr,
                        exit_code=result.exit_code,
                        status=result.status.value,
                    )
                )
            instance.dirty = True
        return instance.diagnostic(CommandResults(results=results))

    # -- diagnostics ------------------------------------------------------------------------

    async def analysis(self, instance_id: str, *, owner: str) -> AnalysisResult:
        """Static analysis of the workspace, run by the runner inside the jail."""
        instance = self.get(instance_id, owner=owner)
        async with self._using(instance):
            return instance.diagnostic(await instance.runner.analysis())

    async def runtime_errors(
        self, instance_id: str, *, owner: str, since: float | None = None
    ) -> RuntimeErrors:
        """Deduplicated runtime errors (browser and server side)."""
        instance = self.get(instance_id, owner=owner)
        self.touch(instance)
        return instance.diagnostic(await instance.runner.runtime_errors(since=since))

    async def clear_runtime_errors(self, instance_id: str, *, owner: str) -> None:
        """Forget the collected runtime errors (webhooks fire again for a recurrence)."""
        instance = self.get(instance_id, owner=owner)
        self.touch(instance)
        await instance.runner.clear_runtime_errors()
        instance.seen_errors.clear()

    async def logs(
        self, instance_id: str, *, owner: str, lines: int | None = None, filter: str | None = None
    ) -> LogLines:
        """The dev server's last ``lines`` output lines matching the regex ``filter``."""
        if lines is not None and not 1 <= lines <= _MAX_LOG_LINES:
            raise AppRequestError(f"lines: must be between 1 and {_MAX_LOG_LINES}")
        instance = self.get(instance_id, owner=owner)
        self.touch(instance)
        found = await instance.runner.logs(provision.DEV_TAG, lines=lines, filter=filter)
        return instance.diagnostic(found)

    # -- checkpoints -----------------------------------------------------------------------

    async def checkpoint(self, instance: Instance) -> None:
        """Save the workspace where a recovery restores it from (``SandboxManager``'s
        own checkpoint of the sandbox, which ``destroy`` also deletes). The sandbox
        keeps running; on every provider, Lambda MicroVMs included, the copy goes
        to the snapshot store."""
        await self.manager.save(instance.session_id, instance.handle)
        instance.dirty = False


def _file_path(path: str) -> str:
    try:
        normalized = validate_workspace_path(path)
    except ProtocolError as exc:
        raise AppRequestError(f"{path[:100]!r}: {exc}", code=ErrorCode.INVALID_PATH) from None
    if ".git" in normalized.split("/"):
        raise AppRequestError(
            f"{normalized[:100]!r}: .git is managed by the service", code=ErrorCode.INVALID_PATH
        )
    return normalized


def _file_bytes(content: str, encoding: str) -> bytes:
    if encoding == "utf-8":
        try:
            return content.encode("utf-8")
        except UnicodeEncodeError:
            raise AppRequestError("content: not valid UTF-8 text") from None
    try:
        return base64.b64decode(content, validate=True)
    except (binascii.Error, ValueError):
        raise AppRequestError("content: not valid base64") from None
