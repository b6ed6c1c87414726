"""App sandboxes: template instances with a dev server, a live preview and diagnostics.

As a library::

    manager = SandboxManager(services.provider, services.registry)
    instances = AppInstances(manager, templates=TemplateRegistry(settings.templates),
                             settings=settings)
    async with InstanceSupervisor(instances).running():
        created = await instances.create(
            CreateInstance(template="python-web", project_name="demo"), owner="default")
        print(created.url)

On ``sandcell serve`` the same API is HTTP (``routes.py``), with the preview at
``/preview/<instance_id>/``.
"""

from __future__ import annotations

from .client import AppRunnerClient
from .errors import AppRequestError, InstanceNotFoundError, InstanceStartError
from .instances import AppInstances, Instance
from .lifecycle import InstanceSupervisor
from .messages import (
    CommandOutcome,
    CommandResults,
    CreateInstance,
    FilesWritten,
    FileWrite,
    InstanceCreated,
    InstanceInfo,
    InstanceList,
    RunCommands,
    WriteFiles,
)
from .policy import DEFAULT_RULES, CommandDeniedError, CommandPolicy, PolicyRule
from .preview import PreviewProxy
from .routes import AppService, install_app_routes
from .settings import AppSettings, GitAuthor
from .templates import (
    Template,
    TemplateError,
    TemplateManifest,
    TemplateNotFoundError,
    TemplateRegistry,
    parse_manifest,
)
from .webhooks import Delivery, WebhookSender, sign, verify_signature

__all__ = [
    "DEFAULT_RULES",
    "AppInstances",
    "AppRequestError",
    "AppRunnerClient",
    "AppService",
    "AppSettings",
    "CommandDeniedError",
    "CommandOutcome",
    "CommandPolicy",
    "CommandResults",
    "CreateInstance",
    "Delivery",
    "FileWrite",
    "FilesWritten",
    "GitAuthor",
    "Instance",
    "InstanceCreated",
    "InstanceInfo",
    "InstanceList",
    "InstanceNotFoundError",
    "InstanceStartError",
    "InstanceSupervisor",
    "PolicyRule",
    "PreviewProxy",
    "RunCommands",
    "Template",
    "TemplateError",
    "TemplateManifest",
    "TemplateNotFoundError",
    "TemplateRegistry",
    "WebhookSender",
    "WriteFiles",
    "install_app_routes",
    "parse_manifest",
    "sign",
    "verify_signature",
]
